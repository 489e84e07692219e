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
        from shardc.text import clean_text

        return graph_from_module(model, tuple(example_inputs),
                                 name=clean_text(name or type(model).__name__))
    raise InputError(f"cannot compile a {type(model).__name__}: give a path, nn.Module or Graph")


def backend_verdict(model) -> dict:
    """plan.json ``backend`` for ``model`` (a path or an nn.Module): ``{"runs": bool,
    "reason": str | None}`` (:mod:`shardc.backends.support`); ``{}`` for an ``.onnx`` file
    or a Graph (no DTensor code is emitted for them)."""
    from shardc.backends import support

    if isinstance(model, (str, Path)) and not str(model).endswith(".onnx"):
        return support.backend_verdict(str(model))
    if not isinstance(model, (str, Path, Graph)):
        return support.verdict_of_module(model)
    return {}


def check_kernels(kernels: str, engine: str) -> None:
    """InputError unless ``kernels`` / ``engine`` are known (SPEC section 10)."""
    from shardc.cost.silicon import KERNEL_CHOICES, is_table_file
    from shardc.cost.silicon_tables import ENGINES

    if is_table_file(kernels):
        from pathlib import Path

        if not Path(kernels).is_file():
            raise InputError(f"--kernels {kernels!r}: no such file (write one with "
                             "`shardc calibrate --out FILE.npz`)")
    elif kernels not in KERNEL_CHOICES:
        raise InputError(f"--kernels {kernels!r}: expected one of {', '.join(KERNEL_CHOICES)} "
                         "or a calibrated table (.npz)")
    if engine not in ENGINES:
        raise InputError(f"--engine {engine!r}: expected one of {', '.join(ENGINES)}")


def _kind(value) -> str:
    return type(value).__name__


def check_compile_args(*, example_inputs, mesh, hardware, workload, search, budget, seed,
                       progress, name, degrees, kernels, engine, allow_cross_node_tp):
    """The library's arguments checked as the command line checks its flags (same bounds:
    :mod:`shardc.validate`), each refusal an :class:`InputError` naming the argument.
    Returns (budget, seed, fixed degrees)."""
    from shardc.cost.hardware_presets import Hardware
    from shardc.validate import MAX_BUDGET, MAX_SEED, check_number

    if not isinstance(search, str) or search not in POLICIES:
        raise InputError(f"search = {search!r:.40}: expected one of {', '.join(POLICIES)}")
    if not isinstance(kernels, str) or not isinstance(engine, str):
        raise InputError(f"kernels / engine: expected names (str), got {_kind(kernels)} / "
                         f"{_kind(engine)}")
    check_kernels(kernels, engine)
    budget = check_number(budget, "budget", integer=True, minimum=1, maximum=MAX_BUDGET,
                          unit="evaluations")
    seed = check_number(seed, "seed", integer=True, minimum=0, maximum=MAX_SEED)
    if not isinstance(mesh, (str, Mesh)):
        raise InputError(f"mesh: expected 'GxN' (str) or a Mesh, got {_kind(mesh)}")
    if not isinstance(hardware, (str, Hardware)):
        raise InputError(f"hardware: expected a preset name or TOML path (str), got "
                         f"{_kind(hardware)}")
    if workload is not None and not isinstance(workload, Workload):
        raise InputError(f"workload: expected a shardc.Workload, got {_kind(workload)}")
    if progress is not None and not callable(progress):
        raise InputError(f"progress: expected a callable (evaluations, best), got "
                         f"{_kind(progress)}")
    if name is not None and not isinstance(name, str):
        raise InputError(f"name: expected a str, got {_kind(name)}")
    if example_inputs is not None and not isinstance(example_inputs, (tuple, list)):
        raise InputError(f"example_inputs: expected a tuple of tensors, got "
                         f"{_kind(example_inputs)}")
    if not isinstance(allow_cross_node_tp, bool):
        raise InputError(f"allow_cross_node_tp: expected True or False, got "
                         f"{_kind(allow_cross_node_tp)}")
    if degrees is None or isinstance(degrees, str):
        fixed = parse_degree_fields(degrees or "")
    elif isinstance(degrees, dict):
        if not all(isinstance(k, str) and (v in ("on", "off") if isinstance(v, str) else
                                           isinstance(v, int) and not isinstance(v, bool))
                   for k, v in degrees.items()):
            raise InputError("degrees: expected {name: int} (tp, pp, ep, dp; sp: int, 'on' or "
                             "'off')")
        from shardc.ir.strategy import SP_ON  # what parse_degree_fields makes of sp=on

        fixed = parse_degree_fields(",".join(
            f"{k}={'on' if k == 'sp' and v == SP_ON else v}" for k, v in degrees.items()))
    else:
        raise InputError(f"degrees: expected 'tp=8,pp=2' or a dict, got {_kind(degrees)}")
    return budget, seed, fixed


def compile(model, example_inputs=None, mesh: str | Mesh = "8x1", hardware: str = "h100",
            workload: Workload | None = None, search: str = "rl", budget: int = 4000,
            seed: int = 0, progress=None, name: str | None = None,
            degrees: str | dict | None = None, kernels: str = "silicon",
            engine: str | None = None, allow_cross_node_tp: bool = False,
            runtime: str = "dtensor", hf_id: str | None = None, launch: bool = True):
    """Compile ``model`` for ``mesh``; returns a :class:`shardc.plan.Plan`.

    ``runtime``: ``"dtensor"`` (default: the whole strategy space; ``parallelize.py`` is the
    deployable) or an engine (``"vllm"``, ``"sglang"``, ``"trtllm"``): the search runs in
    the space that engine expresses (:mod:`shardc.ir.engines`), priced with its kernels, and
    the plan is the engine's configuration. ``engine`` (whose kernel tables) defaults to
    the runtime's engine, else vLLM's; naming another engine than the runtime is an error.
    ``hf_id``: the model id the launch scripts serve (a hub id or a path; default: the
    config's ``_name_or_path``). plan.json ``launch`` holds each engine's best configuration
    (:mod:`shardc.launch_plan`; ``launch=False`` skips those searches).

    ``kernels``: ``"silicon"`` (NVIDIA's measured kernel latencies where they cover the
    hardware, roofline elsewhere) or ``"roofline"``; ``engine``: whose kernels (``vllm``,
    ``sglang``, ``trtllm``). plan.json ``predicted.kernel_source`` says what priced it.

    ``degrees`` fixes any subset of tp, ep, pp, dp, sp (``"tp=8,pp=2"`` or a dict); the
    search explores the rest. Raises InputError (bad input) or InfeasibleError (nothing
    fits; says what is short). tp stays inside one node's NVLink domain unless
    ``allow_cross_node_tp``.
    """
    return compile_with_outcome(model, example_inputs, mesh, hardware, workload, search,
                                budget, seed, progress, name, degrees=degrees, kernels=kernels,
                                engine=engine, allow_cross_node_tp=allow_cross_node_tp,
                                runtime=runtime, hf_id=hf_id, launch=launch)[0]


def _baseline_entry(space, result) -> dict:
    """plan.json ``baseline.<name>``: the baseline's degrees and tok/s/GPU (None, None when
    it found nothing feasible or did not run)."""
    found = result is not None and result.best_action is not None
    space = (result.space or space) if found else space
    return {"degrees": space.decode(result.best_action).degrees.as_dict() if found else None,
            "tok_s_per_gpu": float(result.best_value) if found else None}


def compile_with_outcome(model, example_inputs=None, mesh: str | Mesh = "8x1",
                         hardware: str = "h100", workload: Workload | None = None,
                         search: str = "rl", budget: int = 4000, seed: int = 0, progress=None,
                         name: str | None = None, check_backend: bool = True,
                         degrees: str | dict | None = None, kernels: str = "silicon",
                         engine: str | None = None, allow_cross_node_tp: bool = False,
                         runtime: str = "dtensor", hf_id: str | None = None,
                         launch: bool = True, weights_from_checkpoint: bool | None = None):
    """:func:`compile`, also returning the search pass's
    :class:`~shardc.driver.SearchOutcome` (annotated graph, cost model, curves),
    which ``shardc compile`` needs for trace.json, graph.dot and search.png.

    ``check_backend``: ask whether the DTensor backend can run the model
    (:mod:`shardc.backends.support`) and record the answer as plan.json ``backend {runs,
    reason}``; a plan whose backend does not run is still a plan (engine launch scripts need
    no DTensor backend) but has no ``parallelize.py`` (:meth:`Plan.code` refuses it).
    ``.onnx`` files (no DTensor code is emitted for them) and Graphs are not checked.
    ``launch``: also search each engine's best configuration for plan.json ``launch``.

    ``weights_from_checkpoint``: price the weights in the format the checkpoint's
    ``quantization_config`` stores (FP8), not ``workload.weights`` (default: when no
    ``workload`` is given; :mod:`shardc.ir.checkpoint`); plan.json ``model.checkpoint``."""
    from shardc.driver import search_pass
    from shardc.ir.checkpoint import checkpoint_weights
    from shardc.plan import build_plan

    if not isinstance(search, str) or search not in POLICIES:
        raise InputError(f"search = {search!r:.40}: expected one of {', '.join(POLICIES)}")
    if engine is not None and not isinstance(engine, str):
        raise InputError(f"engine: expected a name (str), got {_kind(engine)}")
    engine = resolve_engine(runtime, engine)
    budget, seed, fixed = check_compile_args(
        example_inputs=example_inputs, mesh=mesh, hardware=hardware, workload=workload,
        search=search, budget=budget, seed=seed, progress=progress, name=name,
        degrees=degrees, kernels=kernels, engine=engine,
        allow_cross_node_tp=allow_cross_node_tp)
    model_id = launch_model_id(model, hf_id) if launch else None  # bad ids before tracing
    mesh = mesh if isinstance(mesh, Mesh) else Mesh.parse(mesh)
    if weights_from_checkpoint is None:
        weights_from_checkpoint = workload is None
    workload = workload or Workload()
    hw = load_hardware(hardware)
    graph = load_model_graph(model, example_inputs, name)  # a model traced wrongly is refused first
    workload, checkpoint = checkpoint_weights(graph.config, workload,
                                              bool(weights_from_checkpoint))
    verdict = backend_verdict(model) if check_backend else {}
    t0 = time.perf_counter()
    if workload.phase == "serve":
        plan, out = compile_serve(graph, mesh, hw, workload, search, int(budget), int(seed),
                                  progress, fixed, t0, kernels=kernels, engine=engine,
                                  allow_cross_node_tp=bool(allow_cross_node_tp),
                                  runtime=runtime)
        if launch:
            from shardc.launch_plan import attach_launch
            from shardc.serving.search import serve_search

            attach_launch(plan, out, graph=graph, mesh=mesh, hw=hw, workload=workload,
                          fixed=fixed, kernels=kernels, runtime=runtime, model_id=model_id,
                          allow_cross_node_tp=bool(allow_cross_node_tp),
                          serve_search=serve_search)
        if verdict:
            from shardc.backends.support import (
                fused_experts_verdict,
                plan_verdict,
                torch_style_verdict,
            )

            verdict = torch_style_verdict(verdict, list(out.pool_plans.values()), graph)
            verdict = plan_verdict(verdict, [p.strategy() for p in out.pool_plans.values()])
            verdict = fused_experts_verdict(verdict, list(out.pool_plans.values()))
        for pool_plan in out.pool_plans.values():
            pool_plan.backend = dict(verdict)
            if checkpoint:
                pool_plan.model["checkpoint"] = dict(checkpoint)
        return plan, out
    outcome = search_pass(graph, mesh, hw, workload, policy=search, budget=int(budget),
                          seed=int(seed), progress=progress, fixed=fixed, kernels=kernels,
                          engine=engine, allow_cross_node_tp=bool(allow_cross_node_tp),
                          runtime=runtime)
    wall_s = time.perf_counter() - t0
    breakdown = outcome.cost_model.simulate(outcome.strategy)
    baseline = {name: _baseline_entry(outcome.space, result)
                for name, result in (("megatron", outcome.megatron),
                                     ("best_practice", outcome.best_practice))}
    mega = outcome.megatron
    if mega.best_action is not None:  # does the ratio survive a +-1% SLO change?
        from shardc.cost.slo_cliff import slo_cliff_check

        baseline["megatron"]["slo_check"] = slo_cliff_check(
            outcome.cost_model, outcome.space, outcome.strategy,
            float(outcome.result.best_value), float(mega.best_value), mega.space)
    search_info = {
        "policy": search, "budget": int(budget), "evaluations": int(outcome.searched.evaluations),
        "seed": int(seed), "wall_s": round(wall_s, 3), "chosen_from": outcome.chosen_from,
        "best_curve": [[int(e), float(v)] for e, v in outcome.searched.curve],
        "allow_cross_node_tp": bool(allow_cross_node_tp), "runtime": runtime,
    }
    if fixed:
        search_info["fixed_degrees"] = {k: int(v) for k, v in fixed.items()}
    if outcome.exact_value is not None:
        search_info["exact_tok_s_per_gpu"] = float(outcome.exact_value)
    plan = build_plan(graph=outcome.graph, strategy=outcome.strategy, mesh=mesh,
                      hardware=hw.name, workload=workload, predicted=breakdown.predicted,
                      baseline=baseline, search=search_info)
    if launch:
        from shardc.launch_plan import attach_launch

        attach_launch(plan, outcome, graph=graph, mesh=mesh, hw=hw, workload=workload,
                      fixed=fixed, kernels=kernels, runtime=runtime, model_id=model_id,
                      allow_cross_node_tp=bool(allow_cross_node_tp))
    if verdict:
        from shardc.backends.support import (
            fused_experts_verdict,
            plan_verdict,
            torch_style_verdict,
        )

        verdict = torch_style_verdict(verdict, [plan], outcome.graph)
        verdict = plan_verdict(verdict, [outcome.strategy])
        verdict = fused_experts_verdict(verdict, [plan])
    plan.backend = dict(verdict)
    if checkpoint:
        plan.model["checkpoint"] = dict(checkpoint)
    return plan, outcome


def resolve_engine(runtime: str, engine: str | None) -> str:
    """The kernel tables' engine: ``engine`` when given, else the runtime's engine (vLLM's
    for ``dtensor``); InputError for an unknown runtime or an engine other than the runtime."""
    from shardc.cost.silicon import DEFAULT_ENGINE
    from shardc.ir.engines import ENGINES, RUNTIMES

    if not isinstance(runtime, str) or runtime not in RUNTIMES:
        raise InputError(f"--runtime {runtime!r}: expected one of {', '.join(RUNTIMES)}")
    if runtime in ENGINES:
        if engine is not None and engine != runtime:
            raise InputError(f"--engine {engine} with --runtime {runtime}: the runtime's plan "
                             f"is priced with its own kernels (drop --engine, or use "
                             f"--engine {runtime})")
        return runtime
    return DEFAULT_ENGINE if engine is None else engine


def launch_model_id(model, hf_id: str | None) -> str | None:
    """The model id the launch scripts serve: ``hf_id`` when given (InputError unless a
    valid hub id or path, :func:`shardc.backends.launch.check_model_id`), else a config
    file's ``_name_or_path`` when valid, else None (the scripts then refuse to run until
    ``SHARDC_MODEL`` is set)."""
    from shardc.backends.launch import check_model_id, config_model_id

    if hf_id is not None:
        return check_model_id(hf_id, "--hf-id")
    if isinstance(model, (str, Path)):
        return config_model_id(str(model))
    return None


def compile_serve(graph: Graph, mesh: Mesh, hw, workload: Workload, search: str, budget: int,
                  seed: int, progress, fixed: dict, t0: float, kernels: str = "silicon",
                  engine: str = "vllm", allow_cross_node_tp: bool = False,
                  runtime: str = "dtensor"):
    """``--phase serve``: the serving search (:func:`shardc.serving.search.serve_search`) and the
    plan of its choice -- top level = the mixed pool (agg) or the decode pool (disagg), with
    plan.json's ``serving`` section; ``outcome.pool_plans`` holds one Plan per pool (for
    ``parallelize_<role>.py``). Returns (plan, outcome)."""
    from shardc.passes.annotate import annotate
    from shardc.plan import build_plan, op_rows
    from shardc.serving.search import serve_search

    out = serve_search(graph, mesh, hw, workload, policy=search, budget=budget, seed=seed,
                       progress=progress, fixed=fixed, kernels=kernels, engine=engine,
                       allow_cross_node_tp=allow_cross_node_tp, runtime=runtime)
    wall_s = time.perf_counter() - t0
    choice = out.choice
    pools, plans = [], {}
    serving = {"mode": choice.mode, "pools": pools,
               "pareto": [{"mode": m, **p} for m, pts in out.pareto.items() for p in pts],
               "predicted": choice.predicted(),
               "modes": {m: (c.predicted() | {"plan": c.describe()}) if c else None
                         for m, c in out.by_mode.items()},
               "alternatives": out.alternatives, "binding": out.binding,
               "slo_moves": out.slo_moves}
    for role, workers, strategy, row in choice.pools:
        pool = out.pools[role]
        tokens = strategy.batch * (workload.isl if role == "prefill" else 1)
        g = annotate(graph, strategy, tokens=tokens)
        ops = op_rows(g, strategy, [d for d in strategy.degrees.spmd_dims()])
        pred = pool.cost_model.simulate(strategy).predicted
        if role == "prefill":
            pred["ttft_ms"] = float(row["ttft"])  # + the KV transfer to the decode pool
        pools.append({"role": role, "workers": int(workers),
                      "gpus_per_worker": strategy.degrees.replica_gpus,
                      "degrees": strategy.degrees.as_dict(), "batch": int(strategy.batch),
                      "ops": [{"name": o["name"], "kind": o["kind"], "choice": o["choice"]}
                              for o in ops],
                      "predicted": {k: pred[k] for k in ("tok_s_per_gpu", "tpot_ms", "ttft_ms",
                                                         "memory_gb_per_gpu")},
                      **_pool_scheduling(pred, pool.cost_model, strategy, role)})
        plans[role] = (g, strategy, pool, pred)
    top_role = choice.pools[-1][0]
    g, strategy, pool, pred = plans[top_role]
    predicted = dict(pred, **{k: choice.predicted()[k] for k in ("tok_s_per_gpu", "tpot_ms",
                                                                   "ttft_ms")})
    mega = out.megatron
    baseline = {"megatron": _serve_baseline(mega),
                "best_practice": _serve_baseline(out.best_practice)}
    pol = {role: p.results[search] for role, p in out.pools.items()}
    search_info = {
        "policy": search, "budget": budget, "seed": seed, "wall_s": round(wall_s, 3),
        "evaluations": int(sum(r.evaluations for r in pol.values())),
        "chosen_from": out.chosen_from,
        "best_curve": [[int(e), float(v)] for e, v in pol[top_role].curve],
        "pools_searched": sorted(out.pools),
        "allow_cross_node_tp": bool(allow_cross_node_tp), "runtime": runtime,
    }
    if out.exact is not None and out.exact_complete:
        search_info["exact_tok_s_per_gpu"] = float(out.exact.tok_s_per_gpu)
        # the searcher's (and baselines') own best over the ceiling; the plan returned is the
        # best row of the whole run, exact sweep included
        agent = out.agent.tok_s_per_gpu if out.agent is not None else 0.0
        search_info["optimum_fraction"] = float(agent / out.exact.tok_s_per_gpu)
    if fixed:
        search_info["fixed_degrees"] = {k: int(v) for k, v in fixed.items()}
    common = dict(mesh=mesh, hardware=hw.name, baseline=baseline, search=search_info,
                  annotated=True, serving=serving, serve_workload=workload)
    pool_plans = {}
    for role, (g_r, s_r, pool_r, pred_r) in plans.items():
        pool_plans[role] = build_plan(graph=g_r, strategy=s_r, workload=pool_r.cost_model.workload,
                                      predicted=pred_r if role != top_role else predicted, **common)
    out.pool_plans = pool_plans
    return pool_plans[top_role], out


def _pool_scheduling(pred: dict, cm, strategy, role: str) -> dict:
    """plan.json pool keys the launch scripts write: ``scheduler`` (the aggregated pool's
    token budget, :func:`shardc.cost.explain.scheduler_entry`) where the pool has one, and
    ``kv_reservation`` (mixed / decode: the rule and the KV tokens per running sequence)."""
    out = {}
    sched = (pred.get("breakdown") or {}).get("scheduler")
    if sched:
        out["scheduler"] = sched
    if role != "prefill":
        seqs = strategy.batch / strategy.degrees.ep
        out["kv_reservation"] = {
            "rule": cm.kv_reservation,
            "tokens_per_sequence": round(float(cm.kv_tokens_per_sequence(seqs)), 3)}
    return out


def _serve_baseline(choice) -> dict | None:
    """plan.json ``baseline`` entry of a serving baseline (None when it found nothing)."""
    if choice is None:
        return None
    last = choice.pools[-1][2]
    return {"degrees": last.degrees.as_dict(), "tok_s_per_gpu": float(choice.tok_s_per_gpu),
            "plan": choice.describe()}
