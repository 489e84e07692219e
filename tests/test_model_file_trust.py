"""Model files that exit, interrupt, or are not Python; the graph cache follows the files a
model really imports (issue 11: trust)."""

from __future__ import annotations

import shutil
import sys

import pytest
from traced_examples import EXAMPLES

import shardc.frontends as frontends
from shardc.cli import main
from shardc.errors import InputError
from shardc.frontends import graph_cache, load_graph
from shardc.frontends.imports import recording_imports
from shardc.ir.graph import Graph

_TAIL = """
def example_inputs():
    import torch
    return (torch.zeros(1, 4, dtype=torch.long),)
"""


@pytest.mark.parametrize("body, said", [
    ("import sys\ndef build_model():\n    sys.exit(0)\n", "sys.exit(0)"),
    ("def build_model():\n    raise SystemExit\n", "sys.exit(None)"),
    ("def build_model():\n    raise KeyboardInterrupt\n", "KeyboardInterrupt"),
    ("import sys\nsys.exit(0)\ndef build_model():\n    pass\n", "importing the model file"),
    ("import sys, torch\nclass M(torch.nn.Module):\n    def forward(self, x):\n"
     "        sys.exit(4)\ndef build_model():\n    return M()\n", "tracing the forward pass"),
])
def test_model_code_exiting_is_bad_input(tmp_path, capsys, body, said):
    f = tmp_path / "exits.py"
    f.write_text(body + _TAIL)
    rc = main(["compile", str(f), "--mesh", "8x1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert said in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content", [b"\x00\x01\x02binary\xff", b"x = '\xff\xfe'\n",
                                     b"\xef\xbb\xbf# -*- coding: latin-1 -*-\nx = 1\n"])
def test_unreadable_source_is_one_line(tmp_path, capsys, content):
    f = tmp_path / "garbage.py"
    f.write_bytes(content)
    rc = main(["compile", str(f), "--mesh", "8x1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("shardc: error: ") and err.count("\n") == 1
    assert "None" not in err  # no ':None:' line number


@pytest.fixture
def model_pkg(tmp_path, monkeypatch):
    """A model file that imports a helper from a sub-package of its folder, and one that
    imports a helper living elsewhere on sys.path."""
    d = tmp_path / "models"
    (d / "helpers" / "deep").mkdir(parents=True)
    (d / "helpers" / "__init__.py").write_text("")
    (d / "helpers" / "deep" / "__init__.py").write_text("")
    (d / "helpers" / "deep" / "sizes.py").write_text("HIDDEN = 32\n")
    shutil.copy(EXAMPLES / "tiny_llama.py", d / "tiny_llama.py")
    shutil.copy(EXAMPLES / "llama3_70b.py", d / "llama3_70b.py")
    (d / "model.py").write_text(
        "from helpers.deep.sizes import HIDDEN\n"
        "import torch\n"
        "def build_model():\n"
        "    return torch.nn.Sequential(torch.nn.Embedding(64, HIDDEN), torch.nn.Linear(HIDDEN, 64))\n"
        "def example_inputs():\n"
        "    return (torch.zeros(1, 4, dtype=torch.long),)\n")
    (d / "unrelated.py").write_text("X = 1\n")
    monkeypatch.setenv(graph_cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(graph_cache.NO_CACHE_ENV, raising=False)
    _forget_helpers()
    yield d
    _forget_helpers()


def _forget_helpers():
    """Each test's ``helpers`` package lives in its own tmp folder."""
    for name in [m for m in sys.modules if m == "helpers" or m.startswith("helpers.")]:
        del sys.modules[name]


@pytest.fixture
def fake_traces(monkeypatch):
    calls = []

    def fake(model, inputs, name="", source=""):
        calls.append(name)
        return Graph(name=name, source=source, tokens=int(inputs[0].numel()))

    monkeypatch.setattr(frontends, "graph_from_module", fake)
    return calls


def test_cache_follows_a_helper_in_a_sub_package(model_pkg, fake_traces):
    model = model_pkg / "model.py"
    load_graph(model)
    load_graph(model)
    assert len(fake_traces) == 1
    (model_pkg / "unrelated.py").write_text("X = 2\n")  # not imported: still a hit
    load_graph(model)
    assert len(fake_traces) == 1
    (model_pkg / "helpers" / "deep" / "sizes.py").write_text("HIDDEN = 48\n")
    load_graph(model)
    assert len(fake_traces) == 2  # the helper it imports changed: a fresh trace
    (model_pkg / "helpers" / "deep" / "sizes.py").unlink()
    with pytest.raises(InputError, match=r"model\.py: importing failed: .*helpers\.deep\.sizes"):
        load_graph(model)  # a recorded file is gone: a miss (never the stale entry), and the
    assert len(fake_traces) == 2  # fresh import fails as it would in a new process


def test_cache_follows_an_imported_sibling(model_pkg, fake_traces):
    tiny = model_pkg / "tiny_llama.py"
    load_graph(tiny, tiny=True)
    sibling = model_pkg / "llama3_70b.py"
    sibling.write_text(sibling.read_text() + "\n# edited\n")
    load_graph(tiny, tiny=True)
    load_graph(tiny, tiny=True)
    assert len(fake_traces) == 2


def test_recording_sees_modules_imported_before_the_window(model_pkg, monkeypatch):
    monkeypatch.syspath_prepend(str(model_pkg))
    import helpers.deep.sizes  # noqa: F401  (already in sys.modules when the window opens)

    with recording_imports() as files:
        exec("from helpers.deep.sizes import HIDDEN", {})
    assert model_pkg / "helpers" / "deep" / "sizes.py" in {f for f in files}
    assert not any("site-packages" in str(f) for f in files)  # libraries are not keyed


def test_a_model_file_may_define_dataclasses(tmp_path):
    """dataclasses look their module up in sys.modules while the file executes."""
    f = tmp_path / "dc_model.py"
    f.write_text("from __future__ import annotations\nimport dataclasses\nimport torch\n\n"
                 "@dataclasses.dataclass\nclass Cfg:\n    vocab: int = 64\n    hidden: int = 16\n\n"
                 "def build_model():\n    c = Cfg()\n"
                 "    return torch.nn.Sequential(torch.nn.Embedding(c.vocab, c.hidden),\n"
                 "                               torch.nn.Linear(c.hidden, c.vocab))\n"
                 + _TAIL)
    from shardc.frontends.model_file import load_model_file

    model, _ = load_model_file(f).build()
    assert sum(p.numel() for p in model.parameters()) == 64 * 16 + 16 * 64 + 64


def test_a_closed_stdout_pipe_is_not_an_internal_error(tmp_path):
    """`shardc compile ... | head`: the reader leaves early; no traceback, no internal error."""
    import subprocess

    proc = subprocess.Popen([sys.executable, "-m", "shardc.cli", "compile",
                             str(EXAMPLES / "tiny_llama.py"), "--mesh", "4x1", "--search",
                             "megatron", "--quiet", "--out", str(tmp_path / "o")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # nobody reads the summary
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) in (0, 141), err
    assert "internal error" not in err and "Traceback" not in err, err
    assert (tmp_path / "o" / "plan.json").is_file()


def test_an_unchanged_helper_is_not_executed_again(model_pkg, fake_traces, tmp_path):
    """A helper that registers global state (a torch custom op, say) runs once per process
    unless its source changes: loading the model file again does not re-execute it."""
    log = tmp_path / "executions.txt"
    (model_pkg / "helpers" / "deep" / "sizes.py").write_text(
        f"with open({str(log)!r}, 'a') as f:\n    f.write('run\\n')\nHIDDEN = 32\n")
    from shardc.frontends.model_file import load_model_file

    for _ in range(3):
        load_model_file(model_pkg / "model.py").build()
    assert log.read_text().count("run") == 1
    (model_pkg / "helpers" / "deep" / "sizes.py").write_text(
        f"with open({str(log)!r}, 'a') as f:\n    f.write('run\\n')\nHIDDEN = 48\n")
    from shardc.frontends import load_graph

    load_graph(model_pkg / "model.py")  # a recorded load notices the edit and re-imports
    load_graph(model_pkg / "model.py")
    assert log.read_text().count("run") == 2
