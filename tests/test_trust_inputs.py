"""Bad input answers with one line and exit 2 (3 when infeasible), and leaves nothing
half-written: NaN/infinity, huge integers, huge meshes, binary files, presets shadowed by
files, hand-edited plans, duplicate degrees, multi-line messages, interrupted writes.
Each class of defect has its own test below (several instances each); docs/errors.md lists
the messages.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardc.cli import main
from shardc.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny_llama.py")


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def assert_one_line(err: str):
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("shardc: ") and "Traceback" not in err


@pytest.fixture(scope="module")
def plan_dict():
    """A real plan.json of tiny Llama on 4 GPUs (tp=2, dp=2: two SPMD mesh dims), as a dict."""
    from shardc.api import load_model_graph
    from shardc.ir.space import StrategySpace, megatron_op_choices
    from shardc.ir.strategy import Degrees, Mesh, Strategy, Workload
    from shardc.plan import build_plan

    graph, mesh, workload = load_model_graph(TINY), Mesh.parse("4x1"), Workload()
    space = StrategySpace(graph, mesh, workload)
    choices = megatron_op_choices(space, space.values["tp"].index(2))
    strategy = Strategy(Degrees(tp=2, dp=2), 8,
                        {s: int(c) for s, c in zip(space.op_slots, choices)})
    plan = build_plan(graph, strategy, mesh, "h100", workload)
    assert plan.spmd_dims == ["dp", "tp"]
    return json.loads(json.dumps(plan.to_dict()))


# --------------------------------------------------------------- 1. NaN / infinity
@pytest.mark.parametrize("argv", [
    ["compile", TINY, "--mesh", "4x1", "--tpot-slo", "nan"],
    ["compile", TINY, "--mesh", "4x1", "--ttft-slo", "inf"],
    ["compile", TINY, "--mesh", "4x1", "--tpot-slo=-inf"],
    ["simulate", TINY, "--mesh", "4x1", "--degrees", "tp=2", "--ttft-slo", "NaN"],
])
def test_nan_and_infinite_flags_are_bad_input(capsys, tmp_path, argv):
    code, err = run_cli(capsys, *argv, "--out" if argv[0] == "compile" else "--json",
                        tmp_path / "o")
    assert code == 2
    assert_one_line(err)
    assert "expected a finite number" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("field", ["hbm_tb_s = nan", "nic_gb_s = inf", "hbm_gb = -80.0",
                                   "peak_bf16_tflops = 0.0", "gemm_eff = nan"])
def test_nan_infinite_or_non_positive_hardware_fields_are_bad_input(capsys, tmp_path, field):
    hw = tmp_path / "hw.toml"
    hw.write_text(f'base = "h100"\n{field}\n')
    code, err = run_cli(capsys, "compile", TINY, "--mesh", "4x1", "--hardware", hw,
                        "--out", tmp_path / "o")
    assert code == 2
    assert_one_line(err)
    assert field.split()[0] in err and "hw.toml" in err


@pytest.mark.parametrize("raw", ['"tpot_ms": NaN', '"tpot_ms": Infinity', '"tpot_ms": 1e999'])
def test_nan_in_a_plan_is_bad_input_and_never_written(capsys, tmp_path, plan_dict, raw):
    d = dict(plan_dict, predicted={"tok_s_per_gpu": 1.0, "tpot_ms": 0.0})
    text = json.dumps(d).replace('"tpot_ms": 0.0', raw)
    (tmp_path / "plan.json").write_text(text)
    code, err = run_cli(capsys, "inspect", tmp_path / "plan.json")
    assert code == 2
    assert_one_line(err)
    # and shardc never writes one: saving a NaN is an error, not a non-JSON file
    from shardc.plan import load_plan

    plan = load_plan(_write(tmp_path / "ok.json", plan_dict))
    plan.predicted["tpot_ms"] = float("nan")
    with pytest.raises(ValueError):
        plan.save(tmp_path / "nan.json")
    assert not (tmp_path / "nan.json").exists()


# --------------------------------------------------------------- 2. one line
def test_multi_line_messages_print_as_one_line(capsys, monkeypatch, tmp_path):
    import shardc.commands.inspect as inspect_cmd

    def raise_multiline(args):
        raise InputError("config.json: HF cannot read this config:\n  field a: bad\n  field b: bad")

    monkeypatch.setattr(inspect_cmd, "run", raise_multiline)
    monkeypatch.delenv("SHARDC_DEBUG", raising=False)
    code, err = run_cli(capsys, "inspect", TINY)
    assert code == 2
    assert_one_line(err)
    assert "HF cannot read this config:" in err and "SHARDC_DEBUG=1" in err

    def crash(args):
        raise RuntimeError("worker 1 failed:\nTraceback (most recent call last):\n  File x")

    monkeypatch.setattr(inspect_cmd, "run", crash)
    code, err = run_cli(capsys, "inspect", TINY)
    assert code == 1
    assert_one_line(err)
    assert "internal error: RuntimeError: worker 1 failed:" in err

    monkeypatch.setattr(inspect_cmd, "run", raise_multiline)
    monkeypatch.setenv("SHARDC_DEBUG", "1")
    code, err = run_cli(capsys, "inspect", TINY)
    assert code == 2 and "field b: bad" in err  # the whole text when debugging


def test_torch_export_output_does_not_leak_to_stderr(capsys, tmp_path, monkeypatch):
    """torch.export prints the partial graph of a failed export to stderr itself."""
    monkeypatch.setenv("SHARDC_NO_CACHE", "1")
    monkeypatch.delenv("SHARDC_DEBUG", raising=False)
    f = tmp_path / "untraceable.py"
    f.write_text(textwrap.dedent("""
        import torch

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = torch.nn.Embedding(100, 16)

            def forward(self, x):
                h = self.emb(x)
                n = int(torch.nonzero(x).shape[0])  # data-dependent: export cannot trace it
                return h[:, :n]

        def build_model():
            return M()

        def example_inputs():
            return (torch.randint(0, 100, (1, 8)),)
    """))
    code, err = run_cli(capsys, "inspect", f)
    assert code == 2
    assert_one_line(err)
    assert "torch.export failed" in err


# --------------------------------------------------------------- 3. huge meshes
@pytest.mark.parametrize("mesh", ["8x10000000", "100000000x1", "2048x1024",
                                  "8x" + "9" * 5000])
def test_meshes_beyond_the_gpu_bound_are_refused_at_parse_time(capsys, tmp_path, mesh):
    from shardc.ir.strategy import Mesh

    with pytest.raises(InputError, match="at most 1,048,576 GPUs"):
        Mesh.parse(mesh)
    with pytest.raises(InputError, match="1048576"):
        Mesh(8, 10_000_000)
    code, err = run_cli(capsys, "compile", TINY, "--mesh", mesh, "--out", tmp_path / "o")
    assert code == 2
    assert_one_line(err)
    assert "at most 1,048,576 GPUs" in err


def test_degree_enumeration_is_exact_and_prime_test_is_correct():
    from shardc.validate import divisors, is_prime

    for n in list(range(1, 300)) + [1_048_576, 1_048_573, 999_983 * 2]:
        if n < 300:
            assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
        assert divisors(n) == sorted(set(divisors(n))) and all(n % d == 0 for d in divisors(n))
    assert [p for p in range(60) if is_prime(p)] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31,
                                                     37, 41, 43, 47, 53, 59]
    assert is_prime(1_048_573) and divisors(1_048_573) == [1, 1_048_573]


# --------------------------------------------------------------- 4. presets by name
def test_preset_name_is_not_shadowed_by_a_file_or_folder_of_that_name(tmp_path, monkeypatch):
    from shardc.cost import load_hardware

    monkeypatch.chdir(tmp_path)
    (tmp_path / "h100").mkdir()
    (tmp_path / "h200").write_text("not toml at all = =\n")
    assert load_hardware("h100").name == "h100"
    assert load_hardware("h200").name == "h200"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "b200").write_text('base = "b200"\nname = "my-b200"\n')
    assert load_hardware("mine/b200").name == "my-b200"  # a path separator: a file
    with pytest.raises(InputError, match="unknown preset"):
        load_hardware("mine")


# --------------------------------------------------------------- 5. overflow, binary, unwritable
@pytest.mark.parametrize("flag,value", [("--batch", "99999999999999999999"),
                                        ("--batch", "1e20"),
                                        ("--context", "1" + "0" * 30),
                                        ("--prompt", "9" * 5000),
                                        ("--budget", "1" + "0" * 12),
                                        ("--seed", "99999999999999999999")])
def test_huge_integers_are_bad_input_naming_the_bound(capsys, tmp_path, flag, value):
    code, err = run_cli(capsys, "compile", TINY, "--mesh", "4x1", flag, value,
                        "--search", "megatron", "--out", tmp_path / "o")
    assert code == 2
    assert_one_line(err)
    assert flag in err and "<=" in err


def test_binary_plan_and_hardware_files_and_unwritable_out_are_bad_input(capsys, tmp_path):
    junk = bytes(range(256)) * 4
    (tmp_path / "plan.json").write_bytes(junk)
    code, err = run_cli(capsys, "inspect", tmp_path / "plan.json")
    assert code == 2
    assert_one_line(err)
    (tmp_path / "hw.toml").write_bytes(junk)
    code, err = run_cli(capsys, "compile", TINY, "--mesh", "4x1", "--hardware",
                        tmp_path / "hw.toml", "--out", tmp_path / "o")
    assert code == 2
    assert_one_line(err)
    assert "hw.toml" in err
    code, err = run_cli(capsys, "inspect", TINY, "--out", tmp_path / "no" / "such" / "x.txt")
    assert code == 2
    assert_one_line(err)
    assert "--out" in err and "no/such does not exist" in err  # no folder is created


# --------------------------------------------------------------- 6. plan.json consistency
def _write(path: Path, d: dict) -> Path:
    path.write_text(json.dumps(d))
    return path


def _edit_first_param(key, value):
    return lambda d: d["params"][0].update({key: value})


@pytest.mark.parametrize("edit,match", [
    (_edit_first_param("placements", ["S(99)", "R"]), "S\\(99\\)"),
    (_edit_first_param("placements", ["R"]), "1 placements for 2 mesh dims"),
    (lambda d: d["ops"][0].update(placements=["R", "R", "R"]), "3 placements"),
    (lambda d: d["spmd_dims"].reverse(), "spmd_dims"),
    (lambda d: d["layer_kinds"][0].update(count=7), "count 7"),
    (lambda d: d["layer_kinds"][0].update(layers=[0, 99]), "layer 99"),
    (lambda d: d["nodes"][5].update(layer=42), "layer 42"),
    (lambda d: d["params"][0].update(stage=3), "stage 3"),
    (lambda d: d["workload"].update(context=10**30), "context"),
    (lambda d: d["mesh"].update(nodes=10**12), "1,048,576 GPUs|1048576"),
])
def test_hand_edited_plan_inconsistencies_are_bad_input(capsys, tmp_path, plan_dict, edit,
                                                         match):
    d = json.loads(json.dumps(plan_dict))
    edit(d)
    f = _write(tmp_path / "plan.json", d)
    code, err = run_cli(capsys, "inspect", f)
    assert code == 2
    assert_one_line(err)
    from shardc.plan import load_plan

    with pytest.raises(InputError, match=match):
        load_plan(f)


# --------------------------------------------------------------- 7. duplicate degrees
@pytest.mark.parametrize("degrees", ["tp=2,tp=4", "tp=2,pp=1,pp=2", "sp=on,tp=2,sp=off"])
def test_a_degree_given_twice_is_bad_input(capsys, tmp_path, degrees):
    code, err = run_cli(capsys, "simulate", TINY, "--mesh", "4x1", "--degrees", degrees,
                        "--json", tmp_path / "s.json")
    assert code == 2
    assert_one_line(err)
    assert "given twice" in err
    assert not (tmp_path / "s.json").exists()


# --------------------------------------------------------------- 8. the output set is atomic
def _snapshot(folder: Path) -> dict:
    return {p.name: p.read_text() for p in sorted(folder.iterdir()) if p.is_file()}


def _no_staging_left(*folders: Path) -> bool:
    return not any(p.name.startswith(".shardc-tmp") for f in folders if f.exists()
                   for p in f.iterdir())


def test_failed_write_leaves_previous_set_and_user_files_and_nothing_else(tmp_path):
    from shardc.commands.reports import write_outputs

    def boom(path):
        raise RuntimeError("producer failed")

    out = tmp_path / "out"
    # a fresh folder: a failure creates nothing at all
    with pytest.raises(RuntimeError):
        write_outputs(out, {"plan.json": {"a": 1}, "graph.txt": "new", "search.png": boom})
    assert not out.exists() and _no_staging_left(tmp_path)
    # a previous set plus a user's own file: a failing producer changes nothing
    write_outputs(out, {"plan.json": {"v": "old"}, "graph.txt": "old"})
    (out / "notes.md").write_text("mine")
    before = _snapshot(out)
    with pytest.raises(RuntimeError):
        write_outputs(out, {"plan.json": {"v": "new"}, "graph.txt": "new", "search.png": boom})
    assert _snapshot(out) == before and _no_staging_left(out, tmp_path)
    # a failure while moving files into place (a folder in the way of the second file):
    # the first, already replaced, is put back
    (out / "graph.dot").mkdir()
    with pytest.raises(InputError, match="cannot write outputs there"):
        write_outputs(out, {"plan.json": {"v": "new"}, "graph.dot": "new"})
    assert _snapshot(out) == before and _no_staging_left(out, tmp_path)
    # success replaces the set and keeps the user's file
    (out / "graph.dot").rmdir()
    write_outputs(out, {"plan.json": {"v": "new"}, "graph.txt": "new"})
    assert _snapshot(out) == {"graph.txt": "new", "notes.md": "mine",
                              "plan.json": '{\n  "v": "new"\n}\n'}
    assert _no_staging_left(out, tmp_path)


def test_sigterm_while_writing_rolls_back_and_exits_143(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "plan.json").write_text("old plan")
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        from shardc.commands.reports import write_outputs
        from shardc.errors import ShardcError

        def killed(path):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # never reached: the handler raises first

        try:
            write_outputs({str(out)!r}, {{"plan.json": "new plan", "trace.json": killed}})
        except ShardcError as e:
            sys.stderr.write(f"shardc: error: {{e}}\\n")
            sys.exit(e.exit_code)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 143, proc.stderr
    assert_one_line(proc.stderr)
    assert "SIGTERM" in proc.stderr
    assert _snapshot(out) == {"plan.json": "old plan"}
    assert _no_staging_left(out, tmp_path)
