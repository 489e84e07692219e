"""``shardc inspect`` on the tiny examples: table, filters, JSON keys, dot."""

from __future__ import annotations

import json

import pytest
from traced_examples import EXAMPLES

from shardc.cli import main


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_mixtral"])
def test_inspect_table(name, capsys):
    assert main(["inspect", str(EXAMPLES / f"{name}.py")]) == 0
    out = capsys.readouterr().out
    assert "node" in out and "fused op" in out and "placements" in out
    assert "qkv" in out and "lm_head" in out
    assert ("moe_block x2" if "mixtral" in name else "dense_block x2") in out


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_mixtral"])
def test_inspect_json_keys(name, capsys):
    assert main(["inspect", str(EXAMPLES / f"{name}.py"), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["model"]) == {"name", "params", "layers", "source"}
    assert doc["model"]["name"] == name and doc["model"]["layers"] == 2
    assert doc["layer_kinds"][0]["count"] == 2
    assert {"name", "op", "shape", "placements", "redistribute"} <= set(doc["nodes"][0])


def test_inspect_filters(capsys):
    assert main(["inspect", str(EXAMPLES / "tiny_mixtral.py"), "--layer", "1", "--op",
                 "grouped_matmul", "--format", "json"]) == 0
    nodes = json.loads(capsys.readouterr().out)["nodes"]
    assert len(nodes) == 2 and {n["layer"] for n in nodes} == {1}
    assert [n["fused_op"] for n in nodes] == ["expert_ffn1", "expert_ffn2"]
    assert main(["inspect", str(EXAMPLES / "tiny_llama.py"), "--op", "qkv"]) == 0
    assert capsys.readouterr().out.count(" qkv ") == 6


def test_inspect_dot(capsys):
    assert main(["inspect", str(EXAMPLES / "tiny_llama.py"), "--format", "dot", "--layer", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith('digraph "tiny_llama"') and "->" in out and out.rstrip().endswith("}")


def test_inspect_bad_input(capsys, tmp_path):
    assert main(["inspect", str(EXAMPLES / "tiny_llama.py"), "--layer", "9"]) == 2
    assert "no such decoder layer" in capsys.readouterr().err
    assert main(["inspect", str(EXAMPLES / "tiny_llama.py"), "--op", "convolution"]) == 2
    assert main(["inspect", str(tmp_path / "missing.py")]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "Traceback" not in err
