"""Where shardc keeps its on-disk caches (traced graphs, measured kernel tables).

``$SHARDC_CACHE_DIR`` (default ``~/.cache/shardc/graphs``) holds the graph cache
(:mod:`shardc.frontends.graph_cache`); the kernel-table cache
(:mod:`shardc.cost.silicon_tables`) is its ``kernels`` subfolder. ``SHARDC_NO_CACHE=1``
disables every cache.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

CACHE_DIR_ENV = "SHARDC_CACHE_DIR"
NO_CACHE_ENV = "SHARDC_NO_CACHE"


def cache_enabled() -> bool:
    """False when ``SHARDC_NO_CACHE`` is set to anything but ``""`` / ``"0"``."""
    return os.environ.get(NO_CACHE_ENV, "") in ("", "0")


def cache_dir() -> Path:
    """``$SHARDC_CACHE_DIR`` or ``~/.cache/shardc/graphs``."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env) if env else Path.home() / ".cache" / "shardc" / "graphs"


def write_entry(path: Path, write: Callable, suffix: str) -> bool:
    """Write a cache entry atomically: ``write(binary file)`` fills a temporary file in
    ``path``'s folder, which then replaces ``path`` (a reader never sees half an entry).
    Returns False (and leaves nothing behind) on an OS error: a cache is optional."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=suffix, dir=path.parent)
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.replace(tmp, path)
        return True
    except OSError:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return False
