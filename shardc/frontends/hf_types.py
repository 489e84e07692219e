"""A config.json's ``model_type`` when it names remote code.

Some public checkpoints (Kimi-K2: ``model_type: kimi_k2``) name a model type transformers
does not register -- their own modelling code ships beside the weights (``auto_map``) -- while
their ``architectures`` name a class transformers has (``DeepseekV3ForCausalLM``). shardc never
imports or runs a config's code (``auto_map`` / ``trust_remote_code`` are dropped), so such a
config is built from transformers' own class, with a note naming the substitution; a type with
no known class is one clear line (exit 2).
"""

from __future__ import annotations

from shardc.errors import InputError
from shardc.text import one_line


def known_model_type(data: dict, where: str) -> tuple[dict, str | None]:
    """(config data to build, note or None). ``data['model_type']`` unknown to transformers
    and an ``architectures`` entry that is a transformers causal-LM class: the data with that
    class's model type and a note saying so. Unknown and no such class: :class:`InputError`."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = data.get("model_type")
    if not isinstance(model_type, str) or model_type in CONFIG_MAPPING_NAMES:
        return data, None
    archs = data.get("architectures")
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    for arch in archs:
        types = sorted(t for t, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if cls == arch)
        if types:
            note = (f"model_type {one_line(model_type)!r} is not a transformers model type "
                    f"(its remote code is never run); built as transformers' {arch} "
                    f"(model_type {types[0]!r}), the class its 'architectures' names")
            return {**data, "model_type": types[0]}, note
    named = f" and its architectures {[one_line(a) for a in archs]} name" if archs else \
        " and it names no"
    raise InputError(f"{where}: model_type {one_line(model_type)!r} is not a transformers model "
                     f"type{named} no transformers causal-LM class; shardc never runs a "
                     "config's remote code (auto_map)")


def checkpoint_format(data: dict) -> dict | None:
    """What a config.json's ``quantization_config`` says the checkpoint stores, as
    ``{"scheme": <words>, "weights": "fp8" | None}`` (None: no quantization_config).
    ``weights`` is the ``--weights`` format it sets by default: ``fp8`` for FP8 checkpoints
    (``quant_method`` ``fp8`` with or without ``weight_block_size``, ``fbgemm_fp8``,
    compressed-tensors float 8-bit weights); None for any other scheme (int4 GPTQ / AWQ,
    MXFP4, bitsandbytes ...), which shardc does not model: such a plan is priced as bf16 and
    says so."""
    q = data.get("quantization_config")
    if q is None and isinstance(data.get("text_config"), dict):
        q = data["text_config"].get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = one_line(q.get("quant_method") or "unnamed")
    if method == "fp8":
        fmt = one_line(q.get("fmt") or "e4m3")
        block = q.get("weight_block_size")
        if isinstance(block, (list, tuple)) and block:
            shape = "x".join(one_line(b) for b in block)
            return {"scheme": f"fp8 {fmt}, {shape} blocks", "weights": "fp8"}
        return {"scheme": f"fp8 {fmt}, per tensor", "weights": "fp8"}
    if method == "fbgemm_fp8":
        return {"scheme": "fp8, per channel (fbgemm_fp8)", "weights": "fp8"}
    if method == "compressed-tensors" and _float8_weights(q):
        return {"scheme": "fp8 (compressed-tensors)", "weights": "fp8"}
    bits = q.get("bits") or q.get("w_bit")
    detail = f", {one_line(bits)}-bit" if isinstance(bits, int) else ""
    return {"scheme": f"{method}{detail}", "weights": None}


def _float8_weights(q: dict) -> bool:
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return False
    for group in groups.values():
        w = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(w, dict) or w.get("num_bits") != 8 or w.get("type") != "float":
            return False
    return True
