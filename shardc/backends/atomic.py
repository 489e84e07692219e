"""Atomic output writing: a set of files that appears whole or not at all, and single files.

:func:`write_outputs` (``shardc compile``'s ``--out``, ``shardc bench``'s tables) first
resolves the output folder once (symlinks and ``..`` followed, so ``o/a/../b`` never creates
``o/a``) and refuses (:class:`InputError`) an existing folder where an entry on the way of an
output is a symlink or not a regular file (a ``launch`` link to another folder would write
through it). It removes ``.shardc-tmp-*`` staging left by a run that was killed (its process is
gone), produces every file into a new *staging* folder, then

* if the output folder does not exist yet (the staging folder was made beside it): renames the
  staging folder to it -- one atomic step;
* if it exists (a previous run, or a folder of the user's with other files in it; the staging
  folder was made inside it, on the same file system as the files it replaces): replaces
  our files one by one with ``os.replace``, after hard-linking each previous file into the
  staging folder, and removes the previous run's outputs that this set does not have (names
  matching ``owned``, e.g. a disaggregated compile's ``parallelize_prefill.py`` under a decode
  compile); if anything fails before the last file is in place, every replaced or removed
  file is put back, so the previous set stays whole. Files in the folder that are not ours are
  never moved, replaced or deleted.

A producer that raises, an unwritable folder, SIGINT and SIGTERM (turned into
:class:`~shardc.errors.Terminated`, exit 143 / 130, recorded so that a library catching the
exception cannot hide it: :func:`shardc.errors.signals_end_the_run`) all end with the previous
outputs intact and no staging folder left behind. A ``kill -9`` in the middle of the final
renames can still leave a mix; nothing short of a directory swap prevents that.

:func:`write_file_atomic` (``simulate --json``, ``inspect --out``, ``Plan.save``) writes one
file through a temporary file and ``os.replace``, to a new path or over a regular file only:
a symlink, device, FIFO or folder at the path is refused (never replaced, never written
through), and so is a path whose folder does not exist (no folder is created for it).
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path, PurePosixPath

from shardc.errors import (
    InputError,
    check_not_terminated,
    signals_deferred,
    signals_end_the_run,
)
from shardc.validate import dumps_strict_json

STAGING_PREFIX = ".shardc-tmp-"
_PREVIOUS = ".previous"  # inside the staging folder: hard links to the files being replaced
_UNOWNED_STAGING_AGE_S = 3600  # staging without a process id (older shardc) counts as left
#                                 over once it is this old (seconds)


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


def resolve_out(out_dir: str | Path) -> Path:
    """The output folder as an absolute path with symlinks and ``..`` resolved (once: every
    later step uses this path, so a folder swapped for a link meanwhile is not followed)."""
    try:
        return Path(os.path.realpath(os.fspath(out_dir)))
    except (OSError, ValueError) as e:
        raise InputError(f"{out_dir}: cannot write outputs there ({e})") from None


# ------------------------------------------------------------------ leftovers of killed runs
def _staging_prefix(tail: str = "") -> str:
    return f"{STAGING_PREFIX}{os.getpid()}-{tail}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0
    return True


def _left_over(entry: Path, tail: str) -> bool:
    """``entry`` is staging of a run that is gone: ``.shardc-tmp-<pid>-<tail>...`` whose
    process no longer exists, or (older shardc: no pid) one older than an hour."""
    rest = entry.name[len(STAGING_PREFIX):]
    pid, sep, after = rest.partition("-")
    if sep and pid.isdigit() and pid.isascii():
        return after.startswith(tail) and int(pid) != os.getpid() and not _alive(int(pid))
    if tail:
        return False
    try:
        return time.time() - os.lstat(entry).st_mtime > _UNOWNED_STAGING_AGE_S
    except OSError:
        return False


def clean_leftovers(folder: Path, tail: str = "") -> None:
    """Remove ``.shardc-tmp-*`` entries of ``folder`` left by killed runs (``tail``: only those
    staged for this output name, in a folder shared with other files)."""
    try:
        entries = [e for e in folder.iterdir() if e.name.startswith(STAGING_PREFIX)]
    except OSError:
        return
    for entry in entries:
        if not _left_over(entry, tail):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink()
        except OSError:
            pass


# ------------------------------------------------------------------ the output folder
def _refuse_entry(shown: Path, rel: str, why: str):
    raise InputError(f"{shown}: cannot write outputs there ({shown / rel} {why}; shardc writes "
                     "only regular files in real folders under --out)")


def check_entries(out: Path, names: list[str], shown: Path | None = None) -> None:
    """InputError if, under an existing ``out`` (resolved; ``shown``: as the user gave it), a
    path an output goes through is a symlink, or a folder on the way is not a folder, or the
    output is there but not a regular file."""
    shown = out if shown is None else shown
    if not os.path.lexists(out):
        return
    if not out.is_dir():
        raise InputError(f"{shown}: cannot write outputs there (not a folder)")
    for name in names:
        parts = PurePosixPath(name).parts
        path = out
        for i, part in enumerate(parts):
            path = path / part
            rel = "/".join(parts[:i + 1])
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                break
            except OSError as e:
                raise InputError(f"{shown}: cannot write outputs there ({e.strerror})") from None
            if stat.S_ISLNK(mode):
                _refuse_entry(shown, rel, "is a symbolic link")
            last = i == len(parts) - 1
            if last and stat.S_ISDIR(mode):
                _refuse_entry(shown, rel, "is a folder, in the way of an output")
            if last and not stat.S_ISREG(mode):
                _refuse_entry(shown, rel, "is not a regular file")
            if not last and not stat.S_ISDIR(mode):
                _refuse_entry(shown, rel, "is not a folder")


def stale_outputs(out: Path, names: list[str], owned: tuple[str, ...]) -> list[str]:
    """Files under ``out`` matching an ``owned`` pattern (a previous run's outputs) that the
    new set ``names`` does not have, relative paths, sorted."""
    if not owned or not out.is_dir():
        return []
    found = []
    for pattern in owned:
        folder, _, leaf = pattern.rpartition("/")
        base = out / folder if folder else out
        if folder and (base.is_symlink() or not base.is_dir()):
            continue
        try:
            entries = sorted(e.name for e in base.iterdir())
        except OSError:
            continue
        found += [f"{folder}/{e}" if folder else e for e in entries if fnmatch.fnmatchcase(e, leaf)]
    keep = set(names)
    return sorted({f for f in found if f not in keep and _is_regular(out / f)})


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _make_staging(out: Path) -> tuple[Path, list[Path]]:
    """(staging folder, parent folders created for it, deepest first). For a new ``out``
    beside it (so that one rename publishes the set); for an existing one inside it (the
    same file system as the files it replaces)."""
    parent = out.parent
    created = [p for p in [parent, *parent.parents] if not os.path.lexists(p)]
    try:
        if (os.path.lexists(out) and not out.is_dir()) or (parent.exists() and not parent.is_dir()):
            raise NotADirectoryError(20, os.strerror(20))
        if out.is_dir():
            return Path(tempfile.mkdtemp(prefix=_staging_prefix(), dir=out)), []
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=_staging_prefix(f"{out.name}-"), dir=parent)), created
    except OSError as e:
        _remove_empty(created)
        raise InputError(f"{out}: cannot write outputs there ({e.strerror or e})") from None


def _remove_empty(folders: list[Path]) -> None:
    for d in folders:  # deepest first; stops at the first that is not empty
        try:
            d.rmdir()
        except OSError:
            break


def _backup(staging: Path, final: Path, name: str) -> Path:
    backup = staging / _PREVIOUS / name
    backup.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(final, backup, follow_symlinks=False)  # the previous file stays put
    except OSError:
        shutil.copy2(final, backup, follow_symlinks=False)
    return backup


def _replace_into(staging: Path, out: Path, names: list[str], stale: list[str]) -> None:
    """Move ``staging/<name>`` over ``out/<name>`` for every name and remove ``out/<s>`` for
    every stale name; on any exception put the previous files back (and remove new ones that
    had no previous version), then re-raise."""
    journal: list[tuple[Path | None, Path, Path | None]] = []  # (staged, final, backup)
    try:
        for name in names:
            staged, final = staging / name, out / name
            backup = None
            if os.path.lexists(final):
                if final.is_dir() and not final.is_symlink():
                    raise IsADirectoryError(21, f"{final} is a folder, in the way of an output")
                backup = _backup(staging, final, name)
            journal.append((staged, final, backup))  # before the move: a signal after it
            final.parent.mkdir(parents=True, exist_ok=True)  # still finds it journaled
            os.replace(staged, final)
        for name in stale:
            final = out / name
            journal.append((None, final, _backup(staging, final, name)))
            os.unlink(final)
        check_not_terminated(f"writing outputs to {out}")
    except BaseException:
        for staged, final, backup in reversed(journal):
            if staged is not None and os.path.lexists(staged):
                continue  # never moved
            try:
                if backup is not None:
                    os.replace(backup, final)
                elif os.path.lexists(final):
                    os.unlink(final)
            except OSError:
                pass
        raise


def write_outputs(out_dir: str | Path, files: dict[str, object],
                  owned: tuple[str, ...] = ()) -> list[Path]:
    """Write ``{filename: str | bytes | dict | list | callable(path)}`` into ``out_dir`` as one
    atomic set (module docstring); ``owned``: glob patterns (``launch/vllm_*.sh``) of the
    outputs a previous run of the same command may have left, removed when this set lacks
    them. Returns the final paths (under ``out_dir`` as given). A folder that cannot be
    created or written is bad input (:class:`InputError`, exit 2); a signal is
    :class:`~shardc.errors.Terminated`."""
    given = Path(out_dir)
    out = resolve_out(given)
    names = list(files)
    with signals_end_the_run(f"writing outputs to {given}"):
        check_entries(out, names, given)
        stale = stale_outputs(out, names, owned)  # regular files only: others are not ours
        previous = any(os.path.lexists(out / n) for n in names + stale)
        clean_leftovers(out)
        clean_leftovers(out.parent, f"{out.name}-")
        staging, created = _make_staging(out)
        done = False
        try:
            for name, content in files.items():  # a signal here raises: staging only
                _produce(staging / name, content)
            with signals_deferred():  # publishing (or rolling back) is never cut short
                check_not_terminated(f"writing outputs to {given}")
                if not os.path.lexists(out):
                    os.chmod(staging, 0o777 & ~_umask())  # mkdtemp made it private
                    try:
                        os.rename(staging, out)  # the whole set in one step
                        done = True
                    except OSError:  # created meanwhile: replace file by file
                        pass
                if not done:
                    _replace_into(staging, out, names, stale)
                    done = True
        except OSError as e:
            kept = "; the previous outputs were left as they were" if previous else ""
            raise InputError(f"{given}: cannot write outputs there ({e.strerror or e}){kept}") \
                from None
        finally:
            if os.path.lexists(staging):
                shutil.rmtree(staging, ignore_errors=True)
            if not done:
                _remove_empty(created)
    return [given / n for n in names]


def check_single_file_target(path: Path, what: str) -> None:
    """InputError unless ``path`` is new or a regular file (not a symlink, device, FIFO,
    socket or folder: those are never replaced nor written through)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise InputError(f"{what}: cannot write ({e.strerror or e})") from None
    if stat.S_ISLNK(mode):
        raise InputError(f"{what}: is a symbolic link; give a regular file or a new path")
    if stat.S_ISDIR(mode):
        raise InputError(f"{what}: is a folder; give a file name")
    if not stat.S_ISREG(mode):
        raise InputError(f"{what}: is not a regular file (a device, FIFO or socket); give a "
                         "regular file or a new path")


def write_file_atomic(path: str | Path, content, what: str) -> Path:
    """Write one file (content as in :func:`write_outputs`) through a temporary file in the
    same folder and ``os.replace``, to a new path or over a regular file only
    (:func:`check_single_file_target`); a folder that does not exist (none is created) or
    cannot be written is :class:`InputError` naming ``what`` (e.g. ``--json out.json``)."""
    path = Path(path)
    try:
        folder = Path(os.path.realpath(path.absolute().parent))
    except (OSError, ValueError) as e:
        raise InputError(f"{what}: cannot write ({e})") from None
    if not os.path.isdir(folder):  # never created here: a typo would scatter folders
        shown = path.parent if str(path.parent) not in ("", ".") else folder
        why = "is not a folder" if os.path.lexists(folder) else "does not exist"
        raise InputError(f"{what}: the folder {shown} {why} (single-file outputs create no "
                         "folders; create it first)")
    target = folder / path.name
    with signals_end_the_run(f"writing {path}"):
        check_single_file_target(target, what)
        clean_leftovers(folder, f"{path.name}-")
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=_staging_prefix(f"{path.name}-"),
                                       suffix=path.suffix, dir=folder)
            os.close(fd)
            os.chmod(tmp, 0o666 & ~_umask())
            _produce(Path(tmp), content)
            with signals_deferred():
                check_not_terminated(f"writing {path}")
                os.replace(tmp, target)
                tmp = None
        except OSError as e:
            raise InputError(f"{what}: cannot write ({e.strerror or e})") from None
        finally:
            if tmp is not None and os.path.lexists(tmp):
                os.unlink(tmp)
    return path
