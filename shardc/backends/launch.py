"""Launch settings for the engines people run: ``launch/vllm_<role>.sh`` and
``launch/sglang_<role>.sh`` per serving pool (SPEC section 11; docs/deploy.md maps every plan
field to each engine's flag).

A pool is ``workers`` identical engine instances (shardc's ``dp`` replicas); one instance
holds one replica of ``tp x ep x pp`` GPUs and serves up to ``batch`` sequences. Each
script starts one instance (``WORKER`` = its index, first argument, default 0), so run it
once per worker on that worker's GPUs.

A script is written only from what its engine can express (:func:`not_expressible`):

* vLLM (``vllm serve``): tp, pp; ep > 1 only with tp = 1 (``--data-parallel-size ep
  --enable-expert-parallel``: attention data-parallel over the ep ranks, experts split over
  them, vLLM's expert-parallel size being tp x dp); sequence parallelism through its
  compilation pass; Megatron's per-op dims;
* SGLang (``python -m sglang.launch_server``): ``--tp-size tp*ep``, with ep > 1
  ``--dp-size ep --enable-dp-attention --ep-size ep`` (attention tp = tp, experts split over
  ep with expert tp = tp); a model with dense MLP or shared-expert layers needs tp = 1 there
  (``--moe-dense-tp-size 1``); attention data-parallel inside the tp group
  (``--dp-size tp --enable-dp-attention``) when ep = 1; no sequence parallelism; Megatron's
  per-op dims otherwise.

When the plan uses something its engine cannot run, the script carries the nearest
configuration the engine can express (:func:`nearest_expressible`: same degrees with the
engine's per-op dims where the degrees are expressible, else the fewest degrees changed;
the best predicted tok/s/GPU among those, over the batch candidates) and a comment with
that configuration's predicted throughput, from the same evaluator that priced the plan,
next to the plan's. Nothing from input becomes code: the model name is ``shlex.quote``-d and
every number is validated (:class:`LaunchPool`).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shardc.backends.atomic import _umask
from shardc.errors import InputError
from shardc.ir.space import DEGREE_COMPONENTS, StrategySpace, megatron_op_choices
from shardc.ir.strategy import Strategy
from shardc.search.baselines import DP_ATTENTION, sweep_actions
from shardc.search.legal import LegalSampler
from shardc.text import one_line
from shardc.validate import MAX_TOKENS, check_number

ENGINES = ("vllm", "sglang")
ROLES = ("mixed", "prefill", "decode")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
BASE_PORTS = {"vllm": 8000, "sglang": 30000}  # worker w listens on base + w
KV_CACHE_DTYPE = {"vllm": {"bf16": "auto", "fp8": "fp8"},
                  "sglang": {"bf16": "auto", "fp8": "fp8_e4m3"}}
WEIGHT_FORMATS = ("bf16", "fp8")
# vLLM's disaggregated prefill: KV cache shipped by the NIXL connector (both roles)
VLLM_KV_TRANSFER = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
VLLM_SEQUENCE_PARALLEL = '{"pass_config":{"enable_sp":true}}'


@dataclass(frozen=True)
class LaunchPool:
    """One serving pool to launch. ``strategy``: its degrees (``dp`` = engine instances),
    ``batch`` (max running sequences per instance) and per-op choices; ``max_model_len``
    (tokens), ``mem_fraction`` (of each GPU's HBM the engine may fill, 0-1),
    ``kv_cache`` / ``weights`` (bf16 | fp8), ``model`` (path or hub name: any text, quoted
    in the scripts). Numbers are validated here, so nothing unchecked reaches a script."""

    role: str
    strategy: Strategy
    model: str
    max_model_len: int
    mem_fraction: float
    kv_cache: str = "bf16"
    weights: str = "bf16"

    def __post_init__(self):
        if self.role not in ROLES:
            raise InputError(f"launch pool role {self.role!r}: expected one of {', '.join(ROLES)}")
        check_number(self.max_model_len, "launch max model length", integer=True, minimum=1,
                     maximum=MAX_TOKENS, unit="tokens")
        check_number(self.mem_fraction, "launch GPU memory fraction", above=0.0, maximum=1.0)
        for what, value in (("KV-cache dtype", self.kv_cache), ("weights", self.weights)):
            if value not in WEIGHT_FORMATS:
                raise InputError(f"launch {what} {value!r}: expected bf16 or fp8")
        if not isinstance(self.model, str) or not self.model:
            raise InputError("launch model: expected a non-empty model path or name")

    @property
    def gpus(self) -> int:
        return self.strategy.degrees.world


@dataclass
class EngineLaunch:
    """What one engine runs for a pool: the strategy it expresses, and why it differs
    from the plan's (empty ``reasons`` = the plan itself)."""

    engine: str
    strategy: Strategy
    reasons: list[str] = field(default_factory=list)
    predicted: float | None = None  # tok/s/GPU of ``strategy`` (when it is not the plan)
    feasible: bool = True


# ------------------------------------------------------------------ expressibility
def _ops(space: StrategySpace) -> list[str]:
    return [slot.split(".")[-1] for slot in space.op_slots]


def _has_dense_mlp(space: StrategySpace) -> bool:
    """Whether some layer has a dense MLP or shared experts (SGLang runs those at the
    whole instance's tp under DP-attention, unless ``--moe-dense-tp-size 1``)."""
    return any(op in ("ffn1", "shared_ffn1") for op in _ops(space))


def _uses_dp_attention(space: StrategySpace, strategy: Strategy) -> bool:
    """Every attention op of the strategy is DP-attention inside the tp group."""
    att = [(slot, op) for slot, op in zip(space.op_slots, _ops(space)) if op in DP_ATTENTION]
    return bool(att) and all(strategy.choices[s] == DP_ATTENTION[op] for s, op in att)


def engine_op_choices(engine: str, space: StrategySpace, strategy: Strategy) -> dict[str, int]:
    """The per-op choices ``engine`` runs at the strategy's tp: Megatron's dims
    (:func:`~shardc.ir.space.megatron_op_choices`); SGLang keeps DP-attention inside the tp
    group when the strategy uses it and ep = 1."""
    tp_idx = space.values["tp"].index(strategy.degrees.tp)
    ops = megatron_op_choices(space, tp_idx)
    out = {s: int(c) for s, c in zip(space.op_slots, ops)}
    if engine == "sglang" and strategy.degrees.ep == 1 and _uses_dp_attention(space, strategy):
        for slot, op in zip(space.op_slots, _ops(space)):
            if op in DP_ATTENTION:
                out[slot] = DP_ATTENTION[op]
    return out


def degree_reasons(engine: str, space: StrategySpace, tp: int, ep: int, sp: int) -> list[str]:
    """Why ``engine`` cannot run these degrees (empty: it can)."""
    name = ENGINE_NAMES[engine]
    out = []
    if engine == "vllm" and tp > 1 and ep > 1:
        out.append(f"experts split over tp={tp} inside each of ep={ep} groups ({name}'s "
                   "expert parallelism spans tensor x data parallel ranks)")
    if engine == "sglang":
        if tp > 1 and ep > 1 and _has_dense_mlp(space):
            out.append(f"dense MLP at tp={tp} beside ep={ep} ({name} runs dense layers at the "
                       "instance's whole tp or at tp 1 under DP-attention)")
        if sp > 1:
            out.append(f"sequence parallelism (sp={sp}; {name} has no flag for it)")
    return out


def not_expressible(engine: str, space: StrategySpace, strategy: Strategy) -> list[str]:
    """Reasons ``engine`` cannot run ``strategy`` as planned (empty: it can)."""
    d = strategy.degrees
    out = degree_reasons(engine, space, d.tp, d.ep, d.sp)
    if d.tp > 1:
        want = engine_op_choices(engine, space, strategy)
        names = strategy.choice_names()
        diff = [f"{s}={names[s]}" for s in space.op_slots if strategy.choices[s] != want[s]]
        if diff:
            shown = ", ".join(diff[:4]) + (f" and {len(diff) - 4} more" if len(diff) > 4 else "")
            out.append(f"per-op choices {shown} ({ENGINE_NAMES[engine]} runs Megatron's dims"
                       + (", or DP-attention with ep=1" if engine == "sglang" else "") + ")")
    return out


# ------------------------------------------------------------------ nearest configuration
def nearest_expressible(engine: str, space: StrategySpace, strategy: Strategy,
                        evaluate) -> EngineLaunch:
    """The configuration ``engine`` runs for ``strategy``: the strategy itself when
    expressible; else, among the legal strategies of ``space`` the engine can express
    (engine per-op dims, every batch candidate), those with the fewest degrees (tp, ep, pp,
    sp) changed, the one ``evaluate`` (actions [B, A] -> (tok/s/GPU [B], feasible [B]))
    predicts best; infeasible ones only when none is feasible (``feasible`` False)."""
    reasons = not_expressible(engine, space, strategy)
    if not reasons:
        return EngineLaunch(engine, strategy)
    sampler = LegalSampler(space)
    acts = sweep_actions(sampler, lambda t: megatron_op_choices(space, t))
    deg = space.degree_arrays(acts)
    d = strategy.degrees
    triples = np.stack([deg["tp"], deg["ep"], deg["sp"]], axis=1)
    ok = {tuple(int(x) for x in t): not degree_reasons(engine, space, *(int(x) for x in t))
          for t in np.unique(triples, axis=0)}
    acts = acts[np.array([ok[tuple(int(x) for x in t)] for t in triples], dtype=bool)]
    if acts.shape[0] == 0:
        return EngineLaunch(engine, strategy, reasons + ["no configuration of this mesh is "
                                                         "expressible"], None, False)
    # SGLang's DP-attention inside the tp group, where the plan used it (ep = 1 rows)
    if engine == "sglang" and _uses_dp_attention(space, strategy):
        n_deg = len(DEGREE_COMPONENTS)
        rows = space.degree_arrays(acts)["ep"] == 1
        for j, (slot, op) in enumerate(zip(space.op_slots, _ops(space))):
            if op in DP_ATTENTION:
                acts[rows, n_deg + j] = DP_ATTENTION[op]
        acts = acts[sampler.legal(acts)]
    deg = space.degree_arrays(acts)
    dist = sum((deg[k] != getattr(d, k)).astype(int) for k in ("tp", "ep", "pp", "sp"))
    value, feasible = evaluate(acts)
    value = np.where(np.isfinite(value), np.asarray(value, dtype=float), -np.inf)
    pool = feasible if feasible.any() else np.ones(len(acts), dtype=bool)
    best_dist = dist[pool].min()
    cand = np.flatnonzero(pool & (dist == best_dist))
    i = int(cand[np.argmax(value[cand])])  # first maximum: deterministic
    return EngineLaunch(engine, space.decode(acts[i]), reasons, float(value[i]),
                        bool(feasible[i]))


# ------------------------------------------------------------------ rendering
def _describe(strategy: Strategy) -> str:
    d = strategy.degrees
    return f"tp={d.tp} ep={d.ep} pp={d.pp} dp={d.dp} sp={d.sp} batch={strategy.batch}"


def engine_flags(engine: str, pool: LaunchPool, strategy: Strategy, space: StrategySpace
                 ) -> list[tuple[str, str | None]]:
    """[(flag, value or None for a switch)] of one instance of ``strategy`` on ``engine``;
    values are validated numbers or fixed vocabulary (the model and port are added by the
    script)."""
    d, batch = strategy.degrees, int(strategy.batch)
    kv = KV_CACHE_DTYPE[engine][pool.kv_cache]
    mem = f"{float(pool.mem_fraction):.3f}"
    if engine == "vllm":
        flags = [("--tensor-parallel-size", str(d.tp)), ("--pipeline-parallel-size", str(d.pp))]
        if d.ep > 1:
            flags += [("--data-parallel-size", str(d.ep)), ("--enable-expert-parallel", None)]
        if d.sp > 1:
            flags.append(("--compilation-config", VLLM_SEQUENCE_PARALLEL))
        flags += [("--max-num-seqs", str(max(batch // d.ep, 1))),  # per data-parallel rank
                  ("--max-model-len", str(int(pool.max_model_len))),
                  ("--gpu-memory-utilization", mem), ("--kv-cache-dtype", kv)]
        if pool.weights == "fp8":
            flags.append(("--quantization", "fp8"))
        if pool.role in ("prefill", "decode"):
            flags.append(("--kv-transfer-config", VLLM_KV_TRANSFER))
        return flags
    flags = [("--tp-size", str(d.tp * d.ep)), ("--pp-size", str(d.pp))]
    if d.ep > 1:
        flags += [("--dp-size", str(d.ep)), ("--enable-dp-attention", None),
                  ("--ep-size", str(d.ep))]
        if d.tp == 1 and _has_dense_mlp(space):
            flags.append(("--moe-dense-tp-size", "1"))
    elif d.tp > 1 and _uses_dp_attention(space, strategy):
        flags += [("--dp-size", str(d.tp)), ("--enable-dp-attention", None)]
    flags += [("--max-running-requests", str(batch)),
              ("--context-length", str(int(pool.max_model_len))),
              ("--mem-fraction-static", mem), ("--kv-cache-dtype", kv)]
    if pool.weights == "fp8":
        flags.append(("--quantization", "fp8"))
    if pool.role in ("prefill", "decode"):
        flags.append(("--disaggregation-mode", pool.role))
    return flags


def _engine_gpus(engine: str, flags: list[tuple[str, str | None]]) -> int:
    """GPUs one instance of ``flags`` occupies (the engine's own arithmetic)."""
    f = dict(flags)
    if engine == "vllm":
        return (int(f["--tensor-parallel-size"]) * int(f["--pipeline-parallel-size"])
                * int(f.get("--data-parallel-size") or 1))
    return int(f["--tp-size"]) * int(f["--pp-size"])


def render_script(pool: LaunchPool, launch: EngineLaunch, space: StrategySpace,
                  plan_value: float | None, gpus_per_node: int) -> str:
    """The bash script of one engine for one pool (module docstring)."""
    engine, s = launch.engine, launch.strategy
    name = ENGINE_NAMES[engine]
    flags = engine_flags(engine, pool, s, space)
    per_worker = _engine_gpus(engine, flags)
    workers = s.degrees.dp
    assert per_worker * workers == s.degrees.world, (engine, flags, s.degrees)
    nodes = -(-per_worker // max(int(gpus_per_node), 1))
    lines = ["#!/usr/bin/env bash",
             f"# {name} launch script written by shardc: pool role {pool.role}.",
             f"# Pool: {workers} worker(s) x {per_worker} GPUs = {workers * per_worker} GPUs "
             f"({_describe(s)}).",
             f"# Run once per worker: {shlex.quote('launch/' + script_name(engine, pool.role))} "
             "WORKER (0 .. WORKERS-1) on that worker's GPUs;",
             "# SHARDC_MODEL overrides the model path or hub name below."]
    if plan_value is not None and not launch.reasons:
        lines.append(f"# shardc predicts {plan_value:.1f} tok/s/GPU for this plan.")
    if launch.reasons:
        lines.append(f"# The plan is not expressible in {name}:")
        lines += [f"#   - {one_line(r)}" for r in launch.reasons]  # names from the model
        pred = "-" if launch.predicted is None else f"{launch.predicted:.1f}"
        lines.append(f"# Nearest configuration {name} can express: {_describe(s)}, "
                     f"predicted {pred} tok/s/GPU"
                     + ("" if launch.feasible else " (infeasible under shardc's cost model)")
                     + (f" vs the plan's {plan_value:.1f} tok/s/GPU" if plan_value is not None
                        else "") + " (same cost model).")
    if pool.role in ("prefill", "decode"):
        lines.append("# Disaggregated: pair this pool with the "
                     + ("decode" if pool.role == "prefill" else "prefill") + " pool's script"
                     + (" behind a router that sends each request to both." if engine == "sglang"
                        else " through a proxy (the KV cache moves by the NIXL connector)."))
    lines += ["set -euo pipefail", f"WORKERS={workers}", 'WORKER="${1:-0}"',
              'case "$WORKER" in ""|*[!0-9]*) echo "worker index must be a number" >&2; exit 2;; '
              "esac",
              'if [ "$WORKER" -ge "$WORKERS" ]; then echo "worker index must be below $WORKERS" '
              '>&2; exit 2; fi',
              f"DEFAULT_MODEL={shlex.quote(pool.model)}",
              'MODEL="${SHARDC_MODEL:-$DEFAULT_MODEL}"',
              f"PORT=$(({BASE_PORTS[engine]} + WORKER))"]
    if nodes > 1:
        lines.append(f"# One worker spans {nodes} nodes: "
                     + ("start a Ray cluster over them first (vLLM's multi-node executor)."
                        if engine == "vllm" else
                        "run this on each with NODE_RANK 0.." + str(nodes - 1)
                        + " and DIST_INIT_ADDR host:port of rank 0."))
    cmd = (["vllm", "serve", '"$MODEL"'] if engine == "vllm"
           else ["python", "-m", "sglang.launch_server", "--model-path", '"$MODEL"'])
    args = [f"{k} {shlex.quote(v)}" if v is not None else k for k, v in flags]
    if nodes > 1 and engine == "vllm":  # Ray places the ranks over the worker's nodes
        d = s.degrees
        if d.tp * d.pp > gpus_per_node:
            args.append("--distributed-executor-backend ray")
        if d.ep > 1:
            args.append("--data-parallel-backend ray")
    elif nodes > 1:
        args += [f"--nnodes {nodes}", '--node-rank "${NODE_RANK:?set NODE_RANK}"',
                 '--dist-init-addr "${DIST_INIT_ADDR:?set DIST_INIT_ADDR}"']
    args.append('--port "$PORT"')
    lines.append("exec " + " ".join(cmd) + " \\")
    lines += [f"    {a} \\" for a in args[:-1]] + [f"    {args[-1]}", ""]
    return "\n".join(lines)


def script_name(engine: str, role: str) -> str:
    return f"{engine}_{role}.sh"


def launch_scripts(pool: LaunchPool, space: StrategySpace, evaluate,
                   plan_value: float | None = None) -> dict[str, object]:
    """``{"launch/<engine>_<role>.sh": writer}`` for both engines, ready for
    :func:`shardc.backends.atomic.write_outputs` (each writer writes the text and makes the
    file executable). ``evaluate``: actions [B, A] of ``space`` -> (tok/s/GPU [B],
    feasible [B]), the evaluator that priced the plan (the search objective);
    ``plan_value``: the plan's predicted tok/s/GPU, shown beside the nearest's."""
    out: dict[str, object] = {}
    for engine in ENGINES:
        launch = nearest_expressible(engine, space, pool.strategy, evaluate)
        text = render_script(pool, launch, space, plan_value, space.mesh.gpus_per_node)
        out[f"launch/{script_name(engine, pool.role)}"] = _executable(text)
    return out


def _executable(text: str):
    def write(path) -> None:
        Path(path).write_text(text)
        os.chmod(path, 0o777 & ~_umask())

    write.text = text  # the script, for callers and tests that want it without a file
    return write


def role_for_phase(phase: str) -> str:
    """The pool role of a single-phase compile: ``decode`` -> ``mixed`` (one aggregated
    engine serving the traffic at the decode plan's degrees: engines always prefill too);
    ``prefill`` -> ``prefill`` (the prefill pool of a disaggregated deployment)."""
    return "prefill" if phase == "prefill" else "mixed"
