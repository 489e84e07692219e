"""Linear-attention / Mamba cores (``attn_core`` with ``attrs["recurrent"]``): what they hold.

A recurrent core (Gated DeltaNet, Mamba; :func:`shardc.passes.layers` builds it from the
``causal_conv`` and ``recurrent_scan`` nodes) keeps no KV cache: per sequence it holds a
constant state, ``attrs["state_elems_per_sequence"]`` = recurrent state (Gated DeltaNet:
value heads x key dim x value dim; Mamba: channels x state size) + conv state (conv channels
x (kernel - 1)), per layer, whatever the context. It is split with the heads under a heads
split and with the sequences under a batch split, exactly as a KV cache is. It is not held
in the KV cache format (an fp8 KV cache does not make it fp8): the conv state is held in
the model's activation dtype, the recurrent (SSM) state in the dtype the engine holds it in
(:func:`ssm_state_bytes`, the rule per engine as data in :data:`SSM_STATE_DTYPE`):

* vLLM: ``--mamba-ssm-cache-dtype auto`` is the model's dtype, except for Nemotron-H, whose
  per-model config hook takes the HF config's ``mamba_ssm_cache_dtype`` and float32 when it
  has none ("only float32 is known to have no accuracy issues");
* SGLang: ``--mamba-ssm-dtype`` defaults to float32 for every model;
* TensorRT-LLM: ``mamba_ssm_cache_dtype: auto`` is the HF config's ``mamba_ssm_cache_dtype``
  when it names one, else the model's dtype.

The frontend records the two config facts the rule reads (``model_type``,
``mamba_ssm_cache_dtype``) in ``graph.config``; shardc's own runtime (``dtensor``) follows
vLLM's rule.
"""

from __future__ import annotations


def is_recurrent(attrs: dict | None) -> bool:
    """Whether an ``attn_core``'s attrs describe a recurrent (linear-attention / Mamba) core."""
    return bool((attrs or {}).get("recurrent"))


def state_elems_per_sequence(attrs: dict | None) -> int:
    """Recurrent + conv state elements one sequence holds in one such layer (0 otherwise)."""
    a = attrs or {}
    return int(a.get("state_elems_per_sequence", 0) or 0) if is_recurrent(a) else 0


DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2}

# engine -> (its default: "model" = the activation dtype, "config" = the HF config's
# ``mamba_ssm_cache_dtype`` when it names one, else the model's; or a dtype name), and the
# model types whose own rule differs: {model_type: ("config", fallback dtype)}
SSM_STATE_DTYPE = {
    "vllm": {"default": "model", "models": {"nemotron_h": ("config", "float32")}},
    "sglang": {"default": "float32", "models": {}},
    "trtllm": {"default": "config", "models": {}},
}
SSM_STATE_DTYPE["dtensor"] = SSM_STATE_DTYPE["vllm"]


def ssm_state_bytes(engine: str, config: dict, act_bytes: float) -> float:
    """Bytes per element of the recurrent (SSM) state ``engine`` holds for a model whose
    ``graph.config`` is ``config`` (module docstring; an engine not listed: the activation
    dtype ``act_bytes``)."""
    rule = SSM_STATE_DTYPE.get(str(engine), {"default": "model", "models": {}})
    named = DTYPE_BYTES.get(str(config.get("mamba_ssm_cache_dtype") or "").lower())
    how, fallback = rule["models"].get(str(config.get("model_type") or ""),
                                       (rule["default"], None))
    if how == "config":
        return float(named or DTYPE_BYTES.get(fallback or "", act_bytes))
    if how == "model":
        return float(act_bytes)
    return float(DTYPE_BYTES[how])


def state_bytes_per_sequence(attrs: dict | None, act_bytes: float, ssm_bytes: float) -> float:
    """Bytes one sequence holds in one recurrent layer: the recurrent state at ``ssm_bytes``
    per element, the conv state at ``act_bytes`` (0 for another layer). A core whose attrs
    do not split the two (an older graph) holds all of it at ``act_bytes``."""
    a = attrs or {}
    if not is_recurrent(a):
        return 0.0
    if "recurrent_state_elems" not in a:
        return float(state_elems_per_sequence(a)) * act_bytes
    return (float(a.get("recurrent_state_elems", 0) or 0) * ssm_bytes
            + float(a.get("conv_state_elems", 0) or 0) * act_bytes)
