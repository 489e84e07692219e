"""Where shardc keeps its on-disk caches (traced graphs, measured kernel tables).

``$SHARDC_CACHE_DIR`` (default ``~/.cache/shardc/graphs``) holds the graph cache
(:mod:`shardc.frontends.graph_cache`); the kernel-table cache
(:mod:`shardc.cost.silicon_tables`) is its ``kernels`` subfolder. ``SHARDC_NO_CACHE=1``
disables every cache.
"""

from __future__ import annotations

import os
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
