"""Trust round 3 (issue 25), outputs and signals: every write stays inside ``--out`` (no
write through a symlinked entry, no stray folder from ``a/../b``), single-file outputs never
replace a symlink / device / FIFO, the output set replaces the whole previous set, staging
left by a killed run is cleaned, and SIGTERM / SIGINT end the run with 143 / 130 and no
outputs even when a library catches the signal's exception. Each test failed on main before
the fix (one per defect class)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardc.backends.atomic import write_file_atomic, write_outputs
from shardc.cli import main
from shardc.commands.reports import COMPILE_OUTPUTS
from shardc.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny_llama.py")


def _one_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("shardc: ") and "Traceback" not in err
    return lines[0]


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# ------------------------------------------------------------ 1. symlinked entries under --out
@pytest.mark.parametrize("entry", ["launch", "launch/vllm_mixed.sh", "plan.json"])
def test_an_output_folder_with_a_symlinked_entry_is_refused(tmp_path, entry):
    out, elsewhere = tmp_path / "o", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "launch").mkdir(parents=True)
    target = elsewhere if entry == "launch" else elsewhere / "f"
    if entry == "launch":
        (out / "launch").rmdir()
    os.symlink(target, out / entry)
    with pytest.raises(InputError, match="is a symbolic link"):
        write_outputs(out, {"plan.json": "{}", "launch/vllm_mixed.sh": "echo hi"})
    assert _tree(elsewhere) == []  # nothing written through the link
    assert not [p for p in out.rglob(".shardc-tmp-*")]


def test_a_special_file_in_the_way_is_refused(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    os.mkfifo(out / "graph.txt")
    with pytest.raises(InputError, match="is not a regular file"):
        write_outputs(out, {"graph.txt": "x"})


def test_compile_into_a_folder_whose_launch_is_a_symlink_exits_2_and_writes_nothing(
        tmp_path, capsys):
    out, elsewhere = tmp_path / "o", tmp_path / "elsewhere"
    elsewhere.mkdir()
    out.mkdir()
    os.symlink(elsewhere, out / "launch")
    code = main(["compile", TINY, "--mesh", "4x1", "--degrees", "tp=4", "--search", "megatron",
                 "--quiet", "--out", str(out)])
    assert code == 2
    assert "launch is a symbolic link" in _one_line(capsys.readouterr().err)
    assert _tree(elsewhere) == [] and _tree(out) == ["launch"]


# ------------------------------------------------------------ 2. single-file outputs
def test_single_file_outputs_refuse_symlinks_fifos_and_folders(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("mine")
    os.symlink(real, tmp_path / "link.json")
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "dir.json").mkdir()
    for name, why in (("link.json", "symbolic link"), ("fifo.json", "not a regular file"),
                      ("dir.json", "is a folder")):
        with pytest.raises(InputError, match=why):
            write_file_atomic(tmp_path / name, "new", f"--json {name}")
    assert real.read_text() == "mine" and os.path.islink(tmp_path / "link.json")
    assert write_file_atomic(tmp_path / "real.json", "new", "x").read_text() == "new"
    assert write_file_atomic(tmp_path / "new.json", "n", "x").read_text() == "n"


@pytest.mark.parametrize("argv", [
    ["simulate", TINY, "--mesh", "4x1", "--degrees", "tp=4", "--json", "{p}"],
    ["inspect", TINY, "--out", "{p}"],
])
def test_cli_single_file_output_to_a_symlink_exits_2_before_any_work(tmp_path, capsys, argv):
    link = tmp_path / "mystdout"
    os.symlink("/proc/self/fd/1", link)
    code = main([a.replace("{p}", str(link)) for a in argv])
    captured = capsys.readouterr()
    assert code == 2 and "symbolic link" in _one_line(captured.err)
    assert captured.out == ""  # refused before the work, not after printing it
    assert os.path.islink(link)


def test_plan_save_refuses_a_symlink(tmp_path):
    import shardc

    plan = shardc.compile(TINY, mesh="2x1", search="megatron", budget=50)
    target = tmp_path / "target.json"
    target.write_text("mine")
    os.symlink(target, tmp_path / "plan.json")
    with pytest.raises(InputError, match="symbolic link"):
        plan.save(tmp_path / "plan.json")
    assert target.read_text() == "mine"


def test_plan_save_creates_no_missing_folder(tmp_path):
    """Plan.save (and every single-file output) writes into an existing folder only: a
    missing one is an error naming it, and nothing is created (was: made with parents)."""
    import shardc

    plan = shardc.compile(TINY, mesh="1x1", search="megatron", budget=10)
    with pytest.raises(InputError, match=r"Plan.save .*: the folder .*/no/such does not "
                                         r"exist \(single-file outputs create no folders"):
        plan.save(tmp_path / "no" / "such" / "plan.json")
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="the folder .*file is not a folder"):
        write_file_atomic(tmp_path / "file" / "out.json", "{}", "--json file/out.json")
    assert _tree(tmp_path) == ["file"]
    plan.save(tmp_path / "plan.json")  # an existing folder: written
    assert _tree(tmp_path) == ["file", "plan.json"]


# ------------------------------------------------------------ 3. the set replaces the set
def test_a_new_set_removes_the_previous_sets_other_outputs_and_keeps_the_users(tmp_path):
    out = tmp_path / "o"
    write_outputs(out, {"plan.json": "old", "parallelize_prefill.py": "p", "pareto.png": "x",
                        "launch/vllm_prefill.sh": "s", "launch/vllm_decode.sh": "s"},
                  owned=COMPILE_OUTPUTS)
    (out / "notes.md").write_text("mine")
    (out / "launch" / "my_own.sh").write_text("mine")
    write_outputs(out, {"plan.json": "new", "parallelize.py": "q",
                        "launch/vllm_mixed.sh": "s"}, owned=COMPILE_OUTPUTS)
    assert _tree(out) == ["launch", "launch/my_own.sh", "launch/vllm_mixed.sh", "notes.md",
                          "parallelize.py", "plan.json"]


def test_a_failed_write_puts_back_the_files_it_would_have_removed(tmp_path):
    out = tmp_path / "o"
    write_outputs(out, {"plan.json": "old", "pareto.png": "x"}, owned=COMPILE_OUTPUTS)

    def boom(path):
        raise RuntimeError("producer failed")

    with pytest.raises(RuntimeError):
        write_outputs(out, {"plan.json": "new", "search.png": boom}, owned=COMPILE_OUTPUTS)
    assert {p: (out / p).read_text() for p in _tree(out)} == {"pareto.png": "x",
                                                               "plan.json": "old"}


def test_a_bench_rerun_replaces_its_set_and_creates_no_stray_folder(tmp_path, capsys):
    """``shardc bench`` writes its tables as one set, as compile does: a re-run whose rows
    JSON goes elsewhere removes the earlier run's ``zoo.json`` beside the new tables (was: a
    stale JSON next to them), keeps other suites' and the user's files, and ``--out a/../b``
    creates no ``a`` (was: made before the run)."""
    argv = ["bench", "--suite", "zoo", "--cases", "mixtral-8x7b 8x1 decode", "--seeds", "1",
            "--budget", "1", "--policies", "megatron", "--out", str(tmp_path / "a" / ".." / "o")]
    assert main(argv) == 0
    out = tmp_path / "o"
    assert _tree(tmp_path) == ["o", "o/zoo.json", "o/zoo.md", "o/zoo_search.png"]
    (out / "paper.md").write_text("another suite's table")
    (out / "notes.txt").write_text("mine")
    assert main(argv + ["--json", str(tmp_path / "rows.json")]) == 0
    assert _tree(out) == ["notes.txt", "paper.md", "zoo.md", "zoo_search.png"]
    assert json.loads((tmp_path / "rows.json").read_text())["rows"]
    capsys.readouterr()


# ------------------------------------------------------------ 4. stray folders, leftovers
def test_dot_dot_in_out_creates_no_stray_folder(tmp_path):
    write_outputs(tmp_path / "o" / "zz1" / ".." / "zz2", {"plan.json": "{}"})
    assert _tree(tmp_path) == ["o", "o/zz2", "o/zz2/plan.json"]


def test_a_failed_run_leaves_no_stray_folder(tmp_path):
    def boom(path):
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        write_outputs(tmp_path / "a" / "b" / ".." / "c", {"plan.json": boom})
    assert _tree(tmp_path) == []


def test_staging_left_by_a_killed_run_is_cleaned_at_the_next_run(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    out = tmp_path / "o"
    out.mkdir()
    (out / f".shardc-tmp-{dead}-abc").mkdir()  # inside an existing folder
    (tmp_path / f".shardc-tmp-{dead}-o-xyz").mkdir()  # beside a new one
    (tmp_path / f".shardc-tmp-{dead}-other-xyz").mkdir()  # another output's: not ours
    (tmp_path / f".shardc-tmp-{os.getpid()}-o-live").mkdir()  # a live process's: kept
    write_outputs(out, {"plan.json": "{}"})
    assert _tree(out) == ["plan.json"]
    assert {p.name for p in tmp_path.iterdir()} == {
        f".shardc-tmp-{dead}-other-xyz", f".shardc-tmp-{os.getpid()}-o-live", "o"}


def test_the_previous_outputs_are_mentioned_only_when_there_were_some(tmp_path):
    def disk_full(path):
        raise OSError(28, "No space left on device")

    with pytest.raises(InputError, match="No space left") as e:  # a new folder: none
        write_outputs(tmp_path / "o", {"plan.json": disk_full})
    assert "previous outputs" not in str(e.value)
    write_outputs(tmp_path / "o", {"plan.json": "{}"})
    with pytest.raises(InputError, match="the previous outputs were left as they were"):
        write_outputs(tmp_path / "o", {"plan.json": disk_full})


# ------------------------------------------------------------ 5. signals
_SWALLOWING_RUN = """
import os, signal, sys, time
import shardc.commands.compile as c
from shardc.cli import main

real = c._plot
def plot(path, outcome, plan):
    try:  # a library's `except Exception` (or bare `except:`) around an optional import
        os.kill(os.getpid(), signal.{sig})
        time.sleep(5)
    except BaseException:
        pass
    return real(path, outcome, plan)

c._plot = plot
sys.exit(main(["compile", {tiny!r}, "--mesh", "2x1", "--search", "megatron", "--quiet",
               "--out", {out!r}]))
"""


@pytest.mark.parametrize("sig, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_swallowed_by_a_library_still_ends_the_run_without_outputs(tmp_path, sig,
                                                                            code):
    out = tmp_path / "o"
    script = _SWALLOWING_RUN.format(sig=sig, tiny=TINY, out=str(out))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == code, proc.stderr
    assert sig in _one_line(proc.stderr)
    assert not out.exists() and _tree(tmp_path) == []


def test_sigint_during_a_write_exits_130_and_rolls_back(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "plan.json").write_text("old")
    script = f"""
import os, signal, sys
from shardc.commands.reports import write_outputs
def killed(path):
    os.kill(os.getpid(), signal.SIGINT)
try:
    write_outputs({str(out)!r}, {{"plan.json": "new", "trace.json": killed}})
except KeyboardInterrupt:
    sys.exit(130)
sys.exit(0)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 130, proc.stderr
    assert json.dumps(_tree(out)) == '["plan.json"]' and (out / "plan.json").read_text() == "old"
