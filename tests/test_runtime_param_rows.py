"""The first runtime (:class:`shardc.backends.apply.ModelSharder`, the fallback
``parallelize.py``) places parameters as plan.json's ``params`` rows say -- the IR's fused op,
split dims and stage -- not from a parameter-name table:

* a row the test edits is followed even where the parameter's name says otherwise, and a
  parameter without a row is refused naming it (fake process group, no launch);
* the fallback file carries the rows (``PARAMS``), and a plan written before the IR fields
  (schema 1: rows without ``op``) emits the same ``PARAMS``.
"""

from __future__ import annotations

import pytest
from test_backend_fake import fake_world  # noqa: F401  (fixture)
from test_backend_gloo import DENSE, LLAMA
from test_runtime_styles import build
from torch.distributed.tensor import Replicate, Shard

Q0 = "model.layers.0.self_attn.q_proj.weight"
Q1 = "model.layers.1.self_attn.q_proj.weight"


def _sharded(rows, plan):
    from shardc.backends.apply import apply
    from shardc.backends.verify import _build

    model, _ = _build(LLAMA, 1, 1)
    apply(model, plan.strategy(), layer_kinds=plan.layer_kind_map(), params=rows)
    return dict(model.named_parameters())


def test_first_runtime_places_parameters_as_their_rows_say(fake_world):  # noqa: F811
    fake_world(2)
    plan = build(LLAMA, {"tp": 2}, DENSE)
    rows = [dict(r) for r in plan.params]
    q0 = next(r for r in rows if r["fqn"] == Q0)
    q0.update(op=None, split_dims=[None, None])  # the row: no op reads it
    params = _sharded(rows, plan)
    assert tuple(params[Q0].placements) == (Replicate(),)  # its name reads as a q projection
    assert tuple(params[Q1].placements) == (Shard(0),)
    assert params[Q1].to_local().shape[0] == params[Q1].shape[0] // 2


def test_a_parameter_without_a_row_is_refused_naming_it(fake_world):  # noqa: F811
    fake_world(2)
    plan = build(LLAMA, {"tp": 2}, DENSE)
    rows = [r for r in plan.params if r["fqn"] != Q1]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_proj\.weight"):
        _sharded(rows, plan)


def test_fallback_file_carries_the_rows_also_for_a_plan_without_ir_fields():
    import types

    # tiny Llama: 8 heads over 4 KV heads; a heads split at tp=8 replicates each KV head,
    # which only the first runtime deploys
    plan = build(LLAMA, {"tp": 8}, DENSE)
    src = plan.code()
    assert "ModelSharder(model, strategy, world_mesh, LAYER_KINDS, PARAMS)" in src
    mod = types.ModuleType("fallback_parallelize")
    exec(compile(src, "<parallelize.py>", "exec"), mod.__dict__)  # noqa: S102
    by_fqn = {r["fqn"]: r for r in mod.PARAMS}
    assert set(by_fqn) == {r["fqn"] for r in plan.params}
    assert by_fqn[Q0] == {"fqn": Q0, "stage": 0, "op": "qkv", "layer": 0, "split_dims": [0, 1]}
    for r in plan.params:
        for key in ("op", "layer", "split_dims", "expert_dim", "parts", "tied"):
            r.pop(key, None)
    assert plan.code() == src
