"""Trust round 3 (issue 25), inputs: config shape fields checked before anything is built
(the field named), names cleaned before any output, ASCII digits only, ``inspect plan.json``
refuses flags it cannot use, HF's reason shown, hardware TOML names validated (a preset name
with other numbers recorded as ``<name>-custom``), and the library's arguments checked like
the command line's. Each test failed on main before the fix."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

import shardc
from shardc.cli import main
from shardc.errors import InputError, ShardcError

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny_llama.py")
CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
          "vocab_size": 256, "max_position_embeddings": 8192}
MOE = {**CONFIG, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}


def _one_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("shardc: ") and "Traceback" not in err
    return lines[0]


def _write(tmp_path: Path, data: dict, name: str = "config.json") -> str:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(json.dumps(data))
    return str(folder / name)


# ------------------------------------------------------------ 1. config shape fields
@pytest.mark.parametrize("base, field, value, says", [
    (CONFIG, "max_position_embeddings", 0, "max_position_embeddings = 0"),
    (CONFIG, "max_position_embeddings", -1, "max_position_embeddings = -1"),
    (CONFIG, "intermediate_size", 0, "intermediate_size = 0"),
    (CONFIG, "num_hidden_layers", 0, "num_hidden_layers = 0"),
    (CONFIG, "num_hidden_layers", 100000, "num_hidden_layers = 100000"),
    (CONFIG, "num_key_value_heads", 3, "num_key_value_heads = 3: expected a divisor"),
    (CONFIG, "hidden_size", 0, "hidden_size = 0"),
    (CONFIG, "hidden_size", 2, "smaller than num_attention_heads"),
    (CONFIG, "head_dim", 0, "head_dim = 0"),
    (CONFIG, "num_attention_heads", "8", "num_attention_heads = '8'"),
    (CONFIG, "vocab_size", 64.0, "vocab_size = 64.0"),
    (MOE, "num_experts_per_tok", 0, "num_experts_per_tok = 0"),
    (MOE, "num_experts_per_tok", 16, "at most the 4 experts"),
    (MOE, "num_local_experts", 0, "num_local_experts = 0"),
])
def test_a_bad_shape_field_is_named_before_building(tmp_path, capsys, base, field, value, says):
    path = _write(tmp_path, {**base, field: value})
    code = main(["compile", path, "--mesh", "2x1", "--search", "megatron", "--budget", "10",
                 "--quiet", "--out", str(tmp_path / "o")])
    assert code == 2
    assert says in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


def test_a_deeply_nested_config_is_bad_input(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert main(["inspect", str(path)]) == 2
    assert "nested" in _one_line(capsys.readouterr().err)


def test_hf_validation_errors_show_their_reason(tmp_path, capsys):
    path = _write(tmp_path, {**CONFIG, "hidden_act": 5})  # HF's message spans two lines
    assert main(["inspect", path]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "hidden_act" in line and "(more with SHARDC_DEBUG=1)" not in line
    assert "expected str, got int" in line  # the reason, from the second line


# ------------------------------------------------------------ 2. names before output
@pytest.mark.parametrize("name", ["\ud800", "a\x00b\nfake row\x1b[31m", "x\u202ey"])
def test_names_are_cleaned_before_any_output(tmp_path, capsys, name):
    path = _write(tmp_path, {**CONFIG, "_name_or_path": name})
    out = tmp_path / "o"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. matplotlib's missing-glyph warning
        code = main(["compile", path, "--mesh", "2x1", "--search", "megatron", "--budget",
                     "10", "--quiet", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    plan = json.loads((out / "plan.json").read_text())
    assert plan["model"]["name"].isprintable()
    assert all(line.isprintable() for line in captured.out.splitlines())


def test_inspect_prints_onnx_style_node_names_as_one_line_each():
    from shardc.commands.inspect import graph_table
    from shardc.ir.graph import Graph, Node

    g = Graph(name="m\nfake", source="x.onnx",
              nodes=[Node(name="/a\nfake table line", op="other", output_shape=[1])])
    text = graph_table(g, g.nodes, condensed=False)
    assert "\nfake" not in text and "?fake table line" in text


# ------------------------------------------------------------ 3. digits, flags
@pytest.mark.parametrize("argv", [
    ["simulate", TINY, "--mesh", "\uff18x1", "--degrees", "tp=8"],
    ["simulate", TINY, "--mesh", "8x1", "--degrees", "tp=\uff12"],
    ["compile", TINY, "--mesh", "2x1", "--budget", "\uff11\uff10"],
    ["simulate", TINY, "--mesh", "2x1", "--context", "\uff11\uff10\uff10"],
    ["simulate", TINY, "--mesh", "2x1", "--tpot-slo", "\uff15\uff10"],
])
def test_unicode_digits_are_refused(capsys, argv):
    assert main(argv) == 2
    _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("flag", [["--mesh", "8x1"], ["--tiny"]])
def test_inspect_of_a_plan_refuses_flags_it_would_ignore(tmp_path, capsys, flag):
    plan = shardc.compile(TINY, mesh="2x1", search="megatron", budget=10)
    plan.save(tmp_path / "plan.json")
    assert main(["inspect", str(tmp_path / "plan.json"), *flag]) == 2
    assert "not used with a plan.json" in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("argv, says", [
    (["--world", "1000"], "--world"), (["--seq", "1000000000"], "--seq"),
    (["--world", "\uff12"], "--world"),
])
def test_verify_bounds_world_and_seq(tmp_path, capsys, argv, says):
    assert main(["verify", TINY, "--plan", str(tmp_path / "missing.json"), *argv]) == 2
    assert says in _one_line(capsys.readouterr().err)


# ------------------------------------------------------------ 4. hardware TOML
@pytest.mark.parametrize("text, says", [
    ('base = "h100"\nname = {a = 1}\n', "name = {'a': 1} is not a string"),
    ('base = "h100"\nname = ""\n', "name = ''"),
    ('base = "h100"\nname = "a\\nb"\n', "name = 'a\\nb'"),
    ('base = "h100"\nworkspace_gb = 1000\n', "workspace_gb = 1000"),
    ("x = " + "[" * 50_000 + "]" * 50_000 + "\n", "nested"),
])
def test_bad_hardware_files_are_refused(tmp_path, text, says):
    from shardc.cost import load_hardware

    path = tmp_path / "hw.toml"
    path.write_text(text)
    with pytest.raises(InputError) as e:
        load_hardware(str(path))
    assert says in str(e.value)


def test_a_preset_name_with_other_numbers_is_recorded_as_custom(tmp_path):
    from shardc.cost import load_hardware

    path = tmp_path / "hw.toml"
    path.write_text('name = "h100"\nbase = "h100"\nhbm_gb = 40.0\n')
    assert load_hardware(str(path)).name == "h100-custom"
    path.write_text('name = "h100"\nbase = "h100"\n')  # the preset's own numbers
    assert load_hardware(str(path)).name == "h100"
    plan = shardc.compile(TINY, mesh="2x1", search="megatron", budget=10,
                          hardware=str(tmp_path / "hw.toml"))
    assert plan.mesh["hardware"] == "h100"


# ------------------------------------------------------------ 5. the library's arguments
@pytest.mark.parametrize("kwargs, says", [
    ({"workload": "decode"}, "workload: expected a shardc.Workload"),
    ({"budget": float("nan")}, "budget = nan"),
    ({"budget": 10**30}, "budget = 1e+30"),
    ({"budget": "100"}, "budget = '100'"),
    ({"seed": "x"}, "seed = 'x'"),
    ({"seed": 2**70}, "seed = "),
    ({"degrees": [2]}, "degrees: expected"),
    ({"degrees": {"tp": "2,pp=4"}}, "degrees: expected"),
    ({"mesh": 8}, "mesh: expected"),
    ({"search": ["rl"]}, "search = ['rl']"),
    ({"hardware": None}, "hardware: expected"),
    ({"allow_cross_node_tp": "yes"}, "allow_cross_node_tp"),
])
def test_compile_checks_its_arguments_like_the_cli(kwargs, says):
    with pytest.raises(InputError) as e:
        shardc.compile(TINY, **{"mesh": "2x1", "search": "megatron", "budget": 10, **kwargs})
    assert says in str(e.value)


@pytest.mark.parametrize("call", [
    lambda: shardc.load_plan(None), lambda: shardc.load_plan(3),
])
def test_load_plan_checks_its_argument(call):
    with pytest.raises(ShardcError, match="expected a path"):
        call()


def test_plan_methods_check_their_arguments():
    plan = shardc.compile(TINY, mesh="2x1", search="megatron", budget=10)
    with pytest.raises(InputError, match="expected a path"):
        plan.save(None)
    with pytest.raises(InputError, match="expected a torch nn.Module"):
        plan.apply("model")
