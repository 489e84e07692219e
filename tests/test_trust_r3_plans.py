"""Trust round 3 (issue 25), plans belong to models: plan.json records its model's parameter
table (``model.fingerprint``); ``Plan.apply``, the emitted ``parallelize.py`` (default
and ``--standalone``) and ``shardc verify`` refuse another model naming the first difference, and a
hand-edited plan (row deleted or moved, ``"ops": []``, ``tp: 2.0``, a key twice) is refused
with one line. Each test failed on main before the fix."""

from __future__ import annotations

import copy
import inspect
import json
import sys
import types
from pathlib import Path

import pytest
import torch

import shardc
from shardc.cli import main
from shardc.errors import InputError
from shardc.fingerprint import fingerprint

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny_llama.py")
sys.path.insert(0, str(ROOT / "examples"))


@pytest.fixture(scope="module")
def plan():
    """tiny Llama on 2 GPUs, tp=2 (a plan that splits weights)."""
    return shardc.compile(TINY, mesh="2x1", search="megatron", budget=50, degrees="tp=2")


def _llama(layers: int = 2):
    import llama3_70b

    from shardc.frontends.hf_build import build_causal_lm

    cfg = llama3_70b.tiny_config()
    cfg.num_hidden_layers = layers
    return build_causal_lm(cfg, device="meta")


def _mixtral():
    import mixtral_8x7b

    return mixtral_8x7b.tiny_model()


def _one_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("shardc: ") and "Traceback" not in err
    return lines[0]


# ------------------------------------------------------------ 1. the plan records its model
def test_plan_json_records_the_parameter_table(plan):
    fp = plan.model["fingerprint"]
    assert fp == fingerprint(plan.params)
    patterns = {p for p, _, _ in fp["table"]}
    assert "model.layers.*.self_attn.q_proj.weight" in patterns
    assert sum(n for _, _, n in fp["table"]) == len(plan.params) == 21
    plan.check_model(_llama(2))  # the model it was made for: no error


@pytest.mark.parametrize("other, first", [
    (lambda: _mixtral(), "mlp.down_proj.weight (shape [64, 128]) is not in the model"),
    (lambda: _llama(3), "the model has 3, the plan 2"),
])
def test_apply_refuses_another_model_before_placing_anything(plan, other, first):
    model = other()
    with pytest.raises(InputError, match="the model does not match the plan") as e:
        plan.apply(model, device_mesh=object())  # never reaches the mesh
    assert first in str(e.value)
    assert not any(hasattr(p, "placements") for p in model.parameters())


@pytest.mark.parametrize("standalone", [False, True])
def test_emitted_parallelize_refuses_another_model(plan, standalone):
    module = types.ModuleType("generated")
    exec(compile(plan.code(standalone=standalone), "parallelize.py", "exec"),  # noqa: S102
         module.__dict__)
    # (the standalone file has its own copy of the check: a ValueError of its own class)
    with pytest.raises(ValueError, match="mlp.down_proj.weight"):
        module.parallelize(_mixtral(), object())


def test_a_plan_without_fingerprint_is_checked_against_its_rows(plan, tmp_path):
    d = copy.deepcopy(plan.to_dict())
    del d["model"]["fingerprint"]  # written before fingerprints, or removed by hand
    del d["params"][3]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    loaded = shardc.load_plan(path)
    with pytest.raises(InputError, match="v_proj.weight .* the model has 2, the plan 1"):
        loaded.check_model(_llama(2))


# ------------------------------------------------------------ 2. hand-edited plans
def _edits():
    def delete_row(d):
        del d["params"][3]

    def move_row(d):
        d["params"][3]["layer"] = 1

    def swap_op(d):
        d["params"][1]["op"] = "ffn1"

    def no_ops(d):
        d["ops"] = []

    def float_degree(d):
        d["degrees"]["tp"] = 2.0

    def shape(d):
        d["params"][1]["shape"] = [64, 65]

    def twice(d):
        d["params"].append(dict(d["params"][1]))

    return {"row deleted": (delete_row, "model.fingerprint"),
            "row moved to another layer": (move_row, "says layer 1"),
            "row given another op": (swap_op, "model.fingerprint"),
            "ops []": (no_ops, "ops: no entry for"),
            "degrees.tp 2.0": (float_degree, "degrees/tp"),
            "shape edited": (shape, "model.fingerprint"),
            "row listed twice": (twice, "listed twice")}


@pytest.mark.parametrize("edit", sorted(_edits()))
def test_a_hand_edited_plan_is_refused_with_one_line(plan, tmp_path, capsys, edit):
    change, expected = _edits()[edit]
    d = copy.deepcopy(plan.to_dict())
    change(d)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    with pytest.raises(InputError, match=expected):
        shardc.load_plan(path)
    assert main(["inspect", str(path)]) == 2
    assert expected.split()[0] in _one_line(capsys.readouterr().err)


def test_a_key_given_twice_is_refused(plan, tmp_path):
    text = json.dumps(plan.to_dict())
    text = text.replace('"degrees": {', '"degrees": {"tp": 1, ', 1)  # tp twice: last wins
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(InputError, match="duplicate key 'tp'"):
        shardc.load_plan(path)


@pytest.mark.parametrize("depth", [100, 100_000])
def test_deeply_nested_json_is_refused(tmp_path, depth):
    path = tmp_path / "plan.json"
    path.write_text("[" * depth + "]" * depth)
    with pytest.raises(InputError, match="nested"):
        shardc.load_plan(path)


# ------------------------------------------------------------ 3. verify
def test_verify_refuses_another_model_before_starting_ranks(plan, tmp_path, capsys, monkeypatch):
    import shardc.backends.verify as backend

    monkeypatch.setattr(backend, "run_cases", lambda *a, **k: pytest.fail("ranks started"))
    path = tmp_path / "plan.json"
    plan.save(path)
    qwen3 = str(ROOT / "examples" / "configs" / "qwen3_8b" / "config.json")
    assert main(["verify", qwen3, "--plan", str(path), "--world", "2"]) == 2  # printed OK
    line = _one_line(capsys.readouterr().err)
    assert "does not match the plan" in line and "self_attn.k_norm.weight" in line


def test_verify_compares_the_plans_own_rows(plan, tmp_path, capsys, monkeypatch):
    """A row's op edited (fingerprint removed too, so loading cannot tell): verify compares the
    plan's rows with the tiny model's roles and names the row."""
    import shardc.backends.verify as backend

    monkeypatch.setattr(backend, "run_cases", lambda *a, **k: pytest.fail("ranks started"))
    d = copy.deepcopy(plan.to_dict())
    del d["model"]["fingerprint"]
    row = next(r for r in d["params"] if r["fqn"].endswith("layers.0.self_attn.k_proj.weight"))
    row["op"] = "out_proj"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    assert main(["verify", TINY, "--plan", str(path), "--world", "2"]) == 2
    assert "k_proj.weight (out_proj)" in _one_line(capsys.readouterr().err)


def test_parallelize_still_runs_the_model_it_was_made_for(plan):
    """The check lets the right model through: the emitted file shards tiny Llama (1 rank)."""
    import torch.distributed as dist

    from shardc.testing.launch import free_port

    one = shardc.compile(TINY, mesh="1x1", search="megatron", budget=20)
    if not dist.is_initialized():
        import os

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        import llama3_70b

        model = llama3_70b.tiny_model()
        ids = llama3_70b.tiny_inputs()[0]
        with torch.no_grad():
            ref = model(ids).logits
            copy_ = llama3_70b.tiny_model()
            copy_.load_state_dict(model.state_dict())
            out = one.apply(copy_)(ids)
        out = getattr(out, "logits", out)
        assert torch.allclose(getattr(out, "full_tensor", lambda: out)(), ref, atol=1e-5)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------ 4. every split parameter was split
class KeepsWeight(torch.nn.Linear):
    """A Linear whose class keeps its own weight: a style's ``register_parameter`` of the
    sharded weight is ignored (as a quantised or frozen layer class may do). Names and shapes
    are a plain Linear's, so the model passes the fingerprint and the weight stays whole."""

    def register_parameter(self, name, param):
        if self._parameters.get(name) is not None:
            return
        super().register_parameter(name, param)


def _keeps_down_proj():
    import llama3_70b

    model = llama3_70b.tiny_model()
    model.model.layers[1].mlp.down_proj.__class__ = KeepsWeight
    return model


@pytest.fixture
def fake_world_of_two():
    """Rank 0 of 2 on torch's ``fake`` process group (placement only, no peers)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


LEFT_WHOLE = r"model\.layers\.1\.mlp\.down_proj\.weight was left whole \(local shape " \
             r"\[64, 128\] on this rank; the plan's params row says \[64, 64\]"


def test_apply_refuses_a_model_that_keeps_a_split_weight_whole(plan, fake_world_of_two):
    plan.apply(_llama_real())  # the plain model: placed as the plan says, no error
    with pytest.raises(InputError, match=LEFT_WHOLE):
        plan.apply(_keeps_down_proj())


@pytest.mark.parametrize("standalone", [False, True])
def test_emitted_parallelize_refuses_a_weight_left_whole(plan, standalone, fake_world_of_two):
    module = types.ModuleType("generated")
    exec(compile(plan.code(standalone=standalone), "parallelize.py", "exec"),  # noqa: S102
         module.__dict__)
    module.parallelize(_llama_real())
    with pytest.raises(ValueError, match=LEFT_WHOLE):
        module.parallelize(_keeps_down_proj())


def _llama_real():
    import llama3_70b

    return llama3_70b.tiny_model()


def test_verify_refuses_a_weight_left_whole_with_exit_2(plan, tmp_path, capsys):
    """Two gloo ranks run the plan's file on a model file whose class keeps one weight: exit
    2 naming it (was: the ranks failed inside DTensor, or a silently partial placement)."""
    model_file = tmp_path / "keeps_weight.py"
    model_file.write_text(f"import sys\n\nimport torch\n\n"
                          f"sys.path.insert(0, {str(ROOT / 'examples')!r})\n"
                          "import llama3_70b  # noqa: E402\n\n\n"
                          + inspect.getsource(KeepsWeight) + "\n\n"
                          + inspect.getsource(_keeps_down_proj) + "\n\n"
                          "def build_model():\n    return _keeps_down_proj()\n\n\n"
                          "def example_inputs():\n    return llama3_70b.tiny_inputs()\n\n\n"
                          "tiny_model, tiny_inputs = build_model, example_inputs\n")
    path = tmp_path / "plan.json"
    plan.save(path)
    assert main(["verify", str(model_file), "--plan", str(path), "--world", "2"]) == 2
    out = capsys.readouterr()
    assert "verify OK" not in out.out
    line = _one_line(out.err)
    assert "model.layers.1.mlp.down_proj.weight was left whole" in line
