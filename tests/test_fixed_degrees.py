"""``compile --degrees``: fix any subset of the degrees, search the rest (SPEC section 3)."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest

import shardc
from shardc.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY_MIXTRAL = str(ROOT / "examples" / "tiny_mixtral.py")
_LAYER = re.compile(r"^L(\d+) ")
_PARAM_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def test_deepseek_stage_lanes_hold_the_layers_plan_places(tmp_path, capsys):
    """The issue's command: trace.json's stage lanes hold exactly the layers whose
    parameters plan.json places on each stage."""
    out = tmp_path / "ds"
    rc = main(["compile", str(ROOT / "examples" / "deepseek_v3.py"), "--mesh", "8x4",
               "--degrees", "tp=1,ep=8,pp=4", "--search", "exact", "--quiet", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    plan = json.loads((out / "plan.json").read_text())
    assert {k: plan["degrees"][k] for k in ("tp", "ep", "pp")} == {"tp": 1, "ep": 8, "pp": 4}
    assert plan["search"]["fixed_degrees"] == {"tp": 1, "ep": 8, "pp": 4}
    lanes = defaultdict(set)
    for ev in json.loads((out / "trace.json").read_text())["traceEvents"]:
        m = _LAYER.match(ev.get("name", ""))
        if m and ev.get("ph") == "X":
            lanes[ev["tid"]].add(int(m.group(1)))
    placed = defaultdict(set)
    for p in plan["params"]:
        m = _PARAM_LAYER.search(p["fqn"])
        if m:
            placed[p["stage"]].add(int(m.group(1)))
    assert dict(lanes) == dict(placed)
    assert sorted(len(v) for v in placed.values()) == [15, 15, 15, 16]


@pytest.mark.parametrize("fixed, expect", [
    ("ep=2", {"ep": 2}),
    ("tp=2,pp=2", {"tp": 2, "pp": 2}),
    ("dp=2", {"dp": 2}),
])
def test_fixed_degrees_are_kept_and_the_rest_searched(fixed, expect):
    for policy in ("rl", "megatron"):
        plan = shardc.compile(TINY_MIXTRAL, mesh="8x1", search=policy, budget=400, seed=0,
                              degrees=fixed)
        assert {k: plan.degrees[k] for k in expect} == expect, (policy, plan.degrees)
        assert plan.baseline["megatron"]["degrees"] is not None
        assert {k: plan.baseline["megatron"]["degrees"][k] for k in expect} == expect
        d = plan.degrees
        assert d["tp"] * d["ep"] * d["pp"] * d["dp"] == 8


def test_unfixed_search_can_leave_the_fixed_value():
    """Fixing a degree changes the answer when the free optimum uses another value."""
    free = shardc.compile(TINY_MIXTRAL, mesh="8x1", search="exact", seed=0)
    other = 1 if free.degrees["tp"] != 1 else 2
    fixed = shardc.compile(TINY_MIXTRAL, mesh="8x1", search="exact", seed=0,
                           degrees={"tp": other})
    assert fixed.degrees["tp"] == other
    assert fixed.predicted["tok_s_per_gpu"] <= free.predicted["tok_s_per_gpu"] + 1e-9


@pytest.mark.parametrize("degrees, said", [
    ("tp=3", "tp=3: not possible here"),
    ("ep=16", "ep=16: not possible here"),
    ("dp=3", "dp=3: does not divide"),
    ("sp=3", "sp is 1 (off) or equal to tp (on)"),
    ("tp=2,tp=4", "given twice"),
    ("xp=2", "unknown degree"),
])
def test_impossible_fixed_degrees_are_bad_input(tmp_path, capsys, degrees, said):
    rc = main(["compile", TINY_MIXTRAL, "--mesh", "8x1", "--degrees", degrees, "--quiet",
               "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and said in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()
