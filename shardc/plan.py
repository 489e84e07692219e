"""The plan: everything ``plan.json`` holds (SPEC section 4), its checks, and its uses.

>>> plan = build_plan(graph, strategy, mesh, "h100", workload, predicted, baseline, search)
>>> plan.save("plan.json"); plan = load_plan("plan.json")
>>> src = plan.code()                      # parallelize.py
>>> model = plan.apply(model, device_mesh)  # DTensor placements, in process

Keys beyond SPEC section 4's minimum: ``spmd_dims`` (the mesh dims every ``placements``
list refers to: the logical mesh without ``pp``), ``layer_kinds [{name, count, layers,
attention, window, recurrent_state}]`` (``attention``: ``full`` or ``sliding_window`` with its
``window`` in tokens, per kind: Gemma's alternating and 5:1 patterns show as kinds; a
linear-attention / Mamba kind says ``gated_deltanet`` / ``mamba`` and gives its
``recurrent_state`` elements per sequence and layer, :mod:`shardc.ir.recurrent`)
and ``params [{fqn, shape, placements, local_shape, stage, op, layer, split_dims}]`` (what
every rank holds; the fused op, decoder layer and the tensor dim each choice cuts come from
the graph, :mod:`shardc.ir.param_roles`, with ``expert_dim`` / ``parts`` / ``tied`` where
they apply; a plan without them still loads: :func:`shardc.backends.layout.rows_with_ops`);
every ``nodes`` entry also has ``inputs`` (producer node names) and ``token_dims``, and its
``shape`` is at the plan's workload (one decode step / one prefill pass of one replica, see
:mod:`shardc.ir.token_dims`), not the traced example's. ``model.fingerprint`` is the model's
parameter table (:mod:`shardc.fingerprint`): loading checks the rows against it, and
:meth:`Plan.apply` / ``parallelize.py`` refuse a model that does not match it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardc.errors import InputError
from shardc.fingerprint import ModelMismatch, fingerprint
from shardc.ir.contract import (
    BRANCHES,
    CHOICE_NAMES,
    branch_ends,
    dtensor_spelling,
    walk,
)
from shardc.ir.graph import Graph
from shardc.ir.strategy import Degrees, Mesh, Strategy, Workload, residual_placement
from shardc.ir.windows import attention_variant
from shardc.plan_checks import validate_plan_dict  # noqa: F401 - re-exported (shardc.plan API)
from shardc.text import number_or_dash, one_line
from shardc.validate import dumps_strict_json, loads_strict_json

SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)  # schema 1 plans (before serving) still load
_KEYS = ("schema_version", "shardc_version", "model", "mesh", "workload", "degrees",
         "logical_mesh", "spmd_dims", "layer_kinds", "ops", "params", "nodes", "predicted",
         "baseline", "search")


@dataclass
class Plan:
    schema_version: int
    shardc_version: str
    model: dict
    mesh: dict
    workload: dict
    degrees: dict
    logical_mesh: dict
    spmd_dims: list
    layer_kinds: list
    ops: list
    params: list
    nodes: list
    predicted: dict = field(default_factory=dict)
    baseline: dict = field(default_factory=dict)
    search: dict = field(default_factory=dict)
    serving: dict = field(default_factory=dict)  # --phase serve only (SPEC section 4)
    # each engine's best configuration (shardc.launch_plan; SPEC section 4 ``launch``)
    launch: dict = field(default_factory=dict)
    # can the DTensor backend run the model: {"runs": bool, "reason": str | None}; {} = not
    # asked (an ONNX model, a Graph, a plan written before the key)
    backend: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ views
    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in _KEYS}
        if self.serving:
            out["serving"] = self.serving
        if self.launch:
            out["launch"] = self.launch
        if self.backend:
            out["backend"] = self.backend
        return out

    @property
    def backend_runs(self) -> bool:
        """False when compile found the DTensor backend cannot run the model (no
        ``parallelize.py``; plan.json ``backend.reason`` says why)."""
        return bool((self.backend or {}).get("runs", True))

    def strategy(self) -> Strategy:
        """The decoded strategy (degrees, batch, per-op choice indices)."""
        d = self.degrees
        deg = Degrees(tp=d["tp"], pp=d["pp"], ep=d["ep"], dp=d["dp"], sp=d.get("sp", 1),
                      moe_tp=d.get("moe_tp", 0), moe_ep=d.get("moe_ep", 0))
        choices = {o["name"]: CHOICE_NAMES[o["kind"]].index(o["choice"]) for o in self.ops}
        return Strategy(deg, int(self.workload.get("batch") or 1), choices)

    def fingerprint(self) -> dict:
        """plan.json ``model.fingerprint`` (:mod:`shardc.runtime.fingerprint`): the model's
        parameter table; a plan without one (written before it existed) gets its rows'."""
        return self.model.get("fingerprint") or fingerprint(self.params)

    def check_model(self, model) -> None:
        """InputError naming the first difference unless ``model`` (an ``nn.Module``) has
        the parameters this plan was made for (names and shapes)."""
        from shardc.fingerprint import check_model

        if not callable(getattr(model, "named_parameters", None)):
            raise InputError(f"expected a torch nn.Module, got {type(model).__name__}")
        try:
            check_model(model, self.fingerprint())
        except ModelMismatch as e:
            raise InputError(str(e)) from None

    def layer_kind_map(self) -> dict[str, list[int]]:
        return {k["name"]: list(k["layers"]) for k in self.layer_kinds}

    def summary(self) -> str:
        """Print and return a few lines: degrees, predicted tok/s/GPU, TPOT / TTFT (ms; "-"
        where the phase does not predict it), memory (GB/GPU), and every op's choice."""
        d, p = self.degrees, self.predicted or {}
        deg = " ".join(f"{k}={d[k]}" for k in ("tp", "ep", "pp", "dp", "sp"))
        lines = [f"{one_line(self.model.get('name'))} on {self.mesh.get('gpus_per_node')}x"
                 f"{self.mesh.get('nodes')} {one_line(self.mesh.get('hardware'))}: {deg} "
                 f"batch={self.workload.get('batch')}"]
        if p.get("tok_s_per_gpu") is not None:  # TPOT is None in prefill, TTFT in decode
            lines.append(f"predicted {number_or_dash(p['tok_s_per_gpu'], '.1f')} tok/s/GPU, "
                         f"TPOT {number_or_dash(p.get('tpot_ms'), '.2f')} ms, "
                         f"TTFT {number_or_dash(p.get('ttft_ms'), '.1f')} ms, memory "
                         f"{number_or_dash(p.get('memory_gb_per_gpu'), '.1f')} GB/GPU")
        if not self.backend_runs:
            lines.append(f"no parallelize.py: {one_line(self.backend.get('reason'))}")
        for o in self.ops:
            lines.append(f"  {one_line(o['name']):<28} {o['choice']}")
        text = "\n".join(lines)
        print(text)
        return text

    # ------------------------------------------------------------------ io
    def save(self, path: str | Path) -> Path:
        """Write plan.json atomically (temp file in the same directory + os.replace), as
        strict JSON (a NaN or infinity is a bug: ValueError), to a new path or over a regular
        file. The folder must exist: InputError naming it otherwise (no folder is created)."""
        import os

        from shardc.backends.atomic import write_file_atomic

        if not isinstance(path, (str, os.PathLike)):
            raise InputError(f"Plan.save: expected a path (str or Path), got "
                             f"{type(path).__name__}")
        path = Path(path)
        return write_file_atomic(path, dumps_strict_json(self.to_dict(), indent=2) + "\n",
                                 f"Plan.save {path}")

    # ------------------------------------------------------------------ backend
    def code(self, standalone: bool = False) -> str:
        """``parallelize.py`` source for this plan (``standalone``: on torch's parallel API,
        importing only torch; InputError for a plan that path does not cover yet, or whose
        model the DTensor backend cannot run: plan.json ``backend.reason``)."""
        from shardc.backends.dtensor import emit_parallelize

        if not self.backend_runs:
            raise InputError(f"{one_line(self.backend.get('reason'))}; this plan has no "
                             "parallelize.py (its engine launch scripts need none)")
        return emit_parallelize(self, standalone=standalone)

    def apply(self, model, device_mesh=None):
        """Shard ``model`` in process on ``device_mesh`` (created from the logical mesh when
        None) by running this plan's ``parallelize.py`` (:meth:`code`): ``Plan.apply`` and the
        emitted file are one code path, whichever runtime the plan gets. The generated source
        holds plan values only as escaped literals (docs/errors.md, "Model files are code"),
        so running it runs nothing from the plan's text. After placement the file checks
        that every parameter the plan splits was split (:func:`shardc.fingerprint.check_placed`):
        InputError naming the first one left whole."""
        import types

        self.check_model(model)  # before anything is placed: exit 2 naming the difference
        module = types.ModuleType("shardc_parallelize")
        exec(compile(self.code(), "<parallelize.py>", "exec"), module.__dict__)  # noqa: S102
        try:
            return module.parallelize(model, device_mesh)
        except ModelMismatch as e:  # a parameter the plan splits was left whole
            raise InputError(str(e)) from None


# ---------------------------------------------------------------------- construction
def op_rows(graph: Graph, strategy: Strategy, dims: list[str]) -> list[dict]:
    """plan.json ``ops``: per fused-op slot its choice and output placements per SPMD dim
    (placements of the op's input/output when the residual stream arrives)."""
    residual = residual_placement(strategy.degrees)
    rows = []

    # experts tensor-parallel over ep x tp (moe_ep = 1): over ep as over tp, on the
    # gathered tokens
    batch_dims = ("dp",) if strategy.degrees.moe_ep == 1 else ("dp", "ep")

    def add(slot, kind, step):
        split = batch_dims if step.op.startswith("expert_ffn") else ("dp", "ep")
        rows.append({"name": slot, "kind": step.op, "layer_kind": kind,
                     "choice": step.choice.name,
                     "placements": [("S(0)" if d in split else dtensor_spelling(step.produced))
                                    for d in dims],
                     "input_placements": [("S(0)" if d in split
                                           else dtensor_spelling(step.need)) for d in dims]})

    def add_branch(branch, ops, kind):
        slots = [op if kind is None else f"{kind}.{op}" for op in ops]
        w = walk(ops, [int(strategy.choices.get(s, 2)) for s in slots],
                 *branch_ends(branch, residual))
        for slot, step in zip(slots, w.steps):
            add(slot, kind, step)

    if graph.global_op("embedding") is not None:
        add_branch("embedding", ("embedding",), None)
    for k in graph.layer_kinds:
        for branch, ops in BRANCHES.items():
            if all(k.op(o) is not None for o in ops):
                add_branch(branch, ops, k.name)
    if graph.global_op("lm_head") is not None:
        add_branch("lm_head", ("lm_head",), None)
    return rows


def plan_nodes(graph: Graph, workload: dict) -> list[dict]:
    """plan.json ``nodes``: every IR node with its placements, its inputs (node names), its
    shape at the plan's workload (``workload``: plan.json's phase, batch, context, prompt;
    see :mod:`shardc.ir.token_dims`) and which dims of it are token dims."""
    from shardc.ir.token_dims import token_dims, traced_batch_seq, workload_shape, workload_sizes

    tags = token_dims(graph)
    traced = traced_batch_seq(graph)
    sizes = workload_sizes(workload["phase"], workload["batch"], workload["context"],
                           workload["prompt"])
    return [{"name": n.name, "op": n.op,
             "shape": workload_shape(n.output_shape, tags.get(n.name), traced, sizes),
             "token_dims": list(tags.get(n.name) or [None] * len(n.output_shape)),
             "inputs": list(n.inputs), "placements": list(n.placements or []),
             "redistribute": n.redistribute, "stage": n.stage, "layer": n.layer,
             "fused_op": n.fused_op, "layer_kind": n.layer_kind} for n in graph.nodes]


def build_plan(graph: Graph, strategy: Strategy, mesh: Mesh | str, hardware: str,
               workload: Workload, predicted: dict | None = None, baseline: dict | None = None,
               search: dict | None = None, annotated: bool | None = None,
               serving: dict | None = None, serve_workload: Workload | None = None) -> Plan:
    """Assemble a :class:`Plan`. ``graph`` may already be annotated with ``strategy``
    (nodes carry placements); otherwise the annotation pass runs here.

    Serving (``serve_workload``, ``serving``: plan.json's ``serving`` section): ``strategy``
    and ``workload`` are one pool's (the mixed pool, or a disaggregated pool whose ``dp`` is
    its worker count and whose GPUs may be fewer than the mesh's); the plan's ``workload``
    says phase ``serve`` with the request's isl/osl."""
    from shardc.backends.layout import param_plan
    from shardc.passes.annotate import annotate, spmd_dims
    from shardc.version import __version__

    mesh = mesh if isinstance(mesh, Mesh) else Mesh.parse(mesh)
    deg = strategy.degrees
    pool_of_mesh = bool(serving) and serving.get("mode") == "disagg" and deg.world <= mesh.gpus
    if deg.world != mesh.gpus and not pool_of_mesh:
        raise InputError(f"degrees tp={deg.tp} pp={deg.pp} ep={deg.ep} dp={deg.dp} use "
                         f"{deg.world} GPUs; mesh {mesh} has {mesh.gpus}")
    if annotated is None:
        annotated = bool(graph.nodes) and all(n.placements is not None for n in graph.nodes)
    g = graph if annotated else annotate(graph, strategy)
    dims = spmd_dims(strategy)
    shape, names = deg.logical_mesh()
    kind_of_layer = {i: k.name for k in g.layer_kinds for i in k.layers}
    wl = dict(phase=workload.phase, batch=int(strategy.batch), context=int(workload.context),
              prompt=int(workload.prompt), tpot_slo_ms=float(workload.tpot_slo_ms),
              ttft_slo_ms=float(workload.ttft_slo_ms), weights=workload.weights,
              kv_cache=workload.kv_cache, isl=int(workload.isl), osl=int(workload.osl),
              routing=workload.routing, redundant_experts=int(workload.redundant_experts),
              fp8_scaling=workload.fp8_scaling)
    nodes = plan_nodes(g, wl)
    if serve_workload is not None:
        wl.update(phase="serve", isl=int(serve_workload.isl), osl=int(serve_workload.osl),
                  mode=serve_workload.mode)
    params = param_plan(g, strategy, kind_of_layer)  # KV heads: from the IR
    ops = op_rows(g, strategy, dims)
    return Plan(
        schema_version=SCHEMA_VERSION, shardc_version=__version__,
        model={"name": g.name, "params": int(g.num_params), "layers": int(g.num_layers),
               "source": g.source, **_head_counts(g), "fingerprint": fingerprint(params)},
        mesh={"gpus_per_node": mesh.gpus_per_node, "nodes": mesh.nodes, "hardware": hardware},
        workload=wl, degrees=dict(deg.as_dict()),
        logical_mesh={"shape": list(shape), "dim_names": list(names)},
        spmd_dims=dims,
        layer_kinds=[{"name": k.name, "count": k.count, "layers": list(k.layers),
                      **attention_variant(k)} for k in g.layer_kinds],
        ops=ops,
        params=params,
        nodes=nodes, predicted=_with_runtime(predicted, g, deg, workload.phase, ops),
        baseline=dict(baseline or {}), search=dict(search or {}), serving=dict(serving or {}))


def _with_runtime(predicted: dict | None, g: Graph, deg, phase: str, ops=()) -> dict:
    """``predicted`` plus ``runtime`` (:func:`shardc.cost.runtime_step.runtime_prediction`:
    the emitted runtime's step beside the engine's) when the engine predicts a step.
    ``ops``: plan.json's op rows (whether the experts are replicated over tp)."""
    from shardc.cost.runtime_step import runtime_prediction

    out = dict(predicted or {})
    if out.get("breakdown") and "runtime" not in out:
        moe = sum(k.count for k in g.layer_kinds if k.op("expert_ffn1") is not None)
        experts = int(g.config.get("num_experts", 0) or 0)
        rep_experts = all(str(o.get("choice")) == "rep" for o in ops
                          if str(o.get("name", "")).split(".")[-1].startswith("expert_ffn"))
        # the runtime's MoE decode is captured (ExpertsLocal.static) without an ep
        # dispatch, the all-gather dispatch, or the tp row gather of sequence parallelism
        capturable = deg.ep == 1 and not deg.experts_resplit and (
            deg.sp == 1 or deg.tp == 1 or rep_experts)
        rt = runtime_prediction(out, deg.as_dict(), int(g.num_layers), moe,
                                experts // max(int(deg.ep), 1), phase, capturable)
        if rt is not None:
            out["runtime"] = rt
    return out


# ---------------------------------------------------------------------- loading
def _head_counts(g: Graph) -> dict:
    """plan.json ``model.heads`` / ``model.kv_heads`` (attention and KV heads, when the
    graph knows them): a heads split with tp > kv_heads replicates KV heads."""
    heads, kv = (int(g.config.get(k, 0) or 0) for k in ("heads", "kv_heads"))
    return {"heads": heads, "kv_heads": kv or heads} if heads else {}


def load_plan(path: str | Path) -> Plan:
    """Read and check a plan.json; any problem is an :class:`InputError` naming it."""
    import os

    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"load_plan: expected a path (str or Path), got {type(path).__name__}")
    path = Path(path)
    try:
        data = loads_strict_json(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: no such plan file") from None
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a readable JSON plan (binary, not UTF-8 text)") from None
    except RecursionError:
        raise InputError(f"{path}: not a readable JSON plan (nested too deeply)") from None
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: not a readable JSON plan ({e})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: a plan must be a JSON object")
    ver = data.get("schema_version")
    if isinstance(ver, bool) or ver not in READABLE_SCHEMAS:
        raise InputError(f"{path}: plan schema_version {ver!r} is not supported "
                         f"(this shardc reads schema_version "
                         f"{' and '.join(map(str, READABLE_SCHEMAS))})")
    validate_plan_dict(data, str(path))
    return Plan(**{k: data[k] for k in _KEYS}, serving=dict(data.get("serving") or {}),
                launch=dict(data.get("launch") or {}),
                backend=dict(data.get("backend") or {}))


def strategy_code(graph: Graph, strategy: Strategy, batch: int, seq: int,
                  layer_kinds: dict | None = None) -> str:
    """The default ``parallelize.py`` of ``strategy`` planned on ``graph`` (a model traced)
    for a one-node mesh of its ranks and a ``batch x seq`` workload: what ``shardc verify``'s
    strategy cases run (:func:`shardc.backends.verify.run_suites` ``plan_code``).
    ``layer_kinds`` (kind -> layers), when given, must be the graph's."""
    from shardc.ir.strategy import Mesh, Workload

    plan = build_plan(graph, strategy, Mesh(strategy.degrees.world, 1), "h100",
                      Workload(batch=batch, context=seq))
    if layer_kinds is not None:
        want = {k: sorted(v) for k, v in layer_kinds.items()}
        have = {k: sorted(v) for k, v in plan.layer_kind_map().items()}
        if want != have:
            raise ValueError(f"layer kinds {want} are not the traced graph's {have}")
    return plan.code()
