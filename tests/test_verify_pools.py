"""``shardc verify`` of a disaggregated plan (issue 21) checks every pool and says which: the
prefill and decode pools of a ``--phase serve --mode disagg`` plan have their own degrees
and per-op choices (plan.json ``serving.pools``), each is run on the gloo ranks as its own
``parallelize_<role>.py`` would shard the model. Before: only the top-level (decode) pool
was run and the line did not say so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardc.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny_llama.py")


@pytest.fixture(scope="module")
def disagg_plan(tmp_path_factory) -> Path:
    """tiny Llama on 4 GPUs, serve, disaggregated, tp=2: a prefill pool (sp=2, replicated
    weights, attention split by batch) and a decode pool (Megatron's col / heads / row)."""
    out = tmp_path_factory.mktemp("disagg")
    assert main(["compile", TINY, "--mesh", "4x1", "--phase", "serve", "--mode", "disagg",
                 "--degrees", "tp=2", "--search", "megatron", "--budget", "20", "--quiet",
                 "--out", str(out)]) == 0
    pools = json.loads((out / "plan.json").read_text())["serving"]["pools"]
    assert [p["role"] for p in pools] == ["prefill", "decode"]
    assert pools[0]["ops"] != pools[1]["ops"]  # two different plans to check
    return out / "plan.json"


def test_verify_runs_every_pool_and_names_each(disagg_plan, capsys, monkeypatch):
    import shardc.backends.verify as harness

    ran = []
    real = harness.run_cases

    def recording(model, cases, world, **kw):
        ran.append([c.name for c in cases])
        return real(model, cases, world, **kw)

    monkeypatch.setattr(harness, "run_cases", recording)
    assert main(["verify", TINY, "--plan", str(disagg_plan), "--world", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert ran == [["prefill", "decode"]]  # one launch, both pools
    assert out[0].startswith("verify OK: prefill pool, tiny_llama on 2 gloo ranks (tp=2 pp=1 "
                             "ep=1 dp=1 sp=2): max relative error")
    assert out[1].startswith("verify OK: decode pool, tiny_llama on 2 gloo ranks (tp=2 pp=1 "
                             "ep=1 dp=1 sp=1): max relative error")
    assert out[-1] == ("checked every pool of the disaggregated plan (prefill, decode): "
                       "all match")


def test_a_failing_pool_is_named_and_fails_the_run(disagg_plan, capsys, monkeypatch):
    import shardc.backends.verify as harness

    def one_fails(model, cases, world, **kw):
        return [{"name": c.name, "rel_err": 1e-7,
                 "error": "RuntimeError: boom" if c.name == "prefill" else None}
                for c in cases]

    monkeypatch.setattr(harness, "run_cases", one_fails)
    assert main(["verify", TINY, "--plan", str(disagg_plan), "--world", "2"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("verify FAILED: prefill pool, ") and out[0].endswith("boom")
    assert out[1].startswith("verify OK: decode pool, ")
    assert out[-1].endswith("(prefill, decode): 1 of 2 failed")


def test_a_pool_op_edited_by_hand_is_refused(disagg_plan, tmp_path, capsys, monkeypatch):
    import shardc.backends.verify as harness

    monkeypatch.setattr(harness, "run_cases", lambda *a, **k: pytest.fail("ranks started"))
    doc = json.loads(disagg_plan.read_text())
    doc["serving"]["pools"][0]["ops"][1]["choice"] = "sideways"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    assert main(["verify", TINY, "--plan", str(path), "--world", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "serving: pool 'prefill': op 'dense_block.qkv' choice " \
        "'sideways' is not one of the plan's ops' choices" in err[0]
