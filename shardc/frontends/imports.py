"""Which source files a model file really imports, and model code's own exits.

:func:`recording_imports` watches a window (importing the model file, building the model,
tracing it) and returns the *non-library* Python files the model code imported in it: the
graph cache keys its entries on their contents (:mod:`shardc.frontends.graph_cache`), so
editing a helper module anywhere -- a sibling, a sub-package of the model's folder, a
package elsewhere on ``sys.path`` -- invalidates the cached graph, while editing an unrelated
file does not.

A file is *library* when it lies in the interpreter's standard library or site-packages
(``sysconfig`` paths, ``site`` folders) or inside shardc itself (shardc's frontend and
passes code is keyed separately). Everything else that the window imported counts, found
three ways so that a module imported earlier in the same process is not missed:

* every ``import`` statement executed in the window (a wrapper around ``__import__`` sees
  ``import x`` even when ``x`` is already in ``sys.modules``);
* every module that appeared in ``sys.modules`` during the window (``importlib`` calls);
* the closure: the modules that a recorded module's namespace refers to (a helper that
  itself imported another helper before the window).

:func:`user_code` turns a ``SystemExit`` or ``KeyboardInterrupt`` raised *by model code*
into bad input (exit 2) instead of a silent exit; a real Ctrl-C (SIGINT) still interrupts.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import signal
import site
import sys
import sysconfig
import threading
import types
from pathlib import Path

from shardc.errors import InputError

_SHARDC_DIR = Path(__file__).resolve().parents[1]


def _library_roots() -> tuple[Path, ...]:
    roots = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            roots.add(Path(p).resolve())
    for p in list(getattr(site, "getsitepackages", lambda: [])()) + [site.getusersitepackages()]:
        roots.add(Path(p).resolve())
    roots.add(_SHARDC_DIR)
    return tuple(roots)


def _is_under(path: Path, roots: tuple[Path, ...]) -> bool:
    return any(path == r or r in path.parents for r in roots)


def module_file(module: types.ModuleType) -> Path | None:
    """The module's ``.py`` source file, or None (built-in, frozen, extension, namespace)."""
    f = getattr(module, "__file__", None)
    if not f or not str(f).endswith(".py"):
        return None
    try:
        return Path(f).resolve()
    except OSError:
        return None


def _referenced_modules(module: types.ModuleType):
    """Modules a module's namespace refers to: imported modules and the modules of imported
    functions and classes."""
    for value in list(vars(module).values()):
        if isinstance(value, types.ModuleType):
            yield value
        else:
            owner = getattr(value, "__module__", None)
            if isinstance(owner, str) and owner in sys.modules:
                yield sys.modules[owner]


@contextlib.contextmanager
def recording_imports():
    """Yield a set that, after the ``with`` block, holds the non-library ``.py`` files (as
    resolved :class:`Path`) imported inside the block (see the module docstring)."""
    before = set(sys.modules)
    names: set[str] = set()
    real_import = builtins.__import__

    def recording_import(name, globals=None, locals=None, fromlist=(), level=0):
        module = real_import(name, globals, locals, fromlist, level)
        try:
            full = name
            if level:
                import importlib.util

                package = (globals or {}).get("__package__") or ""
                full = importlib.util.resolve_name("." * level + name, package)
            names.add(full)
            for item in fromlist or ():
                names.add(f"{full}.{item}")
        except Exception:  # recording must never break the model's own import
            pass
        return module

    files: set[Path] = set()
    builtins.__import__ = recording_import
    try:
        yield files
    finally:
        builtins.__import__ = real_import
        names.update(set(sys.modules) - before)
        files.update(_non_library_files(names))
        for f in files:
            _LOADED_DIGESTS.setdefault(str(f), _digest(f))


def _non_library_files(names: set[str]) -> set[Path]:
    roots = _library_roots()
    seen: set[int] = set()
    todo = [sys.modules[n] for n in sorted(names) if isinstance(sys.modules.get(n), types.ModuleType)]
    out: set[Path] = set()
    while todo:
        module = todo.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        path = module_file(module)
        if path is None or _is_under(path, roots):
            continue
        out.add(path)
        todo.extend(_referenced_modules(module))
    return out


# source file -> sha256 when a recorded window imported it: the modules shardc loaded for a
# model, so an edit to one of them is noticed at the next load (forget_folder_modules)
_LOADED_DIGESTS: dict[str, str | None] = {}


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def forget_folder_modules(folder: Path) -> None:
    """Drop from ``sys.modules`` the modules a model file of ``folder`` may import (a
    top-level name a file or package in ``folder`` provides) that were loaded from another
    place (``folder`` is now first on ``sys.path``) or whose source changed since a recorded
    window imported it, so the next import runs what a fresh process would. Unchanged
    modules of ``folder`` stay loaded: executing a module again would repeat its global
    registrations (a ``torch.library.custom_op``, say)."""
    for name, module in list(sys.modules.items()):
        top = name.partition(".")[0]
        if not ((folder / f"{top}.py").is_file() or (folder / top).is_dir()):
            continue
        path = module_file(module) if isinstance(module, types.ModuleType) else None
        if path is None:
            continue
        shadowed = folder.resolve() not in path.parents  # the folder now provides that name
        changed = (str(path) in _LOADED_DIGESTS
                   and _digest(path) != _LOADED_DIGESTS[str(path)])
        if shadowed or changed:
            del sys.modules[name]
            _LOADED_DIGESTS.pop(str(path), None)


@contextlib.contextmanager
def user_code(source: str, what: str):
    """Run model code: its ``SystemExit`` / ``KeyboardInterrupt`` become an
    :class:`InputError` naming ``source`` and ``what`` it was doing. A real SIGINT during
    the block still raises ``KeyboardInterrupt`` (exit 130 at the CLI)."""
    interrupted = []
    previous = None
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        def on_sigint(signum, frame):
            interrupted.append(True)
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    except SystemExit as e:
        raise InputError(f"{source}: {what}: the model code called sys.exit({e.code!r}); "
                         "a model file must return a model, not exit") from None
    except KeyboardInterrupt:
        if interrupted:
            raise
        raise InputError(f"{source}: {what}: the model code raised KeyboardInterrupt") from None
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous)
