"""Atomic output writing: a set of files that appears whole or not at all, and single files.

:func:`write_outputs` (``shardc compile``'s ``--out``, ``shardc bench``'s tables) produces every
file into a *staging* folder (``.shardc-tmp-*``), then

* if the output folder does not exist yet (the staging folder was made beside it): renames the
  staging folder to it -- one atomic step;
* if it exists (a previous run, or a folder of the user's with other files in it; the staging
  folder was made inside it, on the same file system as the files it replaces): replaces
  our files one by one with ``os.replace``, after hard-linking each previous file into the
  staging folder; if anything fails before the last file is in place, every replaced file is
  put back, so the previous set stays whole. Files in the folder that are not ours are never
  moved, replaced or deleted.

A producer that raises, an unwritable folder, ``KeyboardInterrupt`` and SIGTERM (turned into
:class:`~shardc.errors.Terminated`, exit 143, for the duration of the write) all end with the
previous outputs intact and no staging folder left behind. A ``kill -9`` in the middle of the
final renames can still leave a mix; nothing short of a directory swap prevents that.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

from shardc.errors import InputError, Terminated
from shardc.validate import dumps_strict_json

STAGING_PREFIX = ".shardc-tmp-"
_PREVIOUS = ".previous"  # inside the staging folder: hard links to the files being replaced


@contextmanager
def sigterm_raises(what: str):
    """While the block runs (main thread only), SIGTERM raises :class:`Terminated` instead of
    killing the process, so ``finally`` clean-ups run; a second SIGTERM is ignored until the
    block ends. The previous handler is restored afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the clean-up must not be cut short
        raise Terminated(f"terminated by SIGTERM while writing {what}; the previous "
                         "outputs were left as they were")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _produce(path: Path, content) -> None:
    """Write one output: str / bytes as is, dict / list as strict JSON, a callable is called
    with ``path`` to write the file itself (e.g. matplotlib's savefig)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if callable(content):
        content(path)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, (dict, list)):
        path.write_text(dumps_strict_json(content, indent=2) + "\n")
    else:
        path.write_text(str(content))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _make_staging(out: Path) -> tuple[Path, list[Path]]:
    """(staging folder, parent folders created for it, deepest first). For a new ``out``
    beside it (so that one rename publishes the set); for an existing one inside it (the
    same file system as the files it replaces, even when ``out`` is a symlink)."""
    parent = out.absolute().parent
    created = [p for p in [parent, *parent.parents] if not p.exists()]
    try:
        if (out.exists() and not out.is_dir()) or (parent.exists() and not parent.is_dir()):
            raise NotADirectoryError(20, os.strerror(20))
        if out.is_dir():
            return Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out)), []
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{out.name}-", dir=parent)), created
    except OSError as e:
        _remove_empty(created)
        raise InputError(f"{out}: cannot write outputs there ({e.strerror or e})") from None


def _remove_empty(folders: list[Path]) -> None:
    for d in folders:  # deepest first; stops at the first that is not empty
        try:
            d.rmdir()
        except OSError:
            break


def _replace_into(staging: Path, out: Path, names: list[str]) -> None:
    """Move ``staging/<name>`` over ``out/<name>`` for every name; on any exception put the
    previous files back (and remove new ones that had no previous version), then re-raise."""
    journal: list[tuple[Path, Path, Path | None]] = []  # (staged, final, backup of previous)
    try:
        for name in names:
            staged, final = staging / name, out / name
            backup = None
            if os.path.lexists(final):
                if final.is_dir() and not final.is_symlink():
                    raise IsADirectoryError(21, f"{final} is a folder, in the way of an output")
                backup = staging / _PREVIOUS / name
                backup.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(final, backup, follow_symlinks=False)  # the previous file stays put
                except OSError:
                    shutil.copy2(final, backup, follow_symlinks=False)
            journal.append((staged, final, backup))  # before the move: a signal after it
            final.parent.mkdir(parents=True, exist_ok=True)  # still finds it journaled
            os.replace(staged, final)
    except BaseException:
        for staged, final, backup in reversed(journal):
            if os.path.lexists(staged):
                continue  # never moved
            try:
                if backup is not None:
                    os.replace(backup, final)
                else:
                    os.unlink(final)
            except OSError:
                pass
        raise


def write_outputs(out_dir: str | Path, files: dict[str, object]) -> list[Path]:
    """Write ``{filename: str | bytes | dict | list | callable(path)}`` into ``out_dir`` as one
    atomic set (module docstring). Returns the final paths. A folder that cannot be created or
    written is bad input (:class:`InputError`, exit 2); SIGTERM is :class:`Terminated`."""
    out = Path(out_dir)
    names = list(files)
    with sigterm_raises(f"outputs to {out}"):
        staging, created = _make_staging(out)
        done = False
        try:
            for name, content in files.items():
                _produce(staging / name, content)
            if not os.path.lexists(out):
                os.chmod(staging, 0o777 & ~_umask())  # mkdtemp made it private
                try:
                    os.rename(staging, out)  # the whole set in one step
                    done = True
                except OSError:  # created meanwhile: replace file by file
                    pass
            if not done:
                _replace_into(staging, out, names)
                done = True
        except OSError as e:
            raise InputError(f"{out}: cannot write outputs there ({e.strerror or e}); the "
                             "previous outputs were left as they were") from None
        finally:
            if os.path.lexists(staging):
                shutil.rmtree(staging, ignore_errors=True)
            if not done:
                _remove_empty(created)
    return [out / n for n in names]


def write_file_atomic(path: str | Path, content, what: str) -> Path:
    """Write one file (content as in :func:`write_outputs`) through a temporary file in the
    same folder and ``os.replace``; a folder that cannot be written is
    :class:`InputError` naming ``what`` (e.g. ``--json out.json``)."""
    path = Path(path)
    with sigterm_raises(str(path)):
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=STAGING_PREFIX, suffix=path.suffix,
                                       dir=path.absolute().parent)
            os.close(fd)
            os.chmod(tmp, 0o666 & ~_umask())
            _produce(Path(tmp), content)
            os.replace(tmp, path)
            tmp = None
        except OSError as e:
            raise InputError(f"{what}: cannot write ({e.strerror or e})") from None
        finally:
            if tmp is not None and os.path.lexists(tmp):
                os.unlink(tmp)
    return path
