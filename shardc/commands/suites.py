"""The benchmark suites as data: their cases (``shardc/search/suites.toml``) and each case's
traced graph (read from the graph cache after the first trace). Shared by ``shardc bench``
(:mod:`shardc.commands.bench`), its serving cases (:mod:`shardc.commands.bench_serve`) and the
scripts under benchmarks/."""

from __future__ import annotations

from pathlib import Path

from shardc.errors import InputError

SEEDED = ("rl", "sa", "rw", "ga")  # the searchers run once per seed (the sweeps run once)


def load_suite(name: str) -> list[dict]:
    import tomllib

    path = Path(__file__).resolve().parent.parent / "search" / "suites.toml"
    data = tomllib.loads(path.read_text())
    if name not in data or name == "defaults":
        known = ", ".join(k for k in data if k != "defaults")
        raise InputError(f"--suite {name!r}: unknown suite (known: {known})")
    return [{**data.get("defaults", {}), **case} for case in data[name]]


def _model_path(model: str) -> Path:
    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        p = base / model
        if p.exists():
            return p
    raise InputError(f"{model}: model file not found (run from the repository root)")


def cached_graph(model: str):
    """The passed IR Graph of a suite's model file (traced once, then read from the graph
    cache of :func:`shardc.frontends.load_graph`)."""
    from shardc.frontends import load_graph

    return load_graph(_model_path(model))
