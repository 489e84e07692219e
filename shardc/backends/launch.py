"""Launch settings for the engines people run: plan.json ``launch`` pools and
``launch/vllm_<role>.sh`` / ``launch/sglang_<role>.sh`` / ``launch/trtllm_mixed.sh`` (SPEC
section 11; docs/deploy.md maps every degree to each engine's flag).

The configuration of each engine is found by the search in the space that engine expresses
(:mod:`shardc.ir.engines`, :mod:`shardc.launch_plan`), never by rounding the plan; this
module only spells a found configuration as the engine's flags (:func:`engine_flags`) and
writes the script (:func:`render_script`).

A pool is ``workers`` identical engine instances (shardc's ``dp`` replicas); one instance
holds one replica of ``tp x ep x pp`` GPUs and serves up to ``batch`` sequences. Each
script starts one instance (``WORKER`` = its index, first argument, default 0): run it
once per worker. When several workers share a node the script sets
``CUDA_VISIBLE_DEVICES`` to the worker's GPUs of that node.

Nothing from input becomes code or a flag: the model id is validated
(:func:`check_model_id`: a hub id or a path, never starting with ``-``), quoted, and passed
as ``--model=<id>`` / ``--model-path=<id>`` (one argv token the engines' argparse reads as
the option's value; TensorRT-LLM's click positional after ``--``); every number is validated (:class:`LaunchPool`); every flag written is
one of the engine's own (:data:`ENGINE_FLAGS`, read from its argument definitions).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import unicodedata
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from shardc.backends.atomic import _umask
from shardc.backends.launch_trtllm import (
    HOST_CHECK,
    ROLE_PORTS,
    fp8_checkpoint_lines,
    launcher_flags,
    llm_api_options,
    multi_node_prefix,
    option_paths,
    options_file_lines,
    router_script,
)
from shardc.errors import InputError
from shardc.ir.engines import ENGINE_NAMES, has_dense_mlp, uses_dp_attention
from shardc.ir.strategy import Strategy
from shardc.text import one_line
from shardc.validate import MAX_TOKENS, check_number

SCRIPT_ENGINES = ("vllm", "sglang", "trtllm")  # engines with checked flag lists
ROLES = ("mixed", "prefill", "decode")
BASE_PORTS = {"vllm": 8000, "sglang": 30000, "trtllm": 8000}  # worker w: base + w
KV_CACHE_DTYPE = {"vllm": {"bf16": "auto", "fp8": "fp8"},
                  "sglang": {"bf16": "auto", "fp8": "fp8_e4m3"},
                  "trtllm": {"bf16": "auto", "fp8": "fp8"}}
WEIGHT_FORMATS = ("bf16", "fp8")
# vLLM's disaggregated prefill: KV cache shipped by the NIXL connector (both roles)
VLLM_KV_TRANSFER = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
VLLM_SEQUENCE_PARALLEL = '{"pass_config":{"enable_sp":true}}'
MODEL_FLAG = {"vllm": "--model", "sglang": "--model-path"}  # TensorRT-LLM: positional
COMMAND = {"vllm": ["vllm", "serve"], "sglang": ["python", "-m", "sglang.launch_server"],
           "trtllm": ["trtllm-serve", "serve"]}
FLAGS_FILE = Path(__file__).with_name("engine_flags.json")
MAX_MODEL_ID_CHARS = 1024
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


@lru_cache(maxsize=1)
def engine_flag_table() -> dict:
    """engine -> {command, checked_against, flags}: the checked-in flag lists
    (``engine_flags.json``, refreshed by ``tools/refresh_engine_flags.py``)."""
    data = json.loads(FLAGS_FILE.read_text())
    return {e: data[e] for e in SCRIPT_ENGINES}


# ------------------------------------------------------------------ model id
def check_model_id(text, what: str = "model id") -> str:
    """``text`` when it is a model id an engine may be given: a hub id (``org/name``) or a
    filesystem path (starting with ``/``, ``.`` or ``~``), printable, at most
    :data:`MAX_MODEL_ID_CHARS`, never starting with ``-``; else InputError naming ``what``."""
    if not isinstance(text, str) or not text:
        raise InputError(f"{what}: expected a model hub id (org/name) or a path")
    shown = one_line(ascii(text[:80]))
    if text.startswith("-"):
        raise InputError(f"{what} {shown}: a model id must not start with '-' (it would be "
                         "read as an engine flag)")
    if len(text) > MAX_MODEL_ID_CHARS or any(
            unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn") for ch in text):
        raise InputError(f"{what} {shown}: control, format or unassigned characters, or "
                         f"longer than {MAX_MODEL_ID_CHARS} characters")
    if _HUB_ID.match(text) or text[0] in "/.~":
        return text
    raise InputError(f"{what} {shown}: expected a hub id (org/name: letters, digits, '.', "
                     "'_', '-') or a path starting with '/', '.' or '~'")


def config_model_id(path: str) -> str | None:
    """A config.json's ``_name_or_path`` when it is a valid model id (:func:`check_model_id`),
    else None (not a JSON config, no such field, or an id the scripts must not carry)."""
    if not str(path).lower().endswith(".json"):
        return None
    try:
        from shardc.validate import loads_strict_json

        data = loads_strict_json(Path(path).read_text(encoding="utf-8"))
        value = data.get("_name_or_path") if isinstance(data, dict) else None
        return check_model_id(value) if value else None
    except (InputError, OSError, ValueError, RecursionError):
        return None


# ------------------------------------------------------------------ pools and flags
@dataclass(frozen=True)
class LaunchPool:
    """One serving pool to launch. ``strategy``: its degrees (``dp`` = engine instances),
    ``batch`` (max running sequences per instance) and per-op choices; ``max_model_len``
    (tokens), ``mem_fraction`` (of each GPU's HBM the engine may fill, 0-1),
    ``kv_cache`` / ``weights`` (bf16 | fp8); ``dense_mlp``: the model has dense MLP or
    shared-expert layers; ``dp_attention``: attention runs data-parallel inside the tp group;
    ``token_budget`` / ``prefill_chunk`` (tokens per engine step, an aggregated pool's
    scheduler as plan.json ``serving.pools[].scheduler`` prices it: ``max_batched_tokens`` and
    its prompt part ``prefill_budget_tokens``; None: the engine's default).
    Numbers are validated here, so nothing unchecked reaches a script."""

    role: str
    strategy: Strategy
    max_model_len: int
    mem_fraction: float
    kv_cache: str = "bf16"
    weights: str = "bf16"
    dense_mlp: bool = False
    dp_attention: bool = False
    token_budget: int | None = None
    prefill_chunk: int | None = None

    def __post_init__(self):
        if self.role not in ROLES:
            raise InputError(f"launch pool role {self.role!r}: expected one of {', '.join(ROLES)}")
        check_number(self.max_model_len, "launch max model length", integer=True, minimum=1,
                     maximum=MAX_TOKENS, unit="tokens")
        check_number(self.mem_fraction, "launch GPU memory fraction", above=0.0, maximum=1.0)
        for what, value in (("KV-cache dtype", self.kv_cache), ("weights", self.weights)):
            if value not in WEIGHT_FORMATS:
                raise InputError(f"launch {what} {value!r}: expected bf16 or fp8")
        d = self.strategy.degrees
        for name in ("tp", "ep", "pp", "dp", "sp"):
            check_number(getattr(d, name), f"launch {name}", integer=True, minimum=1)
        check_number(self.strategy.batch, "launch batch", integer=True, minimum=1)
        for what, value in (("token budget", self.token_budget),
                            ("prefill chunk", self.prefill_chunk)):
            if value is not None:
                check_number(value, f"launch {what}", integer=True, minimum=1,
                             maximum=MAX_TOKENS, unit="tokens")

    @classmethod
    def of(cls, role: str, strategy: Strategy, space, max_model_len: int, mem_fraction: float,
           kv_cache: str = "bf16", weights: str = "bf16",
           scheduler: dict | None = None) -> LaunchPool:
        """The pool of ``strategy`` in ``space`` (reads the model's layer structure);
        ``scheduler``: the pool's priced token budget (plan.json ``serving.pools[].scheduler``)."""
        sched = scheduler or {}
        budget = sched.get("max_batched_tokens")
        chunk = sched.get("prefill_budget_tokens")
        return cls(role, strategy, int(max_model_len), float(mem_fraction), kv_cache, weights,
                   has_dense_mlp(space), uses_dp_attention(space, strategy),
                   int(budget) if budget else None, int(chunk) if chunk else None)


def engine_flags(engine: str, pool: LaunchPool) -> list[str]:
    """The argv tokens of one instance of ``pool`` on ``engine`` (the model, port and
    multi-node flags are added by the script): validated numbers and fixed vocabulary."""
    d, batch = pool.strategy.degrees, int(pool.strategy.batch)
    kv = KV_CACHE_DTYPE[engine][pool.kv_cache]
    mem = f"{float(pool.mem_fraction):.3f}"
    if engine == "vllm":
        out = ["--tensor-parallel-size", str(d.tp), "--pipeline-parallel-size", str(d.pp)]
        if d.experts_resplit:  # experts tp over all tp x ep ranks, or ep over all of them
            out += ["--data-parallel-size", str(d.ep)] if d.ep > 1 else []
            out += ["--enable-expert-parallel"] if d.moe_ep > 1 else []
        elif d.ep > 1:  # attention data-parallel over the ep ranks, experts split over them
            out += ["--data-parallel-size", str(d.ep), "--enable-expert-parallel"]
        if d.sp > 1:
            out += ["--compilation-config", VLLM_SEQUENCE_PARALLEL]
        seqs = max(batch // d.ep, 1)  # per data-parallel rank
        out += ["--max-num-seqs", str(seqs),
                "--max-model-len", str(int(pool.max_model_len)),
                "--gpu-memory-utilization", mem, "--kv-cache-dtype", kv]
        if pool.token_budget:  # per data-parallel rank; vLLM wants at least max-num-seqs
            out += ["--max-num-batched-tokens", str(max(pool.token_budget // d.ep, seqs))]
        if pool.weights == "fp8":
            out += ["--quantization", "fp8"]
        if pool.role in ("prefill", "decode"):
            out += ["--kv-transfer-config", VLLM_KV_TRANSFER]
        return out
    if engine == "sglang":
        out = ["--tp-size", str(d.tp * d.ep), "--pp-size", str(d.pp)]
        if d.ep > 1 or pool.dp_attention:
            dp = d.tp * d.ep if pool.dp_attention else d.ep
            out += ["--dp-size", str(dp), "--enable-dp-attention"]
            if d.expert_ep > 1:  # MoE tp = tp-size / ep-size (a re-split's at ep = 1 too)
                out += ["--ep-size", str(d.expert_ep)]
            if d.ep > 1 and d.tp == 1 and pool.dense_mlp:
                out += ["--moe-dense-tp-size", "1"]
        elif d.expert_ep > 1:  # a re-split: the experts over moe_ep groups inside tp
            out += ["--ep-size", str(d.expert_ep)]
        if d.pp > 1:  # SGLang refuses pipeline parallelism with its overlap scheduler
            out += ["--disable-overlap-schedule"]
        out += ["--max-running-requests", str(batch),
                "--context-length", str(int(pool.max_model_len)),
                "--mem-fraction-static", mem, "--kv-cache-dtype", kv]
        if pool.prefill_chunk:  # the prompt tokens one step takes
            out += ["--chunked-prefill-size", str(pool.prefill_chunk)]
        if pool.weights == "fp8":
            out += ["--quantization", "fp8"]
        if pool.role in ("prefill", "decode"):
            out += ["--disaggregation-mode", pool.role]
        return out
    # TensorRT-LLM: tp_size = tp x ep (expert tp = tp, ep_size = ep); the batch is per
    # attention data-parallel rank when attention runs data-parallel
    adp = trtllm_attention_dp(pool)
    ranks = (d.tp * d.ep if pool.dp_attention else d.ep) if adp else 1
    out = ["--tp_size", str(d.tp * d.ep), "--pp_size", str(d.pp)]
    if d.expert_ep > 1:  # its MoE tp = tp_size / ep_size
        out += ["--ep_size", str(d.expert_ep)]
    out += ["--max_batch_size", str(max(batch // ranks, 1)),
            "--max_seq_len", str(int(pool.max_model_len)),
            "--kv_cache_free_gpu_memory_fraction", mem]
    if pool.token_budget:  # tokens of one step, per attention data-parallel rank
        out += ["--max_num_tokens", str(max(pool.token_budget // ranks, max(batch // ranks, 1)))]
    return out


def trtllm_attention_dp(pool: LaunchPool) -> bool:
    """TensorRT-LLM runs attention data-parallel (``enable_attention_dp``): the
    dp-attention mode, or tp = 1 with ep > 1 (attention over the ep ranks)."""
    d = pool.strategy.degrees
    return pool.dp_attention or (d.tp == 1 and d.ep > 1)


def no_script_reason(engine: str, pool: LaunchPool, gpus_per_node: int) -> str | None:
    """Why shardc writes no script for this pool on ``engine`` (None: it does). Every pool
    the engines' spaces hold is scripted today: TensorRT-LLM's disaggregated pools, FP8 and
    workers spanning nodes included (:mod:`shardc.backends.launch_trtllm`); kept as the one
    place a future engine's unscriptable pool would say why (plan.json ``note``)."""
    if engine not in SCRIPT_ENGINES:
        return f"{engine}: no checked flag list"
    return None


def gpus_per_instance(engine: str, pool: LaunchPool) -> int:
    """GPUs one instance occupies, by the engine's own arithmetic of :func:`engine_flags`."""
    d = pool.strategy.degrees
    if engine == "vllm":
        return d.tp * d.pp * d.ep  # tensor x pipeline x data-parallel (= ep) ranks
    return d.tp * d.ep * d.pp


def pool_entry(engine: str, pool: LaunchPool, script: str | None) -> dict:
    """plan.json ``launch.<engine>.pools[]`` of one pool."""
    d = pool.strategy.degrees
    out = {"role": pool.role, "workers": int(d.dp), "gpus_per_worker": int(d.replica_gpus),
           "degrees": d.as_dict(), "batch": int(pool.strategy.batch),
           "mode": "dp-attention" if pool.dp_attention else "tp",
           "flags": engine_flags(engine, pool), "script": script}
    if engine == "trtllm":  # LLM API options, written to the --extra_llm_api_options YAML
        out["llm_api_options"] = llm_api_options(pool.role, pool.kv_cache, pool.max_model_len,
                                                 trtllm_attention_dp(pool))
        if pool.weights == "fp8":  # no serve flag quantizes: a pre-quantized checkpoint
            out["checkpoint"] = "fp8 (pre-quantized, ModelOpt hf_quant_config.json)"
    return out


# ------------------------------------------------------------------ rendering
def _describe(entry: dict) -> str:
    d = entry["degrees"]
    split = (f"moe_tp={d['moe_tp']} moe_ep={d['moe_ep']} " if "moe_tp" in d else "")
    return (f"tp={d['tp']} ep={d['ep']} pp={d['pp']} dp={d['dp']} sp={d.get('sp', 1)} "
            f"{split}batch={entry['batch']}" + (" attention data-parallel"
                                         if entry.get("mode") == "dp-attention" else ""))


def render_script(engine: str, entry: dict, launch: dict, model_id: str | None,
                  gpus_per_node: int) -> str:
    """The bash script of one engine for one pool (``entry``: plan.json's pool;
    ``launch``: plan.json's ``launch.<engine>``, for the predicted numbers)."""
    name = ENGINE_NAMES[engine]
    flags = list(entry["flags"])
    table = engine_flag_table()[engine]
    unknown = [f for f in flags if f.startswith("--") and f not in table["flags"]]
    assert not unknown, (engine, unknown)  # shardc's own bug: tests pin every flag
    per_worker, workers = int(entry["gpus_per_worker"]), int(entry["workers"])
    gpn = max(int(gpus_per_node), 1)
    nodes = -(-per_worker // gpn)
    pred = launch.get("predicted") or {}
    gap = launch.get("gap_vs_plan")
    lines = ["#!/usr/bin/env bash",
             f"# {name} launch script written by shardc: pool role {entry['role']}.",
             f"# Flags checked against {one_line(table['checked_against'])}.",
             f"# Pool: {workers} worker(s) x {per_worker} GPUs ({_describe(entry)}).",
             f"# Run once per worker: {shlex.quote('launch/' + script_name(engine, entry['role']))}"
             " WORKER (0 .. WORKERS-1); SHARDC_MODEL overrides the model id below."]
    if pred.get("tok_s_per_gpu") is not None:
        lines.append(f"# The best configuration {name} expresses (shardc's search in its space):"
                     f" predicted {pred['tok_s_per_gpu']:.1f} tok/s/GPU"
                     + ("" if gap is None else f", {100 * gap:+.1f}% vs the plan")
                     + (" (the plan itself)." if launch.get("same_as_plan") else "."))
    if entry["role"] in ("prefill", "decode"):
        lines.append("# Disaggregated: pair this pool with the "
                     + ("decode" if entry["role"] == "prefill" else "prefill") + " pool's script"
                     + (" behind a router that sends each request to both." if engine == "sglang"
                        else " through launch/trtllm_disagg.sh (trtllm-serve disaggregated; the"
                        " KV cache moves by its cache transceiver)." if engine == "trtllm"
                        else " through a proxy (the KV cache moves by the NIXL connector)."))
    trt_disagg = engine == "trtllm" and entry["role"] in ROLE_PORTS
    lines += ["set -euo pipefail", f"WORKERS={workers}", 'WORKER="${1:-0}"',
              'case "$WORKER" in ""|*[!0-9]*) echo "worker index must be a number" >&2; exit 2;; '
              "esac",
              'if [ "$WORKER" -ge "$WORKERS" ]; then echo "worker index must be below $WORKERS" '
              '>&2; exit 2; fi',
              f"DEFAULT_MODEL={shlex.quote(model_id or '')}"
              + ("" if model_id else "  # no model id recorded: compile with --hf-id, or set "
                                     "SHARDC_MODEL"),
              'MODEL="${SHARDC_MODEL:-$DEFAULT_MODEL}"',
              'if [ -z "$MODEL" ]; then echo "no model id: set SHARDC_MODEL to a hub id or path '
              '(or compile with --hf-id)" >&2; exit 2; fi',
              'case "$MODEL" in -*) echo "model id must not start with -" >&2; exit 2;; esac',
              f"PORT=$(({ROLE_PORTS[entry['role']] if trt_disagg else BASE_PORTS[engine]} "
              "+ WORKER))"]
    if engine == "trtllm" and entry.get("checkpoint"):
        lines += fp8_checkpoint_lines()
    per_node = gpn // per_worker if per_worker <= gpn else 1
    if per_worker < gpn and per_node > 1:  # several workers share a node: each its GPUs
        lines += [f"# {per_node} workers per node of {gpn} GPUs: worker WORKER uses GPUs "
                  f"(WORKER % {per_node}) x {per_worker} .. + {per_worker - 1} of its node.",
                  f"FIRST_GPU=$(( (WORKER % {per_node}) * {per_worker} ))",
                  'CUDA_VISIBLE_DEVICES="$(seq -s, "$FIRST_GPU" '
                  f'"$((FIRST_GPU + {per_worker - 1}))")"',
                  "export CUDA_VISIBLE_DEVICES"]
    if nodes > 1:
        lines.append(f"# One worker spans {nodes} nodes: "
                     + ("start a Ray cluster over them first (vLLM's multi-node executor)."
                        if engine == "vllm" else
                        "run this on each with NODE_RANK 0.." + str(nodes - 1)
                        + " and DIST_INIT_ADDR host:port of rank 0." if engine == "sglang" else
                        f"run this inside a Slurm allocation of {nodes} nodes: srun starts its "
                        f"{per_worker} ranks under trtllm-llmapi-launch."))
    served = engine == "trtllm" and (trt_disagg or nodes > 1)  # reached from other hosts
    if served:
        lines += ['HOST="${SHARDC_HOST:-0.0.0.0}"', HOST_CHECK]
    args = [f"{MODEL_FLAG[engine]}=\"$MODEL\""] if engine in MODEL_FLAG else []
    i = 0
    while i < len(flags):  # "--flag value" pairs and switches
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            args.append(f"{flags[i]} {shlex.quote(flags[i + 1])}")
            i += 2
        else:
            args.append(flags[i])
            i += 1
    if nodes > 1 and engine == "vllm":  # Ray places the ranks over the worker's nodes
        d = entry["degrees"]
        if d["tp"] * d["pp"] > gpn:
            args.append("--distributed-executor-backend ray")
        if d["ep"] > 1:
            args.append("--data-parallel-backend ray")
    elif nodes > 1 and engine == "sglang":
        args += [f"--nnodes {nodes}", '--node-rank "${NODE_RANK:?set NODE_RANK}"',
                 '--dist-init-addr "${DIST_INIT_ADDR:?set DIST_INIT_ADDR}"']
    options = entry.get("llm_api_options") or {}
    if options:  # fixed vocabulary (launch_trtllm.llm_api_options), one YAML line per key
        known = set(table.get("llm_api_options", ()))
        assert set(option_paths(options)) <= known, options
        lines += options_file_lines(options)
        args.append('--extra_llm_api_options "$EXTRA_OPTIONS"')
    if served:
        args.append('--host "$HOST"')
    args.append('--port "$PORT"')
    if engine not in MODEL_FLAG:  # a positional model after "--": never read as an option
        args += ["--", '"$MODEL"']
    launcher = []
    if engine == "trtllm" and nodes > 1:  # TensorRT-LLM's documented multi-node launch
        launcher = multi_node_prefix(nodes, per_worker, gpn)
        assert set(launcher_flags(launcher)) <= set(table["multi_node"]["flags"]), launcher
    lines.append("exec " + " ".join(launcher + COMMAND[engine]) + " \\")
    lines += [f"    {a} \\" for a in args[:-1]] + [f"    {args[-1]}", ""]
    return "\n".join(lines)


def script_name(engine: str, role: str) -> str:
    return f"{engine}_{role}.sh"


def launch_scripts(launch: dict, model_id: str | None, gpus_per_node: int) -> dict[str, object]:
    """``{"launch/<engine>_<role>.sh": writer}`` for every pool in plan.json ``launch`` with
    a ``script`` (none for an engine without pools), ready for
    :func:`shardc.backends.atomic.write_outputs`."""
    out: dict[str, object] = {}
    for engine in SCRIPT_ENGINES:
        entry = launch.get(engine) or {}
        scripted = {}
        for pool in entry.get("pools") or []:
            if not pool.get("script"):
                continue
            text = render_script(engine, pool, entry, model_id, gpus_per_node)
            out[f"launch/{script_name(engine, pool['role'])}"] = _executable(text)
            scripted[pool["role"]] = pool
        if engine == "trtllm" and {"prefill", "decode"} <= set(scripted):
            table = engine_flag_table()[engine]
            out[f"launch/{script_name(engine, 'disagg')}"] = _executable(router_script(
                scripted["prefill"], scripted["decode"], one_line(table["checked_against"])))
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
