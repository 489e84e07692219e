"""The warm compile path (issue 15): no deep copy of the graph, graph.txt without tabulate's
slow path, torch imported only by a step that needs it -- and outputs unchanged.

The golden files in ``tests/data/warm_path/`` hold the *decision* of two plans
(``tests/plan_decision.py``: degrees, per-op choices, parameter and activation placements,
collectives; node names and transformers' helper ops normalised away, so a new transformers
release that traces its masks differently does not fail this test while a changed plan
does). They were first written on the code before the warm-path changes (commit dc8ca6c);
regenerate them only when a change to the plan is intended::

    python -c "import sys; sys.path.insert(0, 'tests'); import test_warm_path as t; \\
               t.write_golden('tests/data/warm_path')"
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "data" / "warm_path"
HEAVY = ("torch", "transformers", "onnx", "matplotlib", "gymnasium")


# ---------------------------------------------------------------------- golden outputs
def _fixed_strategy(graph):
    """tp=2, ep=2, pp=2 on 8 GPUs, every op choice cycling through 0, 1, 2 (so that most
    repairs and collectives occur)."""
    from shardc.ir.strategy import Degrees, Strategy

    slots = [f"{k.name}.{o.name}" for k in graph.layer_kinds for o in k.ops]
    slots += [o.name for o in graph.global_ops]
    choices = {s: i % 3 for i, s in enumerate(slots)}
    return Strategy(Degrees(tp=2, pp=2, ep=2, dp=1), 4, choices)


def golden_outputs() -> dict[str, str]:
    """The decision of plan.json (as ``shardc compile`` writes it) and the normalised graph.txt
    of a Megatron compile of tiny_llama on 4x1, and of tiny_mixtral planned with
    :func:`_fixed_strategy` on 8x1. Uses only interfaces the code before the change had."""
    from plan_decision import decision_graph_txt, plan_decision

    import shardc.api as api
    from shardc.commands.reports import workload_note
    from shardc.frontends import load_graph
    from shardc.ir.strategy import Workload
    from shardc.plan import build_plan

    def texts(tag, plan):
        d = plan.to_dict()
        d = {**d, "model": {k: v for k, v in d["model"].items() if k != "fingerprint"}}
        # (model.fingerprint: the model's identity, not a decision; tests/test_trust_r3_plans.py)
        return {f"{tag}.decision.json": json.dumps(plan_decision(d), indent=1) + "\n",
                f"{tag}.graph.txt": decision_graph_txt(d, workload_note(plan.workload))}

    llama = load_graph(str(ROOT / "examples" / "tiny_llama.py"))
    plan, _ = api.compile_with_outcome(llama, mesh="4x1", search="megatron")
    out = texts("tiny_llama_4x1_megatron", plan)
    mixtral = load_graph(str(ROOT / "examples" / "tiny_mixtral.py"))
    plan = build_plan(mixtral, _fixed_strategy(mixtral), "8x1", "h100", Workload(),
                      predicted={}, baseline={}, search={})
    out.update(texts("tiny_mixtral_8x1_fixed", plan))
    return out


def write_golden(folder: str) -> None:
    Path(folder).mkdir(parents=True, exist_ok=True)
    for name, text in golden_outputs().items():
        (Path(folder) / name).write_text(text)


def test_plan_and_graph_txt_are_those_of_the_code_before_the_warm_path_changes():
    produced = golden_outputs()
    assert sorted(produced) == sorted(p.name for p in GOLDEN.iterdir())
    for name, text in produced.items():
        assert text == (GOLDEN / name).read_text(), f"{name} differs from the golden file"


# ---------------------------------------------------------------------- annotate
def test_annotate_copies_no_more_than_the_node_records():
    from shardc.frontends import load_graph
    from shardc.passes.annotate import annotate

    g = load_graph(str(ROOT / "examples" / "tiny_mixtral.py"))
    before = g.to_json()
    a = annotate(g, _fixed_strategy(g))
    assert g.to_json() == before  # the input graph is untouched
    assert all(n.placements is None and n.redistribute is None for n in g.nodes)
    assert all(n.placements is not None for n in a.nodes)
    for old, new in zip(g.nodes, a.nodes):
        assert new is not old
        assert new.params is old.params and new.inputs is old.inputs  # shared, not copied
    assert a.layer_kinds is not g.layer_kinds and a.layer_kinds == g.layer_kinds


def test_annotating_an_annotated_graph_keeps_nothing_of_the_first_annotation():
    from shardc.frontends import load_graph
    from shardc.ir.strategy import Degrees, Strategy
    from shardc.passes.annotate import annotate

    g = load_graph(str(ROOT / "examples" / "tiny_mixtral.py"))
    first = annotate(g, _fixed_strategy(g))
    assert any(n.redistribute for n in first.nodes)
    first_json = first.to_json()
    dp_only = Strategy(Degrees(tp=1, pp=1, ep=1, dp=8), 4, {})
    again = annotate(first, dp_only)
    assert first.to_json() == first_json
    assert again.to_json() == annotate(g, dp_only).to_json()


def test_compile_leaves_the_loaded_graph_and_the_graph_cache_as_they_were():
    import shardc.api as api
    from shardc.frontends import load_graph

    path = str(ROOT / "examples" / "tiny_llama.py")
    g = load_graph(path)  # traced and stored, or served by the cache
    first = g.to_json()
    api.compile(g, mesh="4x1", search="megatron")
    assert g.to_json() == first
    again = load_graph(path)  # served by the cache: a fresh object, unannotated
    assert again is not g and again.to_json() == first


# ---------------------------------------------------------------------- graph.txt
ODD_TABLES = [
    [["a", "1", "x"], ["bb", "22", ""]],                # an all-number column
    [["a", "1,024", "True"], ["b", "-1e5", "False"]],   # thousands, exponent, bools
    [["a", "inf", "NaN"], ["b", "x", "y"]],             # number words
    [["  padded ", "b", "c"], ["d", "e ", " f"]],        # surrounding whitespace
    [["\u00e9t\u00e9", "b", "c"], ["d", "e", "f"]],     # non-ASCII
    [["a\nb", "c", "d"], ["e", "f", "g"]],               # a line break
    [["\x1b[31mred\x1b[0m", "c", "d"], ["e", "f", "g"]],  # ANSI colour codes
    [["", "", ""], ["", "", ""]],                       # nothing at all
    [["a", "", "c"]],                                   # an empty column
    [["a-very-long-cell-name", "b", "c"]],              # wider than its header
]


@pytest.mark.parametrize("rows", ODD_TABLES)
def test_plain_table_is_tabulates_plain_format(rows):
    from tabulate import tabulate

    from shardc.commands.reports import plain_table

    headers = ["node", "op", "collective inserted"]
    assert plain_table(rows, headers) == tabulate(rows, headers=headers, tablefmt="plain")


def test_graph_txt_rows_are_tabulates_plain_format():
    from tabulate import tabulate

    from shardc.commands.reports import GRAPH_TABLE_HEADERS, graph_table
    from shardc.frontends import load_graph
    from shardc.ir.strategy import Workload
    from shardc.ir.token_dims import shape_text
    from shardc.plan import build_plan

    g = load_graph(str(ROOT / "examples" / "tiny_mixtral.py"))
    plan = build_plan(g, _fixed_strategy(g), "8x1", "h100", Workload())
    rows = []
    for n in plan.nodes:
        red = n["redistribute"] or {}
        coll = f"{red['collective']}@{red['mesh_dim']} {red['bytes']} B" if red else ""
        rows.append([n["name"], n["op"], shape_text(n["shape"], n["token_dims"]),
                     " ".join(n["placements"]), coll])
    expected = tabulate(rows, headers=list(GRAPH_TABLE_HEADERS), tablefmt="plain") + "\n"
    assert graph_table(plan.nodes) == expected


# ---------------------------------------------------------------------- imports
def _run(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env=full_env, timeout=300)


def test_importing_the_entry_points_imports_no_heavy_library():
    proc = _run("import sys, shardc, shardc.api, shardc.cli, shardc.driver, shardc.plan, "
                "shardc.passes, shardc.passes.annotate, shardc.search, shardc.frontends, "
                "shardc.commands.reports, shardc.commands.compile\n"
                f"print([m for m in {HEAVY!r} if m in sys.modules])")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("search", ["megatron", "exact"])
def test_a_warm_compile_without_the_rl_agent_does_not_import_torch(tmp_path, monkeypatch,
                                                                    search):
    """The graph and the backend's verdict come from the on-disk cache (stored here from
    this process); ``shardc compile`` then runs a search that needs no torch and writes
    every file."""
    from shardc.frontends import graph_cache, load_graph

    model = ROOT / "examples" / "tiny_llama.py"
    graph = load_graph(str(model))
    cache = tmp_path / "cache"
    monkeypatch.setenv("SHARDC_CACHE_DIR", str(cache))
    assert graph_cache.store_entry(graph_cache.cache_key(model, False), graph) is not None
    from shardc.backends.support import check_model_file

    check_model_file(str(model))  # the backend's verdict is cached beside the graph
    out = tmp_path / "out"
    proc = _run("import sys\nfrom shardc.cli import main\n"
                f"rc = main(['compile', {str(model)!r}, '--mesh', '4x1', '--search', "
                f"{search!r}, '--quiet', '--out', {str(out)!r}])\n"
                f"print('RC', rc, [m for m in ('torch', 'transformers', 'gymnasium') "
                "if m in sys.modules])",
                env={"SHARDC_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "RC 0 []", proc.stdout + proc.stderr
    assert {"plan.json", "graph.txt", "parallelize.py", "search.png", "trace.json"} <= {
        p.name for p in out.iterdir()}
