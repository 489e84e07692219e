"""On-disk cache of passed IR graphs for :func:`shardc.frontends.load_graph`.

Tracing a full-size model costs 20-80 s; ``compile`` / ``simulate`` / ``bench`` / the tests
load the same model files again and again. An entry is the :meth:`Graph.to_json` text,
gzip-compressed, in ``$SHARDC_CACHE_DIR`` (default ``~/.cache/shardc/graphs``), named by
the sha256 of (each part length-prefixed):

* the model file's bytes and its name and folder name (a ``config.json`` takes its model
  name from them);
* the ``tiny`` flag;
* ``shardc.version.__version__``, the torch and transformers versions (they decide the trace);
* the bytes of every ``.py`` file under ``shardc/frontends`` and ``shardc/passes`` and of
  ``shardc/ir/graph.py`` (so a change to the frontend, the passes or the IR invalidates it).

An entry also records the non-library source files the model code imported while it was
built and traced (:func:`shardc.frontends.imports.recording_imports`: siblings, modules in
sub-packages of the model's folder, packages elsewhere on ``sys.path``) with the sha256 of
each; a lookup whose recorded files are missing or changed is a miss. So the key follows
what the model file actually imported, not a guess at its folder.

Writes are atomic (a temp file in the cache folder, then ``os.replace``); an entry that does
not decompress or parse is ignored (and rewritten by the caller's next store); an unwritable
cache folder disables storing silently; beyond :data:`MAX_ENTRIES` entries the oldest are
deleted. ``SHARDC_NO_CACHE=1`` disables the cache. Only model
files (``.py``, ``config.json``) are cached: an ``.onnx`` file loads in seconds and its
external weight files would have to be hashed too.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import json
from pathlib import Path

from shardc.cache import (  # noqa: F401 (the names re-exported)
    CACHE_DIR_ENV,
    NO_CACHE_ENV,
    cache_dir,
    cache_enabled,
    write_entry,
)
from shardc.ir.graph import Graph
from shardc.version import __version__

MAX_ENTRIES = 200  # oldest entries (by modification time) beyond this are deleted
_PKG = Path(__file__).resolve().parents[1]


def _code_files() -> list[Path]:
    files = sorted((_PKG / "frontends").rglob("*.py")) + sorted((_PKG / "passes").rglob("*.py"))
    return files + [_PKG / "ir" / "graph.py"]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def cache_key(path: str | Path, tiny: bool) -> str:
    """Hex sha256 naming the cache entry of model file ``path`` (see the module docstring).
    Library versions come from the installed distributions' metadata (no import: a cache hit
    does not pay the 3-5 s torch + transformers start-up)."""
    p = Path(path).resolve()
    h = hashlib.sha256()

    def part(label: str, data: bytes) -> None:
        h.update(f"{label}:{len(data)}:".encode())
        h.update(data)

    part("model", p.read_bytes())
    part("model-name", f"{p.name}/{p.parent.name}".encode())
    part("tiny", b"1" if tiny else b"0")
    part("versions", f"{__version__} {_version('torch')} {_version('transformers')}".encode())
    for f in _code_files():
        part(f"code {f.relative_to(_PKG).as_posix()}", f.read_bytes())
    return h.hexdigest()


def entry_path(key: str) -> Path:
    return cache_dir() / f"{key}.json.gz"


def _file_digest(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def load_entry(key: str) -> Graph | None:
    """The cached graph for ``key``, or None if absent, unreadable (corrupt entries are
    ignored; the next :func:`store_entry` replaces them), or if a source file it recorded
    as imported is missing or changed."""
    text = load_text(key)
    if text is None:
        return None
    try:
        return Graph.from_json(text)
    except Exception:  # stale schema: treat as a miss
        return None


def store_entry(key: str, graph: Graph, deps=()) -> Path | None:
    """Write ``graph`` atomically as the entry for ``key``, recording the current sha256 of
    each file in ``deps`` (the source files the model code imported); None if the folder is
    unwritable."""
    return store_text(key, graph.to_json(), deps)


def load_text(key: str) -> str | None:
    """The text stored under ``key`` (see :func:`load_entry`; any cached derived fact of a
    model file, e.g. the backend's verdict on it, uses the same entries)."""
    f = entry_path(key)
    try:
        with gzip.open(f, "rt", encoding="utf-8") as fh:
            header = json.loads(fh.readline())
            for path, digest in header["deps"]:
                if _file_digest(path) != digest:
                    return None
            return fh.read()
    except FileNotFoundError:
        return None
    except Exception:  # truncated gzip, bad JSON: treat as a miss
        return None


def store_text(key: str, text: str, deps=()) -> Path | None:
    """Write ``text`` atomically as the entry for ``key`` (see :func:`store_entry`)."""
    recorded = sorted((str(d), _file_digest(str(d))) for d in deps)
    header = json.dumps({"deps": [[p, h] for p, h in recorded if h is not None]})

    def write(raw) -> None:
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as fh:
            fh.write(header.encode("utf-8") + b"\n")
            fh.write(text.encode("utf-8"))

    if not write_entry(entry_path(key), write, ".json.gz"):
        return None
    _prune(cache_dir())
    return entry_path(key)


def derived_key(path: str | Path, what: str, code_dirs: tuple[str, ...]) -> str:
    """Key of a fact derived from model file ``path`` by shardc code under ``code_dirs``
    (package-relative folders, e.g. ``("backends",)``): the graph key of the full-size model
    plus ``what`` and those folders' code."""
    h = hashlib.sha256(f"{cache_key(path, False)} {what}".encode())
    for d in code_dirs:
        for f in sorted((_PKG / d).rglob("*.py")):
            h.update(f"{f.relative_to(_PKG).as_posix()}:".encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _prune(folder: Path) -> None:
    """Delete the oldest entries beyond :data:`MAX_ENTRIES` (every code edit makes new keys)."""
    entries = []
    for f in folder.glob("*.json.gz"):
        try:
            entries.append((f.stat().st_mtime, f.name, f))
        except OSError:
            continue
    for _, _, f in sorted(entries)[:-MAX_ENTRIES]:
        try:
            f.unlink()
        except OSError:
            pass
