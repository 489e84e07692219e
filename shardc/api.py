"""The library entry: ``shardc.compile`` (trace -> passes -> search -> annotate -> plan).

>>> plan = shardc.compile("examples/tiny_llama.py", mesh="8x1", search="megatron")
>>> plan.summary(); plan.save("plan.json"); src = plan.code()

``model`` may be a path (``.py`` model file, ``.onnx``, HF ``config.json``), an
``nn.Module`` (with ``example_inputs``), or an already-built :class:`shardc.ir.Graph`.
"""

from __future__ import annotations

import time
from pathlib import Path

from shardc.cost import load_hardware
from shardc.errors import InputError
from shardc.ir.graph import Graph
from shardc.ir.strategy import Mesh, Workload, parse_degree_fields
from shardc.search import POLICIES


def load_model_graph(model, example_inputs=None, name: str | None = None) -> Graph:
    """Frontend + canonicalise/fuse/layer passes for any accepted model form."""
    if isinstance(model, Graph):
        return model
    if isinstance(model, (str, Path)):
        from shardc.frontends import load_graph

        return load_graph(str(model))
    import torch

    if isinstance(model, torch.nn.Module):
        if example_inputs is None:
            raise InputError("compile(model=nn.Module) needs example_inputs")
        from shardc.frontends import graph_from_module

        return graph_from_module(model, tuple(example_inputs), name=name or type(model).__name__)
    raise InputError(f"cannot compile a {type(model).__name__}: give a path, nn.Module or Graph")


def check_backend_support(model) -> None:
    """InputError when the DTensor backend cannot run ``model`` (a path or an nn.Module)."""
    from shardc.backends import support

    if isinstance(model, (str, Path)) and not str(model).endswith(".onnx"):
        support.check_model_file(str(model))
    elif not isinstance(model, (str, Path, Graph)):
        support.check_module(model)


def check_kernels(kernels: str, engine: str) -> None:
    """InputError unless ``kernels`` / ``engine`` are known (SPEC section 10)."""
    from shardc.cost.silicon import KERNEL_CHOICES
    from shardc.cost.silicon_tables import ENGINES

    if kernels not in KERNEL_CHOICES:
        raise InputError(f"--kernels {kernels!r}: expected one of {', '.join(KERNEL_CHOICES)}")
    if engine not in ENGINES:
        raise InputError(f"--engine {engine!r}: expected one of {', '.join(ENGINES)}")


def compile(model, example_inputs=None, mesh: str | Mesh = "8x1", hardware: str = "h100",
            workload: Workload | None = None, search: str = "rl", budget: int = 4000,
            seed: int = 0, progress=None, name: str | None = None,
            degrees: str | dict | None = None, kernels: str = "silicon", engine: str = "vllm"):
    """Compile ``model`` for ``mesh``; returns a :class:`shardc.plan.Plan`.

    ``kernels``: ``"silicon"`` (NVIDIA's measured kernel latencies where they cover the
    hardware, roofline elsewhere) or ``"roofline"``; ``engine``: whose kernels (``vllm``,
    ``sglang``, ``trtllm``). plan.json ``predicted.kernel_source`` says what priced it.

    ``degrees`` fixes any subset of tp, ep, pp, dp, sp (``"tp=8,pp=2"`` or a dict); the
    search explores the rest. Raises InputError (bad input) or InfeasibleError (nothing
    fits; says what is short).
    """
    return compile_with_outcome(model, example_inputs, mesh, hardware, workload, search,
                                budget, seed, progress, name, degrees=degrees, kernels=kernels,
                                engine=engine)[0]


def _baseline_entry(space, result) -> dict:
    """plan.json ``baseline.<name>``: the baseline's degrees and tok/s/GPU (None, None when
    it found nothing feasible or did not run)."""
    found = result is not None and result.best_action is not None
    return {"degrees": space.decode(result.best_action).degrees.as_dict() if found else None,
            "tok_s_per_gpu": float(result.best_value) if found else None}


def compile_with_outcome(model, example_inputs=None, mesh: str | Mesh = "8x1",
                         hardware: str = "h100", workload: Workload | None = None,
                         search: str = "rl", budget: int = 4000, seed: int = 0, progress=None,
                         name: str | None = None, check_backend: bool = True,
                         degrees: str | dict | None = None, kernels: str = "silicon",
                         engine: str = "vllm"):
    """:func:`compile`, also returning the search pass's
    :class:`~shardc.driver.SearchOutcome` (annotated graph, cost model, curves),
    which ``shardc compile`` needs for trace.json, graph.dot and search.png.

    ``check_backend``: first refuse (InputError) a model the DTensor backend cannot run
    (:mod:`shardc.backends.support`), so no plan comes with a ``parallelize.py`` that fails;
    ``.onnx`` files (no DTensor code is emitted for them) and Graphs are not checked."""
    from shardc.driver import search_pass
    from shardc.plan import build_plan

    if search not in POLICIES:
        raise InputError(f"--search {search!r}: expected one of {', '.join(POLICIES)}")
    check_kernels(kernels, engine)
    if int(budget) < 1:
        raise InputError("--budget must be a positive number of evaluations")
    if int(seed) < 0:
        raise InputError(f"--seed {seed}: expected a non-negative integer")
    mesh = mesh if isinstance(mesh, Mesh) else Mesh.parse(mesh)
    workload = workload or Workload()
    hw = load_hardware(hardware)
    graph = load_model_graph(model, example_inputs, name)  # a model traced wrongly is refused first
    if check_backend:
        check_backend_support(model)
    t0 = time.perf_counter()
    fixed = parse_degree_fields(degrees) if isinstance(degrees, str) else dict(degrees or {})
    outcome = search_pass(graph, mesh, hw, workload, policy=search, budget=int(budget),
                          seed=int(seed), progress=progress, fixed=fixed, kernels=kernels,
                          engine=engine)
    wall_s = time.perf_counter() - t0
    breakdown = outcome.cost_model.simulate(outcome.strategy)
    baseline = {name: _baseline_entry(outcome.space, result)
                for name, result in (("megatron", outcome.megatron),
                                     ("best_practice", outcome.best_practice))}
    search_info = {
        "policy": search, "budget": int(budget), "evaluations": int(outcome.searched.evaluations),
        "seed": int(seed), "wall_s": round(wall_s, 3), "chosen_from": outcome.chosen_from,
        "best_curve": [[int(e), float(v)] for e, v in outcome.searched.curve],
    }
    if fixed:
        search_info["fixed_degrees"] = {k: int(v) for k, v in fixed.items()}
    plan = build_plan(graph=outcome.graph, strategy=outcome.strategy, mesh=mesh,
                      hardware=hw.name, workload=workload, predicted=breakdown.predicted,
                      baseline=baseline, search=search_info)
    return plan, outcome
