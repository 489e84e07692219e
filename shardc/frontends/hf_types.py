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
