"""Input is data, never code: hostile names in config.json, hardware TOML, plan.json and ONNX.

1. names reaching ``parallelize.py`` (model, hardware, layer kinds, ops) stay literals/comments;
2. the default ``--out`` stays inside ``./shardc_out/`` whatever the model is called;
3. ONNX external data is read only from inside the model's folder;
4. config.json ``auto_map`` / ONNX custom domains and functions execute nothing.
See docs/errors.md ("Model files are code") and README ("Security").
"""

from __future__ import annotations

import ast
import importlib.util
import json
import struct
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

import shardc
from shardc.cli import main
from shardc.frontends.model_file import load_model_file

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny_llama.py")
TINY_CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
               "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
               "vocab_size": 256, "max_position_embeddings": 8192}

# Each payload creates the file PWNED in the current directory if it ever runs as code.
# (No "/" in them: config.json names are reduced to their last path component.)
PAYLOADS = [
    'x"""\nimport pathlib; pathlib.Path("PWNED").touch()\n"""',  # leaves the docstring
    "x\nimport pathlib; pathlib.Path('PWNED').touch()\n#",  # leaves a comment
    "x\r__import__('pathlib').Path('PWNED').touch()\r#",  # \r ends a line for Python too
    "x'''\\\n__import__('pathlib').Path('PWNED').touch()\n'",  # backslash + quotes
    "x\\N{oops} \x00 \u2028 \u202e caf\u00e9 {braces} %s",  # bad escape, NUL, bidi, format
]
# the module-level statements every parallelize.py has, in order
# docstring, imports, the data (six plan assignments + MODEL_FINGERPRINT + PLACED + WALKS +
# PREDICTED), parallelize and
# generate, and the ``if __name__ == "__main__":`` --bench guard
EXPECTED_TOP = ["Expr", "Import", "ImportFrom", "ImportFrom", "ImportFrom"] + ["Assign"] * 10 \
    + ["FunctionDef", "FunctionDef", "If"]
MAIN_GUARD = "if __name__ == '__main__':\n    bench_main(None, parallelize, WALKS, LAYER_KINDS, " \
    "MESH_SHAPE, MESH_DIM_NAMES, PREDICTED)"


def _import_file(path: Path, cwd: Path, monkeypatch):
    """Import ``path`` as a fresh module with ``cwd`` as the current directory."""
    monkeypatch.chdir(cwd)
    spec = importlib.util.spec_from_file_location(f"generated_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_inert(src: str, tmp_path: Path, monkeypatch):
    """``src`` (a parallelize.py) parses to the expected statements only, calls nothing at
    import beyond the imports, and importing it creates no PWNED file."""
    tree = ast.parse(src)  # also fails on NUL bytes and bad escapes
    assert [type(s).__name__ for s in tree.body] == EXPECTED_TOP, ast.dump(tree)[:2000]
    assert ast.unparse(tree.body[-1]) == MAIN_GUARD  # the one statement run as a script
    for stmt in tree.body[5:15]:  # the data assignments: literals (and list(range(...)))
        for node in ast.walk(stmt.value):
            if isinstance(node, ast.Call):
                assert ast.unparse(node.func) in ("list", "range"), ast.unparse(node)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert not names & {"os", "pathlib", "__import__", "eval", "exec", "open"}
    assert src.isascii()
    path = tmp_path / "gen" / "parallelize.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(src)
    module = _import_file(path, tmp_path, monkeypatch)
    assert not (tmp_path / "PWNED").exists()
    return module


# ---- 1. generated code ------------------------------------------------------------------
def _config(tmp_path: Path, name: str, **extra) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps({**TINY_CONFIG, "_name_or_path": name, **extra}))
    return path


def test_hostile_model_and_hardware_names_stay_text(tmp_path, monkeypatch, capsys):
    from shardc.text import clean_text

    model_name, hw_name = PAYLOADS[0], PAYLOADS[0].replace("x", "h100", 1)
    config = _config(tmp_path, model_name)
    toml = tmp_path / "hw.toml"
    toml.write_text(f'base = "h100"\nname = {json.dumps(hw_name)}\n')
    out = tmp_path / "out"
    # a hardware name is validated (issue 25): letters, digits, . _ - + only
    code = main(["compile", str(config), "--mesh", "2x1", "--hardware", str(toml),
                 "--search", "megatron", "--budget", "10", "--quiet", "--out", str(out)])
    assert code == 2 and "name = " in capsys.readouterr().err and not out.exists()
    code = main(["compile", str(config), "--mesh", "2x1", "--search", "megatron", "--budget",
                 "10", "--quiet", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    src = (out / "parallelize.py").read_text()
    module = assert_inert(src, tmp_path, monkeypatch)
    # the model name is still there, as text (made printable first: its newline is "?")
    shown = clean_text(model_name)
    assert shown != model_name and shown in module.__doc__
    assert json.loads((out / "plan.json").read_text())["model"]["name"] == shown


@pytest.fixture(scope="module")
def plan_dict():
    plan = shardc.compile(TINY, mesh="2x2", search="megatron", budget=20, seed=0)
    return json.loads(json.dumps(plan.to_dict()))


def _hostile_plan(plan_dict: dict, payload: str) -> dict:
    """plan.json with every free-text name (model, hardware, layer kinds, ops, params,
    nodes) replaced by or prefixed with ``payload``."""
    d = json.loads(json.dumps(plan_dict))
    d["model"]["name"] = payload
    d["mesh"]["hardware"] = payload
    old = d["layer_kinds"][0]["name"]
    d["layer_kinds"][0]["name"] = payload
    for o in d["ops"]:
        if o["layer_kind"] == old:
            o["layer_kind"] = payload
            o["name"] = payload + o["name"][len(old):]
    for p in d["params"]:
        p["fqn"] = payload + p["fqn"]
    for n in d["nodes"]:
        n["name"] = payload + n["name"]
    from shardc.fingerprint import fingerprint

    d["model"]["fingerprint"] = fingerprint(d["params"])  # the names reach the file there too
    return d


@pytest.mark.parametrize("payload", PAYLOADS)
def test_hostile_names_in_plan_json_stay_data(plan_dict, payload, tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_hostile_plan(plan_dict, payload)))
    plan = shardc.load_plan(path)
    module = assert_inert(plan.code(), tmp_path, monkeypatch)
    assert payload in module.LAYER_KINDS  # the name round-trips as data
    assert module.CHOICES == {o["name"]: o["choice"] for o in plan.ops}
    assert payload in module.__doc__
    text = plan.summary()  # printed text: one line per entry, no raw control characters
    assert "\x00" not in text and "\r" not in text and len(text.splitlines()) == 2 + len(plan.ops)


def test_prefill_header_and_summary_omit_missing_numbers(tmp_path):
    plan = shardc.compile(TINY, mesh="2x1", search="megatron", budget=10,
                          workload=shardc.Workload(phase="prefill"))
    assert plan.predicted["tpot_ms"] is None  # prefill has no TPOT
    doc = ast.get_docstring(ast.parse(plan.code()))
    predicted = next(ln for ln in doc.splitlines() if ln.startswith("Predicted:"))
    assert "None" not in predicted and "TPOT" not in predicted
    assert "TTFT" in predicted and "tok/s/GPU" in predicted
    text = plan.summary()  # used to raise TypeError on TPOT None
    assert "TPOT - ms" in text and "None" not in text


# ---- 2. default --out -------------------------------------------------------------------
@pytest.mark.parametrize("name", ["../../escape", "/tmp/abs", "..", ".", "", "a\x00b",
                                  "a/../../b", "..\\..\\win", "~", "x" * 300, ".hidden"])
def test_out_dir_name_is_one_component_inside(name, tmp_path):
    from shardc.text import out_dir_name

    safe = out_dir_name(name)
    assert safe and safe not in (".", "..") and not safe.startswith(".")
    assert not set(safe) & {"/", "\\", "\x00"} and len(safe) <= 100
    base = (tmp_path / "shardc_out").resolve()
    assert (base / safe).resolve().parent == base


def test_out_dir_name_keeps_ordinary_names():
    from shardc.text import out_dir_name

    for name in ("tiny_llama", "Llama-3.1-70B", "qwen3_30b_a3b"):
        assert out_dir_name(name) == name


@pytest.mark.parametrize("name", ["..", "../../escape", "/tmp/abs", "a\x00b"])
def test_default_out_stays_in_shardc_out(name, tmp_path, monkeypatch, capsys):
    config = _config(tmp_path, name)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    code = main(["compile", str(config), "--mesh", "2x1", "--search", "megatron",
                 "--budget", "10", "--quiet"])
    assert code == 0, capsys.readouterr().err
    assert sorted(p.name for p in work.iterdir()) == ["shardc_out"]
    (folder,) = list((work / "shardc_out").iterdir())
    assert folder.is_dir() and (folder / "plan.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "work"]


# ---- 3. ONNX external data ----------------------------------------------------------------
def _external_onnx(folder: Path, location: str | None = None, **info) -> Path:
    """A MatMul+Relu model whose 8x8 weight is external data in ``w.bin`` next to it; then
    the reference is rewritten to ``location`` (and extra keys such as offset)."""
    folder.mkdir(parents=True, exist_ok=True)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])
    w = helper.make_tensor("proj.weight", TensorProto.FLOAT, [8, 8],
                           struct.pack("<64f", *[0.5] * 64), raw=True)
    nodes = [helper.make_node("MatMul", ["x", "proj.weight"], ["h"], name="mm"),
             helper.make_node("Relu", ["h"], ["y"], name="act")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y], [w]),
                              opset_imports=[helper.make_opsetid("", 17)])
    path = folder / "model.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="w.bin",
                    size_threshold=0)
    proto = onnx.load_model(str(path), load_external_data=False)
    (tensor,) = [t for t in proto.graph.initializer if t.name == "proj.weight"]
    assert tensor.data_location == TensorProto.EXTERNAL
    entries = {e.key: e for e in tensor.external_data}
    if location is not None:
        info["location"] = location
    for key, value in info.items():
        if key in entries:
            entries[key].value = value
        else:
            tensor.external_data.add(key=key, value=value)
    path.write_bytes(proto.SerializeToString())
    return path


def _outside_file(tmp_path: Path) -> Path:
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\x00" * 4096)
    return secret


def _inspect(path: Path, capsys) -> tuple[int, str]:
    code = main(["inspect", str(path)])
    return code, capsys.readouterr().err


def test_external_data_inside_the_folder_loads(tmp_path, capsys):
    path = _external_onnx(tmp_path / "m")
    (tmp_path / "m" / "w.bin").rename(tmp_path / "m" / "real.bin")
    (tmp_path / "m" / "w.bin").symlink_to("real.bin")  # a symlink inside the folder is fine
    code, err = _inspect(path, capsys)
    assert code == 0, err


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink", "deep dotdot"])
def test_external_data_outside_the_folder_is_refused(how, tmp_path, capsys):
    secret = _outside_file(tmp_path)
    folder = tmp_path / "m"
    if how == "absolute":
        location = str(secret)
    elif how == "dotdot":
        location = "../secret.bin"
    elif how == "deep dotdot":
        location = "sub/../../secret.bin"
        (folder / "sub").mkdir(parents=True)
    else:
        location = "link.bin"
    path = _external_onnx(folder, location)
    if how == "symlink":
        (folder / "link.bin").symlink_to(secret)
    code, err = _inspect(path, capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "'proj.weight'" in err and repr(location) in err and "outside the model's folder" in err
    assert "4096" not in err  # nothing about the outside file is reported


def test_external_data_bad_offset_is_exit_2(tmp_path, capsys):
    path = _external_onnx(tmp_path / "m", offset="12abc")
    code, err = _inspect(path, capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and "'proj.weight'" in err and "'12abc'" in err


# ---- 4. data never executes code --------------------------------------------------------
EVIL = "import pathlib\npathlib.Path({marker!r}).touch()\n\nclass Evil:\n    pass\n"


def _evil_module(folder: Path, tmp_path: Path) -> Path:
    marker = tmp_path / "PWNED_IMPORT"
    (folder / "evil.py").write_text(EVIL.format(marker=str(marker)))
    return marker


@pytest.mark.parametrize("model_type", ["llama", "evil_custom_model"])
def test_config_json_auto_map_imports_nothing(model_type, tmp_path, monkeypatch, capsys):
    auto_map = {"AutoConfig": "evil.Evil", "AutoModel": "evil.Evil",
                "AutoModelForCausalLM": "evil.Evil"}
    config = _config(tmp_path, "evil", auto_map=auto_map, trust_remote_code=True,
                     model_type=model_type, architectures=["Evil"])
    marker = _evil_module(config.parent, tmp_path)
    monkeypatch.chdir(config.parent)
    monkeypatch.syspath_prepend(str(config.parent))
    code = main(["compile", str(config), "--mesh", "2x1", "--search", "megatron",
                 "--budget", "10", "--quiet", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == (0 if model_type == "llama" else 2), err
    assert not marker.exists() and "evil" not in sys.modules
    if model_type == "llama":  # the built model's config names no custom code at all
        model, _ = load_model_file(config).build()
        assert getattr(model.config, "auto_map", None) is None
        assert not getattr(model.config, "trust_remote_code", False)


def test_onnx_custom_domain_function_and_metadata_run_nothing(tmp_path, monkeypatch):
    from shardc.frontends import load_graph

    folder = tmp_path / "m"
    folder.mkdir()
    marker = _evil_module(folder, tmp_path)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])
    w = helper.make_tensor("proj.weight", TensorProto.FLOAT, [8, 8], [0.0] * 64)
    fn = helper.make_function("evil", "Act", ["a"], ["b"],
                              [helper.make_node("Relu", ["a"], ["b"])],
                              [helper.make_opsetid("", 17)])
    py_op = helper.make_node("PyOp", ["h"], ["h2"], name="py", domain="com.microsoft",
                             module="evil", class_name="Evil", compute="compute")
    py_op.metadata_props.add(key="pkg.torch.onnx.name_scopes",
                             value="__import__('evil')")
    mm = helper.make_node("MatMul", ["x", "proj.weight"], ["h"], name="mm")
    fx = ("%mm : [num_users=1] = call_function[target=torch.ops.aten.mm.default]"
          "(args = (%x, __import__('evil')), kwargs = {[1]: 2})")  # not literals: ignored
    mm.metadata_props.add(key="pkg.torch.onnx.fx_node", value=fx)
    mm.metadata_props.add(key="pkg.torch.onnx.name_scopes", value="5")
    nodes = [mm, py_op,
             helper.make_node("Act", ["h2"], ["y"], name="act", domain="evil")]
    model = helper.make_model(
        helper.make_graph(nodes, "g", [x], [y], [w]), functions=[fn],
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1),
                       helper.make_opsetid("evil", 1)])
    model.metadata_props.add(key="pkg.torch.export.ExportedProgram.graph_signature",
                             value="__import__('evil')")
    path = folder / "model.onnx"
    onnx.save(model, str(path))
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    graph = load_graph(path)
    assert {n.name: n.op for n in graph.nodes}["mm"] == "linear"
    assert not marker.exists() and "evil" not in sys.modules


def test_docs_say_model_files_are_code():
    errors = (ROOT / "docs" / "errors.md").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "## Model files are code" in errors and "## Security" in readme
    assert "outside the model's folder" in errors and "one safe path component" in errors
