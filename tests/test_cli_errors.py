"""Every bad input answers with one line on stderr, exit 2 (bad input) or 3 (infeasible).

See docs/errors.md for the list; each case here is one row of it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardc.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny_llama.py")


def run_cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, err


def assert_one_line(err: str):
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err


@pytest.mark.parametrize("mesh", ["8x", "0x4", "8x-1", "axb", "8*128", "", "8x0"])
def test_malformed_mesh_strings_exit_2(capsys, mesh):
    code, err = run_cli(capsys, "compile", TINY, "--mesh", mesh)
    assert code == 2
    assert_one_line(err)
    assert "GxN" in err


def test_missing_model_file(capsys, tmp_path):
    code, err = run_cli(capsys, "compile", str(tmp_path / "nope.py"), "--mesh", "8x1")
    assert code == 2
    assert_one_line(err)
    assert "nope.py" in err


def test_model_file_without_build_model(capsys, tmp_path):
    f = tmp_path / "empty_model.py"
    f.write_text("x = 1\n")
    code, err = run_cli(capsys, "compile", str(f), "--mesh", "8x1")
    assert code == 2
    assert_one_line(err)
    assert "build_model" in err


def test_model_raising_while_building_shows_its_message_and_line(capsys, tmp_path):
    f = tmp_path / "bad_model.py"
    f.write_text("def build_model():\n    raise ValueError('kaboom in my model')\n"
                 "def example_inputs():\n    return ()\n")
    code, err = run_cli(capsys, "compile", str(f), "--mesh", "8x1")
    assert code == 2
    assert_one_line(err)
    assert "kaboom in my model" in err
    assert "bad_model.py:2" in err


def test_unknown_hardware(capsys):
    code, err = run_cli(capsys, "compile", TINY, "--mesh", "8x1", "--hardware", "tpu9")
    assert code == 2
    assert_one_line(err)
    assert "tpu9" in err


def test_malformed_hardware_toml(capsys, tmp_path):
    f = tmp_path / "hw.toml"
    f.write_text("this is = = not toml\n")
    code, err = run_cli(capsys, "compile", TINY, "--mesh", "8x1", "--hardware", str(f))
    assert code == 2
    assert_one_line(err)
    assert "hw.toml" in err


def test_unknown_search_policy_and_bad_budget(capsys):
    with pytest.raises(SystemExit) as e:
        main(["compile", TINY, "--mesh", "8x1", "--search", "magic"])
    assert e.value.code == 2
    capsys.readouterr()
    code, err = run_cli(capsys, "compile", TINY, "--mesh", "8x1", "--budget", "0")
    assert code == 2
    assert_one_line(err)


def test_bad_batch_value(capsys):
    code, err = run_cli(capsys, "compile", TINY, "--mesh", "8x1", "--batch", "many")
    assert code == 2
    assert_one_line(err)
    assert "--batch" in err


def test_model_too_big_for_mesh_exits_3_and_says_what_is_short(capsys, tmp_path):
    """A GPU whose HBM holds a fraction of tiny Llama: the same path as a 70B model on one
    H100, without tracing 70B parameters in a unit test."""
    hw = tmp_path / "small_hbm.toml"
    hw.write_text('base = "h100"\nname = "h100-small-hbm"\nhbm_gb = 0.0002\nworkspace_gb = 0.0\n')
    code, err = run_cli(capsys, "compile", TINY, "--mesh", "1x1", "--hardware", str(hw),
                        "--search", "megatron", "--budget", "50", "--out", str(tmp_path / "o"))
    assert code == 3
    assert_one_line(err)
    assert "needs >= " in err and "GPUs to hold weights + KV cache; mesh has 1" in err
    assert not (tmp_path / "o").exists()


def test_slo_no_strategy_meets_exits_3(capsys, tmp_path):
    code, err = run_cli(capsys, "compile", TINY, "--mesh", "8x1", "--tpot-slo", "0.000001",
                        "--search", "megatron", "--budget", "50", "--out", str(tmp_path / "o"))
    assert code == 3
    assert_one_line(err)
    assert not (tmp_path / "o" / "plan.json").exists()


def test_plan_from_another_schema_version_is_refused(capsys, tmp_path):
    f = tmp_path / "plan.json"
    f.write_text(json.dumps({"schema_version": 99}))
    code, err = run_cli(capsys, "inspect", str(f))
    assert code == 2
    assert_one_line(err)
    assert "schema_version" in err


def test_corrupt_json_plan(capsys, tmp_path):
    f = tmp_path / "plan.json"
    f.write_text("{not json")
    code, err = run_cli(capsys, "inspect", str(f))
    assert code == 2
    assert_one_line(err)


def test_corrupt_onnx_file(capsys, tmp_path):
    f = tmp_path / "model.onnx"
    f.write_bytes(b"\x00\x01garbage")
    code, err = run_cli(capsys, "inspect", str(f))
    assert code == 2
    assert_one_line(err)


def test_no_traceback_from_a_real_process(tmp_path):
    """The installed console script answers a bad mesh with one line and exit 2."""
    proc = subprocess.run([sys.executable, "-m", "shardc.cli", "compile", TINY, "--mesh", "axb"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_out_folder_that_cannot_be_written_exits_2(capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    code, err = run_cli(capsys, "compile", TINY, "--mesh", "4x1", "--search", "megatron",
                        "--budget", "50", "--out", str(blocker / "out"))
    assert code == 2
    assert_one_line(err)
    assert "cannot write outputs there" in err and str(blocker / "out") in err
    assert blocker.read_text() == "not a folder"


def test_negative_seed_is_bad_input(capsys, tmp_path):
    code, err = run_cli(capsys, "compile", TINY, "--mesh", "4x1", "--seed", "-1",
                        "--out", str(tmp_path / "o"))
    assert code == 2
    assert_one_line(err)
    assert "--seed -1: expected a non-negative integer" in err
    assert not (tmp_path / "o").exists()


def test_a_command_runs_under_the_clis_gc_thresholds_and_main_restores_them(monkeypatch):
    import gc

    import shardc.cli as cli

    seen = []
    monkeypatch.setattr(cli, "_run", lambda args: seen.append(gc.get_threshold()) or 0)
    before = gc.get_threshold()
    assert cli.main(["compile", TINY, "--mesh", "8x1"]) == 0
    assert seen == [cli.GC_THRESHOLDS] and gc.get_threshold() == before != cli.GC_THRESHOLDS
