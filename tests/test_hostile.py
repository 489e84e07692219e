"""A hostile suite (issue 25): generated bad inputs of every kind -- config shape fields at
0, -1, huge and of the wrong type; model names with ``-``, quotes, ``$()``, control
characters, surrogates; symlinked and special output paths; hand-edited plan.json; SIGTERM
at random moments. Every case must exit 0, 2 or 3 (143 for a signal) with at most one stderr
line, write nothing outside ``--out``, and never leave a mixed output set. Cheap by design:
in-process calls, tiny models, a small seeded sample of signal timings."""

from __future__ import annotations

import copy
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import shardc
from shardc.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny_llama.py")
CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
          "vocab_size": 256, "max_position_embeddings": 8192}
MOE = {**CONFIG, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "num_hidden_layers", "vocab_size",
                "max_position_embeddings", "head_dim")
MOE_FIELDS = ("num_local_experts", "num_experts_per_tok")
BAD_VALUES = (0, -1, 10**12, "8", 2.5, True, [4], {"a": 1})
# a compile's complete set (decode, one pool): nothing more, nothing less
FULL_SET = {"plan.json", "graph.txt", "graph.dot", "trace.json", "search.png",
            "parallelize.py", "launch", "launch/vllm_mixed.sh", "launch/sglang_mixed.sh"}


def _files(folder: Path, skip: Path | None = None) -> dict[str, bytes | None]:
    """Every entry under ``folder`` (outside ``skip``) -> its bytes (None for folders)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if skip is not None and (p == skip or skip in p.parents):
            continue
        out[str(p.relative_to(folder))] = None if p.is_dir() or p.is_symlink() or not \
            p.is_file() else p.read_bytes()
    return out


def _assert_sane(code: int, err: str, work: Path, out: Path, before: dict,
                 codes=(0, 2, 3)) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code in codes, err
    assert len(lines) <= 1, err
    assert "Traceback" not in err
    assert _files(work, skip=out) == before, "something was written outside --out"
    assert not list(work.rglob("PWNED*"))
    if os.path.isdir(out) and not os.path.islink(out):
        names = {str(p.relative_to(out)) for p in out.rglob("*")}
        assert not [n for n in names if ".shardc-tmp" in n]
        plan = out / "plan.json"  # ours (not a user's link): all of a compile's outputs or none
        if plan.is_file() and not plan.is_symlink():
            assert FULL_SET <= names, sorted(names)


def _compile_cli(capsys, work: Path, model: str, out: Path, *extra) -> tuple[int, str]:
    code = main(["compile", model, "--mesh", "2x1", "--search", "megatron", "--budget", "10",
                 "--quiet", "--out", str(out), *extra])
    return code, capsys.readouterr().err


# ------------------------------------------------------------ configs
def _config_cases():
    cases = [(CONFIG, f, v) for f in SHAPE_FIELDS for v in BAD_VALUES]
    cases += [(MOE, f, v) for f in MOE_FIELDS for v in BAD_VALUES]
    return cases


@pytest.mark.parametrize("base, field, value", _config_cases(),
                         ids=[f"{f}={v!r}"[:40] for _, f, v in _config_cases()])
def test_hostile_config_fields(tmp_path, capsys, base, field, value):
    work = tmp_path
    (work / "model").mkdir()
    path = work / "model" / "config.json"
    path.write_text(json.dumps({**base, field: value}))
    out = work / "o"
    before = _files(work, skip=out)
    code, err = _compile_cli(capsys, work, str(path), out)
    _assert_sane(code, err, work, out, before)
    assert code == 2 and field in err  # every one of these values is bad: the field named


# ------------------------------------------------------------ names
NAMES = ["-rf", "--trust-remote-code", "a\"b'c\\", "$(touch PWNED)", "`touch PWNED2`",
         "a\x00b\x1b[31m\nfake", "\ud800x", "x\u202ey\u2028z", "../../PWNED3", ";touch PWNED4"]


@pytest.mark.parametrize("name", random.Random(25).sample(NAMES, 4))
def test_hostile_model_names(tmp_path, capsys, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    path = tmp_path / "model" / "config.json"
    path.write_text(json.dumps({**CONFIG, "_name_or_path": name}))
    out = tmp_path / "o"
    before = _files(tmp_path, skip=out)
    code, err = _compile_cli(capsys, tmp_path, str(path), out)
    _assert_sane(code, err, tmp_path, out, before)
    assert code == 0, err
    compile((out / "parallelize.py").read_text(), "parallelize.py", "exec")  # still Python
    for script in (out / "launch").iterdir():
        subprocess.run(["bash", "-n", str(script)], check=True)  # still a shell script


# ------------------------------------------------------------ output paths
def _out_cases():
    def symlinked_launch(w):
        (w / "elsewhere").mkdir()
        (w / "o").mkdir()
        os.symlink(w / "elsewhere", w / "o" / "launch")
        return ["--out", str(w / "o")]

    def symlinked_plan(w):
        (w / "o").mkdir()
        (w / "victim").write_text("keep")
        os.symlink(w / "victim", w / "o" / "plan.json")
        return ["--out", str(w / "o")]

    def fifo_entry(w):
        (w / "o").mkdir()
        os.mkfifo(w / "o" / "graph.txt")
        return ["--out", str(w / "o")]

    def out_is_a_file(w):
        (w / "o").write_text("a file")
        return ["--out", str(w / "o")]

    def out_below_a_file(w):
        (w / "f").write_text("a file")
        return ["--out", str(w / "f" / "o")]

    def dot_dot(w):
        return ["--out", str(w / "o" / "zz1" / ".." / "zz2")]

    return {"symlinked launch": symlinked_launch, "symlinked plan.json": symlinked_plan,
            "fifo entry": fifo_entry, "out is a file": out_is_a_file,
            "out below a file": out_below_a_file, "a/../b": dot_dot}


@pytest.mark.parametrize("case", sorted(_out_cases()))
def test_hostile_output_folders(tmp_path, capsys, case):
    argv = _out_cases()[case](tmp_path)
    out = Path(argv[1])
    before = _files(tmp_path, skip=tmp_path / "o")
    code = main(["compile", TINY, "--mesh", "2x1", "--search", "megatron", "--budget", "10",
                 "--quiet", *argv])
    err = capsys.readouterr().err
    _assert_sane(code, err, tmp_path, tmp_path / "o", before)
    if case == "a/../b":
        assert code == 0 and sorted(p.name for p in (tmp_path / "o").iterdir()) == ["zz2"]
    else:
        assert code == 2
        assert not (out.is_dir() and (out / "parallelize.py").exists())


@pytest.mark.parametrize("target", ["fifo", "symlink", "folder", "dev"])
@pytest.mark.parametrize("command", ["simulate", "inspect"])
def test_hostile_single_file_outputs(tmp_path, capsys, target, command):
    path = tmp_path / "x.json"
    if target == "fifo":
        os.mkfifo(path)
    elif target == "symlink":
        os.symlink("/proc/self/fd/1", path)
    elif target == "folder":
        path.mkdir()
    else:
        path = Path("/dev/null")
    before = _files(tmp_path)
    flag = "--json" if command == "simulate" else "--out"
    argv = [command, TINY, flag, str(path)]
    argv += ["--mesh", "2x1", "--degrees", "tp=2"] if command == "simulate" else []
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert _files(tmp_path) == before
    assert Path("/dev/null").is_char_device()


# ------------------------------------------------------------ plan.json edits
@pytest.fixture(scope="module")
def plan_dict():
    return shardc.compile(TINY, mesh="2x1", search="megatron", budget=10,
                          degrees="tp=2").to_dict()


def _plan_edits(d: dict, rng: random.Random):
    """A seeded sample of edits: drop / move / retype a row or a value, duplicate keys."""
    edits = []
    for _ in range(12):
        e = copy.deepcopy(d)
        kind = rng.choice(["drop_row", "move_row", "op", "shape", "value", "drop_key",
                           "ops_empty", "float"])
        if kind == "drop_row":
            del e["params"][rng.randrange(len(e["params"]))]
        elif kind == "move_row":
            r = e["params"][rng.randrange(1, len(e["params"]) - 2)]
            r["layer"] = 1 - (r["layer"] or 0)
        elif kind == "op":
            rng.choice(e["params"])["op"] = rng.choice(["ffn1", "qkv", "lm_head", None])
        elif kind == "shape":
            rng.choice(e["params"])["shape"][0] += 1
        elif kind == "value":
            section = rng.choice(["degrees", "mesh", "workload", "model"])
            key = rng.choice(sorted(e[section]))
            e[section][key] = rng.choice(["x", -1, None, [1], 1e300, 2**70])
        elif kind == "drop_key":
            del e[rng.choice(sorted(e))]
        elif kind == "ops_empty":
            e["ops"] = []
        else:
            e["degrees"]["tp"] = 2.0
        edits.append(json.dumps(e))
    text = json.dumps(d)
    edits.append(text.replace('"degrees": {', '"degrees": {"tp": 1, ', 1))  # a key twice
    edits.append("[" * 200_000 + "]" * 200_000)
    return edits


def test_hostile_plan_edits(plan_dict, tmp_path, capsys):
    for i, text in enumerate(_plan_edits(plan_dict, random.Random(25))):
        path = tmp_path / f"plan{i}.json"
        path.write_text(text)
        before = _files(tmp_path)
        code = main(["inspect", str(path)])
        captured = capsys.readouterr()
        assert code in (0, 2), (i, captured.err)
        assert len(captured.err.strip().splitlines()) <= 1, (i, captured.err)
        assert _files(tmp_path) == before
        if code == 0:  # accepted: then the model check still holds for Plan.apply
            shardc.load_plan(path)


# ------------------------------------------------------------ SIGTERM at random moments
@pytest.mark.parametrize("delay", [round(random.Random(25 + i).uniform(0.5, 8.0), 2)
                                   for i in range(2)])
def test_sigterm_at_a_random_moment(tmp_path, delay):
    out = tmp_path / "o"
    proc = subprocess.Popen([sys.executable, "-m", "shardc.cli", "compile", TINY, "--mesh",
                             "2x1", "--search", "megatron", "--budget", "10", "--quiet",
                             "--out", str(out)], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    time.sleep(delay)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode in (0, 143, -signal.SIGTERM), err
    assert len(err.strip().splitlines()) <= 1, err
    finished = proc.returncode == 0 or "after the run had finished" in err
    if finished:  # the signal came after the set was published: the whole set, never part
        assert FULL_SET <= {str(p.relative_to(out)) for p in out.rglob("*")}
    else:
        assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] in ([], ["o"])  # no staging left
