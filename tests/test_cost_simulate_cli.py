"""`shardc simulate`: table, --json keys, exit codes (graph loading stubbed by a fixture)."""

import json

import pytest
from cost_graphs import fixture_graph

import shardc.api
from shardc.cli import main


@pytest.fixture(autouse=True)
def fixture_loader(monkeypatch):
    monkeypatch.setattr(shardc.api, "load_model_graph",
                        lambda model, *a, **k: fixture_graph(model))


def test_simulate_prints_breakdown_and_writes_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    rc = main(["simulate", "gpt_moe_1p6t", "--mesh", "8x128", "--degrees", "tp=8,ep=16,pp=8",
               "--context", "16384", "--batch", "512", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "expert_ffn1" in text and "all_to_all" in text and "tok/s/GPU" in text
    doc = json.loads(out.read_text())
    assert {"model", "degrees", "predicted"} <= set(doc)
    assert doc["degrees"] == {"tp": 8, "ep": 16, "pp": 8, "dp": 1, "sp": 1}
    p = doc["predicted"]
    assert {"tok_s_per_gpu", "tpot_ms", "ttft_ms", "memory_gb_per_gpu", "breakdown"} <= set(p)
    assert p["tok_s_per_gpu"] > 0 and p["tpot_ms"] <= 50


def test_simulate_choice_override_changes_collectives(capsys):
    rc = main(["simulate", "llama3_70b", "--mesh", "8x1", "--degrees", "tp=8", "--batch", "64",
               "--choices", "megatron,dense_block.ffn2=col"])
    assert rc == 0
    assert "all_gather" in capsys.readouterr().out


def test_simulate_too_small_mesh_exits_3(capsys):
    rc = main(["simulate", "gpt_moe_1p6t", "--mesh", "8x1", "--degrees", "tp=8",
               "--context", "16384"])
    assert rc == 3
    assert "needs >= 47 GPUs to hold weights + KV cache; mesh has 8" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--degrees", "tp=3"], ["--degrees", "tp=8,dp=3"],
                                  ["--degrees", "tp=8", "--choices", "megatron,nope.qkv=col"],
                                  ["--degrees", "tp=8", "--choices", "dense_block.qkv=diagonal"]])
def test_simulate_bad_input_exits_2(args, capsys):
    assert main(["simulate", "llama3_70b", "--mesh", "8x1", *args]) == 2
    assert capsys.readouterr().err.count("\n") == 1
