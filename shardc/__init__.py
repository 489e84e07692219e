"""shardc: a sharding compiler for distributed LLM inference.

    plan = shardc.compile(model, example_inputs, mesh="8x128", hardware="h100",
                          workload=shardc.Workload(phase="decode", context=16384),
                          search="rl", budget=4000, seed=0)
    plan.summary(); plan.save("plan.json"); plan.code(); plan.apply(model, device_mesh)
    plan = shardc.load_plan("plan.json")
"""

from shardc.ir.strategy import Workload  # noqa: E402
from shardc.version import __version__  # noqa: E402,F401 - re-exported


def compile(model, example_inputs=None, **kwargs):  # noqa: A001 - the documented API name
    """Trace, search and annotate ``model``; returns a :class:`shardc.plan.Plan`.
    See :func:`shardc.api.compile` for the arguments."""
    from shardc.api import compile as _compile

    return _compile(model, example_inputs, **kwargs)


def load_plan(path):
    """Read and validate a plan.json (schema_version 2, or 1); see :func:`shardc.plan.load_plan`."""
    from shardc.plan import load_plan as _load

    return _load(path)


__all__ = ["Workload", "compile", "load_plan", "__version__"]
