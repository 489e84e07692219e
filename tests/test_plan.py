"""plan.json: build, atomic save, load with schema + consistency checks, emitted code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardc.errors import InputError
from shardc.ir.strategy import Degrees, Mesh, Strategy, Workload
from shardc.plan import build_plan, load_plan

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mixtral():
    from shardc.frontends import load_graph
    from shardc.frontends.model_file import load_model_file

    graph = load_graph(str(ROOT / "examples" / "tiny_mixtral.py"), tiny=True)
    model, _ = load_model_file(str(ROOT / "examples" / "tiny_mixtral.py")).build(tiny=True)
    return graph, model


def megatron(graph) -> dict:
    ch = {"embedding": 0, "lm_head": 0}
    for o, c in (("qkv", 0), ("attn_core", 0), ("out_proj", 1), ("router", 2),
                 ("expert_ffn1", 0), ("expert_ffn2", 1)):
        ch[f"moe_block.{o}"] = c
    return ch


def make_plan(graph, **deg):
    st = Strategy(Degrees(**deg), 8, megatron(graph))
    return build_plan(graph, st, Mesh(st.degrees.world, 1), "h100", Workload(batch=8),
                      predicted={"tok_s_per_gpu": 1.0}, baseline={}, search={"policy": "megatron"})


def test_roundtrip_and_contents(mixtral, tmp_path):
    graph, model = mixtral
    plan = make_plan(graph, tp=2, ep=2, pp=2)
    path = plan.save(tmp_path / "plan.json")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".plan-")]
    back = load_plan(path)
    assert back.to_dict() == json.loads(json.dumps(plan.to_dict()))
    d = back.to_dict()
    assert d["schema_version"] == 2
    assert d["logical_mesh"] == {"shape": [2, 2, 2], "dim_names": ["pp", "ep", "tp"]}
    assert d["spmd_dims"] == ["ep", "tp"]
    assert {n["name"] for n in d["nodes"]} == {n.name for n in graph.nodes}
    assert all(len(n["placements"]) == 2 for n in d["nodes"])
    ops = {o["name"]: o for o in d["ops"]}
    assert ops["moe_block.qkv"]["choice"] == "col"
    assert ops["moe_block.out_proj"]["placements"] == ["S(0)", "P(sum)"]
    assert back.strategy().choices == plan.strategy().choices
    # the plan's params are the model's parameters, by FQN, with the runtime's local shapes
    params = {p["fqn"]: p for p in d["params"]}
    assert set(params) == {n for n, _ in model.named_parameters()}
    gu = params["model.layers.1.mlp.experts.gate_up_proj"]
    assert gu["placements"] == ["S(0)", "S(1)"] and gu["local_shape"] == [2, 128, 64]
    assert gu["stage"] == 1 and params["model.embed_tokens.weight"]["stage"] == 0


def test_refuses_other_schema_versions(mixtral, tmp_path):
    d = make_plan(mixtral[0], tp=2).to_dict()
    d["schema_version"] = 3
    (tmp_path / "p.json").write_text(json.dumps(d))
    with pytest.raises(InputError, match="schema_version 3 is not supported"):
        load_plan(tmp_path / "p.json")


@pytest.mark.parametrize("edit,match", [
    (lambda d: d["degrees"].update(tp=4), "degrees tp\\*pp\\*ep\\*dp = 4"),
    (lambda d: d["ops"][1].update(choice="diagonal"), "unknown choice 'diagonal'"),
    (lambda d: d["nodes"][3].update(placements=["S(x)"]), "nodes/3/placements/0"),
    (lambda d: d["logical_mesh"].update(shape=[4]), "logical_mesh"),
    (lambda d: d.pop("ops"), "'ops' is a required property"),
])
def test_detects_hand_edited_plans(mixtral, tmp_path, edit, match):
    d = make_plan(mixtral[0], tp=2).to_dict()
    edit(d)
    (tmp_path / "p.json").write_text(json.dumps(d))
    with pytest.raises(InputError, match=match):
        load_plan(tmp_path / "p.json")


def test_unreadable_plan(tmp_path):
    (tmp_path / "p.json").write_text("{not json")
    with pytest.raises(InputError, match="not a readable JSON plan"):
        load_plan(tmp_path / "p.json")
    with pytest.raises(InputError, match="no such plan file"):
        load_plan(tmp_path / "missing.json")


def test_emitted_code_is_ruff_clean_and_readable(mixtral, tmp_path):
    code = make_plan(mixtral[0], tp=2, ep=2, sp=2).code()
    path = tmp_path / "parallelize.py"
    path.write_text(code)
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(path)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout
    assert "def parallelize(model, world_mesh=None):" in code
    assert "init_device_mesh(device, MESH_SHAPE, mesh_dim_names=MESH_DIM_NAMES)" in code
    assert "MESH_DIM_NAMES = ('ep', 'tp')" in code
    assert "for i in LAYER_KINDS['moe_block']:" in code
    assert "ExpertParallel(tp_split=True, token_rows=True)" in code  # experts col/row under sp
    assert "dispatch + combine over ep=2" in code


def test_verify_reports_mismatch_in_one_line(mixtral, tmp_path, monkeypatch, capsys):
    from shardc.backends import verify as harness
    from shardc.cli import main

    make_plan(mixtral[0], tp=2, ep=2, dp=2).save(tmp_path / "plan.json")
    monkeypatch.setattr(harness, "run_cases",
                        lambda *a, **k: [{"name": "plan", "rel_err": 0.25, "error": None}])
    rc = main(["verify", str(ROOT / "examples" / "tiny_mixtral.py"), "--plan",
               str(tmp_path / "plan.json"), "--world", "4"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 1
    assert out[0].startswith("scaled the plan's degrees") and "dp 2->1" in out[0]
    assert out[-1].startswith("verify MISMATCH") and "0.25 > 0.0001" in out[-1]


# shardc verify's scaled run of a big-mesh plan: tests/test_backend_gloo.py (same launch)


def test_verify_refuses_a_plan_made_for_another_layer_structure(mixtral, tmp_path, capsys):
    """A Mixtral (MoE) plan checked against tiny Llama (dense layers): exit 2, one line."""
    from shardc.cli import main

    make_plan(mixtral[0], tp=2).save(tmp_path / "plan.json")
    rc = main(["verify", str(ROOT / "examples" / "tiny_llama.py"), "--plan",
               str(tmp_path / "plan.json"), "--world", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "plan layer kinds ['moe_block'] do not match the tiny model's layers" in err[0]
