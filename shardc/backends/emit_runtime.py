"""The fast-runtime part of the torch-style ``parallelize.py``: the plan's walks as data
(``WALKS``, :func:`shardc.backends.runtime_walks.plan_walks`), the predicted TPOT (``PREDICTED``), and
``generate(model, input_ids, max_new_tokens, ...)`` plus the ``--bench`` entry
(:mod:`shardc.runtime.generate`, :mod:`shardc.runtime.bench`). Plan values enter the code
only through ``_literal`` (``repr`` of plain data)."""

from __future__ import annotations

import math

from shardc.backends.emit_text import _literal
from shardc.backends.runtime_walks import plan_walks

# the runtime names the tail below calls (imported from shardc.runtime, or inlined)
TAIL_NAMES = ("FastModel", "bench_main", "fast_generate")

_TAIL = '''

def generate(model, input_ids, max_new_tokens, attention_mask=None, world_mesh=None,
             **options):
    """``input_ids [batch, prompt]`` (left padded per ``attention_mask``) and
    ``max_new_tokens`` more, greedy (``temperature=0``, the default) or sampled
    (``temperature``, ``top_k``, ``seed``), on the fast runtime: ``model`` as
    ``parallelize`` returned it, the decode step on local shards with the plan's
    collectives and the runtime's own KV cache. Every rank calls it with the same batch and
    gets the same ``[batch, prompt + max_new_tokens]`` ids."""
    fast = getattr(model, "_shardc_fast", None)
    if fast is None:
        mesh = world_mesh or getattr(model, "shardc_world_mesh", None)
        if mesh is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            mesh = init_device_mesh(device, MESH_SHAPE, mesh_dim_names=MESH_DIM_NAMES)
        fast = FastModel(model, mesh, WALKS, LAYER_KINDS)
        model._shardc_fast = fast
    return fast_generate(fast, input_ids, max_new_tokens, attention_mask=attention_mask,
                         **options)


if __name__ == "__main__":  # --bench: see the module docstring
    bench_main(None, parallelize, WALKS, LAYER_KINDS, MESH_SHAPE, MESH_DIM_NAMES, PREDICTED)
'''


def runtime_data(plan) -> str:
    """``WALKS = {...}`` and ``PREDICTED`` (the plan's TPOT, ms, at its global batch and
    context) of ``plan`` (plain literals)."""
    choices = {str(o["name"]): str(o["choice"]) for o in plan.ops}
    walks = plan_walks(choices, plan.strategy().degrees)
    pred, wl = plan.predicted or {}, plan.workload or {}
    tpot, ttft = (_finite(pred.get(k)) for k in ("tpot_ms", "ttft_ms"))
    st = plan.strategy()
    at = {"batch": int(st.batch) * int(st.degrees.dp), "context": int(wl.get("context") or 0),
          "prompt": int(wl.get("prompt") or 0)}
    # tpot / ttft: finite floats (or None) checked by _finite, so their repr is a literal
    return (f"WALKS = {_literal(walks)}\n"
            f"PREDICTED = {{'tpot_ms': {tpot!r}, 'ttft_ms': {ttft!r}, 'batch': {at['batch']}, "
            f"'context': {at['context']}, 'prompt': {at['prompt']}}}  # the plan's step, at its "
            "global batch")


def _finite(x) -> float | None:
    return round(float(x), 4) if isinstance(x, (int, float)) and math.isfinite(x) else None


def runtime_tail() -> str:
    """``generate`` and the ``--bench`` entry (the file's last lines)."""
    return _TAIL
