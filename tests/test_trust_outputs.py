"""What compile and inspect report can be trusted (issue 11): the summary of every phase,
the search.png title, infeasibility reasons that name the binding constraint, graph shapes at
the plan's workload, and well-formed DOT."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib.figure
import pytest

import shardc
from shardc.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY_LLAMA = str(ROOT / "examples" / "tiny_llama.py")


def _summary_rows(text: str) -> dict[str, str]:
    rows = {}
    for line in text.splitlines():
        for key in ("TPOT (ms)", "TTFT (ms)", "predicted tok/s/GPU", "memory/GPU (GB)"):
            if line.startswith(key):
                rows[key] = line[len(key):].strip()
    return rows


@pytest.mark.parametrize("phase, shown, absent", [("decode", "TPOT (ms)", "TTFT (ms)"),
                                                  ("prefill", "TTFT (ms)", "TPOT (ms)")])
def test_compile_each_phase_exits_0_with_summary_and_titled_plot(tmp_path, capsys, monkeypatch,
                                                                 phase, shown, absent):
    titles = []
    real_savefig = matplotlib.figure.Figure.savefig

    def recording_savefig(fig, *a, **k):
        titles.append(" ".join(ax.get_title() for ax in fig.axes))
        return real_savefig(fig, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", recording_savefig)
    out = tmp_path / "o"
    code = main(["compile", TINY_LLAMA, "--mesh", "4x1", "--phase", phase, "--prompt", "512",
                 "--context", "1024", "--search", "sa", "--budget", "200", "--quiet",
                 "--out", str(out)])
    assert code == 0
    rows = _summary_rows(capsys.readouterr().out)
    assert float(rows[shown]) > 0 and float(rows["predicted tok/s/GPU"]) > 0
    assert rows[absent] == "-"  # the phase does not predict it
    assert (out / "search.png").stat().st_size > 0
    # search.png says what was searched: model, mesh, workload, searcher
    (title,) = titles
    assert "tiny_llama" in title and "4x1" in title and "h100" in title and phase in title
    assert "search sa" in title
    if phase == "prefill":
        assert "prompt 512" in title and "TTFT SLO 2000 ms" in title
    else:
        assert "context 1024" in title and "TPOT SLO 50 ms" in title
    # the library's summary of the same plan does not fail on the missing number either
    text = shardc.load_plan(out / "plan.json").summary()
    assert f"{absent.split()[0]} - ms" in text


QWEN_72B = str(ROOT / "examples" / "configs" / "qwen2_5_72b" / "config.json")


def test_infeasible_names_the_binding_constraint_not_the_commonest(capsys):
    """Qwen2.5-72B on 11 GPUs: tp=11 does not divide hidden 8192, no batch of the grid splits
    over pp=11 micro-batches, and at tp=1 / pp=1 the weights alone overflow HBM. The line
    leads with the binding check (memory, with the shortfall) and names the others."""
    code = main(["compile", QWEN_72B, "--mesh", "11x1", "--search", "megatron", "--quiet",
                 "--tpot-slo", "100", "--out", "/nonexistent/never-written"])
    assert code == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    head = err.split("h100): ", 1)[1]
    assert head.startswith("weights alone need 145.4 GB/GPU at tp=1")
    assert "70.0 GB of the 80 GB HBM is usable for them (short by 75.4 GB)" in head
    assert "pp=11" in head and "batch does not divide evenly" in head
    assert "--batch " in head and "feasible" in head  # a batch that unblocks a split
    assert "tp=11 cannot be used (tp must divide hidden 8192)" in head


@pytest.mark.parametrize("phase, flag, name", [("decode", "--tpot-slo", "TPOT"),
                                               ("prefill", "--ttft-slo", "TTFT")])
def test_infeasible_slo_says_how_far_the_fastest_plan_is(capsys, phase, flag, name):
    code = main(["compile", TINY_LLAMA, "--mesh", "4x1", "--phase", phase, flag, "0.00001",
                 "--search", "megatron", "--quiet", "--out", "/nonexistent/never-written"])
    assert code == 3
    err = capsys.readouterr().err
    # the fastest plan's latency against the SLO, not the commonest failure of random points
    assert f"no feasible plan on mesh 4x1 (h100): {name} " in err
    assert f"exceeds the {0.00001:g} ms SLO" in err


def _node(plan: dict, name: str) -> dict:
    return next(n for n in plan["nodes"] if n["name"] == name)


@pytest.mark.parametrize("phase, args, tokens, keys", [
    ("prefill", ["--prompt", "512"], 512, 512),
    ("decode", ["--context", "1024"], 1, 1024)])
def test_graph_shapes_are_at_the_plan_workload(tmp_path, capsys, phase, args, tokens, keys):
    """Traced at 1 x 16 tokens; graph.txt, plan.json, inspect and graph.dot show batch 8 x
    the phase's tokens (decode: 1 new token per step, the KV context as key positions)."""
    import json

    out = tmp_path / "o"
    assert main(["compile", TINY_LLAMA, "--mesh", "2x1", "--phase", phase, *args, "--batch", "8",
                 "--search", "megatron", "--quiet", "--out", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    emb = _node(plan, "embedding")
    assert emb["shape"] == [8, tokens, 64] and emb["token_dims"] == ["b", "s", None]
    assert _node(plan, "input_ids")["shape"] == [8, tokens]
    # the attention mask has query x key positions; in decode the keys are the KV context
    masks = [n for n in plan["nodes"] if n["token_dims"][-2:] == ["s", "kv"]]
    assert masks and all(n["shape"][-2:] == [tokens, keys] for n in masks)
    # weights-only dims are not token dims and keep their size
    assert _node(plan, "output")["shape"] == [8, tokens, 256]
    text = f"{8}(b)x{tokens}(s)x64"
    graph_txt = (out / "graph.txt").read_text()
    assert text in graph_txt and "1(b)x16(s)" not in graph_txt
    assert "batch 8" in graph_txt.splitlines()[0]
    capsys.readouterr()
    assert main(["inspect", str(out / "plan.json"), "--layer", "0"]) == 0
    shown = capsys.readouterr().out
    assert text in shown and "x16(s)" not in shown
    dot = (out / "graph.dot").read_text()
    assert text in dot and dot.count("->") >= len(plan["nodes"]) - 5


_ESC = r'(?:[^"\\\n]|\\n)*'
_DOT_LINE = re.compile(
    rf'^(digraph "{_ESC}" \{{|  label="{_ESC}"; labelloc=t;|  rankdir=TB;|'
    r'  node \[shape=box, fontname="monospace", fontsize=10\];|'
    rf'  n\d+ \[label="{_ESC}"\];|  n\d+ -> n\d+(?: \[color=red, label="{_ESC}"\])?;|\}})$')


def _assert_well_formed_dot(dot: str) -> None:
    for line in dot.rstrip("\n").split("\n"):
        assert _DOT_LINE.match(line), line


def test_inspect_dot_of_a_plan_has_edges_and_escapes_hostile_names(tmp_path, capsys):
    """A plan's DOT had no edges (plan nodes did not record their inputs), and names went
    into the DOT text unescaped: a quote, backslash or newline in a node or model name broke
    the file or injected attributes."""
    import json

    out = tmp_path / "o"
    assert main(["compile", TINY_LLAMA, "--mesh", "2x1", "--search", "megatron", "--quiet",
                 "--out", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    hostile = 'evil" color=red];\nx -> y [label="\\'
    rename = {plan["nodes"][1]["name"]: hostile}
    plan["model"]["name"] = 'model "with\\quotes\nand lines'
    for n in plan["nodes"]:
        n["name"] = rename.get(n["name"], n["name"])
        n["inputs"] = [rename.get(i, i) for i in n.get("inputs", [])]
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(plan))
    capsys.readouterr()
    assert main(["inspect", str(path), "--format", "dot"]) == 0
    dot = capsys.readouterr().out
    _assert_well_formed_dot(dot)
    assert dot.count(" -> ") >= len(plan["nodes"]) - 5
    assert "evil&#34; color=red];\\nx -&#62; y [label=&#34;&#92;" in dot
    _assert_well_formed_dot((out / "graph.dot").read_text())


@pytest.mark.parametrize("args, expected", [
    (["--mesh", "4x1", "--degrees", "tp=2,pp=1", "--batch", "1"],
     "strategy infeasible: weights alone need 72.7 GB/GPU at tp=2 ep=1 pp=1 batch=1; 70.0 GB "
     "of the 80 GB HBM is usable for them (short by 2.7 GB)"),
    (["--mesh", "8x1", "--degrees", "tp=2,pp=2", "--batch", "64", "--context", "8192"],
     "strategy infeasible: weights + KV cache + activations need 79.3 GB/GPU at tp=2 ep=1 pp=2 "
     "batch=64 (weights 36.4, KV cache 42.9, activations 0.0); 70.0 GB of the 80 GB HBM is "
     "usable for them (short by 9.3 GB)")])
def test_simulate_says_what_is_short_and_by_how_much(capsys, args, expected):
    assert main(["simulate", QWEN_72B, *args]) == 3
    assert expected in capsys.readouterr().err
