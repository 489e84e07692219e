"""TensorRT-LLM's launch pieces beyond ``trtllm-serve serve`` flags (issue 21): the LLM API
options YAML, disaggregated pools, FP8 and workers spanning nodes, as TensorRT-LLM documents
them (the keys and flags are in ``engine_flags.json``'s ``trtllm`` entry, with their sources):

* **LLM API options** (``--extra_llm_api_options FILE``, ``tensorrt_llm/llmapi/llm_args.py``):
  ``enable_attention_dp``; ``kv_cache_config.dtype: fp8`` for an FP8 KV cache; a
  disaggregated pool's ``cache_transceiver_config`` (``backend: DEFAULT``,
  ``max_tokens_in_buffer``: the pool's max sequence length, at least the longest prompt as
  TensorRT-LLM recommends) and, for the context (prefill) servers,
  ``disable_overlap_scheduler: true`` (its disaggregated context servers do not support the
  overlap scheduler).
* **Disaggregated pools**: each prefill / decode worker is one ``trtllm-serve serve``
  context / generation server (worker ``w`` on port 8100 + w / 8200 + w), and
  ``launch/trtllm_disagg.sh`` starts the orchestrator, ``trtllm-serve disaggregated
  --config_file FILE``, whose YAML lists the servers' ``host:port`` URLs
  (``tensorrt_llm/llmapi/disagg_utils.py``: ``context_servers`` / ``generation_servers``
  with ``num_instances`` and ``urls``).
* **FP8 weights**: TensorRT-LLM has no serve flag that quantizes; it runs a pre-quantized
  (ModelOpt) checkpoint, recognised by its ``hf_quant_config.json`` (or a
  ``quantization_config`` in ``config.json``): the script refuses a local folder without one.
* **A worker spanning nodes**: ``srun -N nodes --ntasks gpus --ntasks-per-node=gpn
  --mpi=pmix trtllm-llmapi-launch trtllm-serve ...`` inside a Slurm allocation (TensorRT-LLM's
  "Multi-node Serving with Slurm").

Values written are shardc's own (validated numbers, fixed vocabulary); hosts given at run time
are checked by the script (letters, digits, ``.``, ``_``, ``-``; not starting with ``-``).
"""

from __future__ import annotations

import shlex

ROLE_PORTS = {"prefill": 8100, "decode": 8200}  # context / generation server w: base + w
ROUTER_PORT = 8000  # trtllm-serve disaggregated: where clients send requests
CACHE_BACKEND = "DEFAULT"  # cache_transceiver_config.backend: TensorRT-LLM's own choice
HOST_CHECK = ('case "$HOST" in ""|-*|*[!A-Za-z0-9._-]*) echo "SHARDC_HOST must be a host name '
              'or address" >&2; exit 2;; esac')


def llm_api_options(role: str, kv_cache: str, max_model_len: int, attention_dp: bool) -> dict:
    """The ``--extra_llm_api_options`` YAML of one pool (module docstring), nested."""
    out: dict = {}
    if attention_dp:
        out["enable_attention_dp"] = True
    if kv_cache == "fp8":
        out["kv_cache_config"] = {"dtype": "fp8"}
    if role in ("prefill", "decode"):
        out["cache_transceiver_config"] = {"backend": CACHE_BACKEND,
                                           "max_tokens_in_buffer": int(max_model_len)}
    if role == "prefill":
        out["disable_overlap_scheduler"] = True
    return out


def option_paths(options: dict, prefix: str = "") -> list[str]:
    """Dotted keys of ``options`` (``kv_cache_config.dtype``): what the checked list holds."""
    out = []
    for k, v in options.items():
        out += option_paths(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
    return out


def _scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str) and v in (CACHE_BACKEND, "fp8"):
        return v
    raise ValueError(f"LLM API option value {v!r} is not shardc's vocabulary")


def yaml_lines(options: dict, indent: int = 0) -> list[str]:
    """``options`` as YAML lines (two-space nesting; values: booleans, integers and fixed
    words only)."""
    out = []
    for k, v in sorted(options.items()):
        if isinstance(v, dict):
            out.append(" " * indent + f"{k}:")
            out += yaml_lines(v, indent + 2)
        else:
            out.append(" " * indent + f"{k}: {_scalar(v)}")
    return out


def options_file_lines(options: dict) -> list[str]:
    """Bash lines writing ``options`` to ``$EXTRA_OPTIONS`` (a temporary file)."""
    return ['EXTRA_OPTIONS="$(mktemp)"',
            "printf '%s\\n' " + " ".join(shlex.quote(line) for line in yaml_lines(options))
            + ' > "$EXTRA_OPTIONS"']


def fp8_checkpoint_lines() -> list[str]:
    """Header and check of a pool with FP8 weights: a local model folder must be a
    pre-quantized checkpoint (a hub id cannot be checked here; name an FP8 one)."""
    return ["# Weights fp8: TensorRT-LLM runs a pre-quantized FP8 checkpoint (ModelOpt: its "
            "hf_quant_config.json);",
            "# give one as SHARDC_MODEL (e.g. a hub id ending in -FP8, or a folder exported by "
            "ModelOpt).",
            'if [ -d "$MODEL" ] && [ ! -f "$MODEL/hf_quant_config.json" ] && ! grep -qs '
            "'\"quantization_config\"' \"$MODEL/config.json\"; then",
            '  echo "weights fp8: $MODEL is not a pre-quantized FP8 checkpoint (no '
            'hf_quant_config.json)" >&2; exit 2',
            "fi"]


def multi_node_prefix(nodes: int, gpus: int, gpus_per_node: int) -> list[str]:
    """The launcher tokens of a worker of ``gpus`` GPUs over ``nodes`` nodes."""
    return ["srun", "-N", str(int(nodes)), "--ntasks", str(int(gpus)),
            f"--ntasks-per-node={int(gpus_per_node)}", "--mpi=pmix", "trtllm-llmapi-launch"]


def launcher_flags(tokens: list[str]) -> list[str]:
    """The flags among launcher tokens (``--mpi=pmix`` -> ``--mpi``)."""
    return [t.split("=", 1)[0] for t in tokens if t.startswith("-")]


def router_script(prefill: dict, decode: dict, checked_against: str) -> str:
    """``launch/trtllm_disagg.sh``: ``trtllm-serve disaggregated`` over the context servers
    of ``prefill`` and the generation servers of ``decode`` (plan.json pool entries).
    ``PREFILL_HOSTS`` / ``DECODE_HOSTS``: the workers' hosts in worker order, space-separated
    (default: localhost for each); ``SHARDC_HOST``: the address it listens on."""
    pw, dw = int(prefill["workers"]), int(decode["workers"])
    lines = ["#!/usr/bin/env bash",
             "# TensorRT-LLM disaggregated serving, written by shardc: the orchestrator "
             "(trtllm-serve disaggregated).",
             f"# Flags checked against {checked_against}.",
             f"# First start the {pw} context server(s): launch/trtllm_prefill.sh W (port "
             f"{ROLE_PORTS['prefill']} + W),",
             f"# and the {dw} generation server(s): launch/trtllm_decode.sh W (port "
             f"{ROLE_PORTS['decode']} + W); then run this.",
             "# PREFILL_HOSTS / DECODE_HOSTS: the workers' hosts in worker order, "
             "space-separated (default localhost).",
             f"# Clients send requests to port {ROUTER_PORT} (OpenAI API).",
             "set -euo pipefail",
             'HOST="${SHARDC_HOST:-0.0.0.0}"', HOST_CHECK,
             f'PREFILL_HOSTS="${{PREFILL_HOSTS:-{" ".join(["localhost"] * pw)}}}"',
             f'DECODE_HOSTS="${{DECODE_HOSTS:-{" ".join(["localhost"] * dw)}}}"',
             "servers() {  # section, workers, base port, hosts",
             '  local i=0 h hosts',
             '  read -ra hosts <<< "$4"  # split on spaces, never globbed',
             '  printf \'%s\\n\' "$1:" "  num_instances: $2" "  urls:"',
             '  for h in "${hosts[@]}"; do',
             '    case "$h" in -*|*[!A-Za-z0-9._-]*) echo "bad host: $h" >&2; exit 2;; esac',
             '    printf \'    - "%s:%d"\\n\' "$h" "$(($3 + i))"',
             '    i=$((i + 1))',
             '  done',
             '  if [ "$i" -ne "$2" ]; then echo "$1: $2 hosts needed, $i given" >&2; exit 2; fi',
             "}",
             'CONFIG="$(mktemp)"',
             "{",
             '  printf \'%s\\n\' "hostname: $HOST" ' f"'port: {ROUTER_PORT}' 'backend: pytorch'",
             f'  servers context_servers {pw} {ROLE_PORTS["prefill"]} "$PREFILL_HOSTS"',
             f'  servers generation_servers {dw} {ROLE_PORTS["decode"]} "$DECODE_HOSTS"',
             '} > "$CONFIG"',
             'exec trtllm-serve disaggregated --config_file "$CONFIG"', ""]
    return "\n".join(lines)
