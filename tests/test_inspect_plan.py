"""`shardc inspect` on annotated plan.json dumps and the strategy-space size report."""

from __future__ import annotations

import json
from pathlib import Path

from shardc.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY_LLAMA = str(ROOT / "examples" / "tiny_llama.py")


def test_space_size_on_a_mesh_matches_hand_count(capsys):
    assert main(["inspect", TINY_LLAMA, "--mesh", "8x1", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    space = doc["space"]
    # tiny Llama: hidden 64, 2 layers; on 8 GPUs tp in {1,2,4,8}, ep {1}, pp {1,2}, sp {off,
    # on}, 44 batch sizes, and 7 op slots of 3 choices each.
    assert space["degrees"]["tp"] == [1, 2, 4, 8]
    assert space["degrees"]["pp"] == [1, 2]
    assert len(space["op_slots"]) == 7
    assert space["configurations"] == 4 * 1 * 2 * 2 * 44 * 3**7
    assert 0 < space["legal_configurations"] <= space["configurations"]


def test_inspect_reads_an_annotated_plan(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["compile", str(ROOT / "examples" / "tiny_mixtral.py"), "--mesh", "4x1",
                 "--search", "megatron", "--batch", "16", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out / "plan.json"), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    plan = json.loads((out / "plan.json").read_text())
    assert doc["model"]["name"] == "tiny_mixtral"
    assert doc["model"]["params"] == plan["model"]["params"]
    assert [n["placements"] for n in doc["nodes"]] == [n["placements"] for n in plan["nodes"]]
    # the layer filter works on a dump too
    assert main(["inspect", str(out / "plan.json"), "--layer", "1", "--op", "linear"]) == 0
    table = capsys.readouterr().out
    assert "qkv" in table and "out_proj" in table
