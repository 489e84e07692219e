"""No case of the zoo, serve and paper suites (shardc/search/suites.toml) gets a launch
configuration its engine cannot run or that does not fit: every engine's best, found by the
exact search in the space it expresses, is expressible, feasible under the cost model (the
pool's SLOs included in serve), and its script parses with only the engine's own flags. The
suites' models are the hand-built fixture graphs of the same configs (tests/cost_graphs.py),
so the check is cheap."""

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cost_graphs import fixture_graph

from shardc.backends.launch import (
    SCRIPT_ENGINES,
    LaunchPool,
    engine_flag_table,
    no_script_reason,
    pool_entry,
    render_script,
    role_for_phase,
)
from shardc.commands.bench_serve import _serve_workload
from shardc.commands.suites import load_suite
from shardc.cost import CostModel, load_hardware
from shardc.errors import InfeasibleError
from shardc.ir.engines import ENGINES, strategy_mode
from shardc.ir.space import StrategySpace, nvlink_tp_domain
from shardc.ir.strategy import Mesh, Workload
from shardc.search.engine_search import search_engine
from shardc.serving.search import serve_search

BASH = shutil.which("bash")
SAME_SHAPES = {"llama3_1_70b": "llama3_70b"}  # Llama 3.1 70B: Llama 3 70B's shapes
CASES = [c for suite in ("paper", "zoo", "serve") for c in load_suite(suite)]


def fixture_for(model: str):
    name = Path(model).stem if model.endswith(".py") else Path(model).parent.name
    return fixture_graph(SAME_SHAPES.get(name, name))


def check_script(engine: str, pool: LaunchPool, tmp_path: Path, gpus_per_node: int) -> None:
    if engine not in SCRIPT_ENGINES or no_script_reason(engine, pool, gpus_per_node):
        return
    entry = pool_entry(engine, pool, f"launch/{engine}_{pool.role}.sh")
    assert set(f for f in entry["flags"] if f.startswith("--")) <= set(
        engine_flag_table()[engine]["flags"])
    text = render_script(engine, entry, {}, "org/model", gpus_per_node)
    path = tmp_path / f"{engine}_{pool.role}.sh"
    path.write_text(text)
    if BASH:
        assert subprocess.run([BASH, "-n", str(path)]).returncode == 0


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_each_engines_best_is_expressible_and_fits(case, tmp_path):
    graph = fixture_for(case["model"])
    mesh = Mesh.parse(case["mesh"])
    hw = load_hardware(case["hardware"])
    if case["phase"] == "serve":
        wl = _serve_workload(case)
        for engine in ENGINES:
            try:
                out = serve_search(graph, mesh, hw, wl, policy="exact", budget=1,
                                   extra_policies=(), kernels="silicon", engine=engine,
                                   runtime=engine)
            except InfeasibleError:
                continue  # no script: the compile says why
            for role, workers, s, row in out.choice.pools:
                pool = out.pools[role]
                assert strategy_mode(engine, pool.space, s) is not None
                table = {k: np.asarray([v]) for k, v in row.items() if k != "actions"}
                assert pool.objective.feasible(table, wl.tpot_slo_ms, wl.ttft_slo_ms)[0]
                # the recorded row is what the cost model says of this strategy again
                again = pool.cost_model.evaluate(pool.space.encode(s)[None, :], pool.space)
                assert float(again.tok_s_per_gpu[0]) == pytest.approx(float(row["value"]))
                assert workers * s.degrees.replica_gpus <= mesh.gpus
                s = s.__class__(s.degrees.__class__(**{**s.degrees.as_dict(), "dp": workers}),
                                s.batch, s.choices)
                check_script(engine, LaunchPool.of(role, s, pool.space, wl.isl + wl.osl, 0.9),
                             tmp_path, mesh.gpus_per_node)
        return
    wl = Workload(phase=case["phase"], context=int(case["context"]), prompt=int(case["prompt"]),
                  tpot_slo_ms=float(case["tpot_slo_ms"]), ttft_slo_ms=float(case["ttft_slo_ms"]))
    space = StrategySpace(graph, mesh, wl, tp_domain=nvlink_tp_domain(mesh, hw.nvlink_domain))
    for engine in ENGINES:
        cm = CostModel(graph, mesh, hw, wl, kernels="silicon", engine=engine)
        found = search_engine("exact", space, engine, cost_model=cm)
        assert found is not None and found.complete
        if found.result.best_action is None:
            continue  # nothing it expresses fits: no script
        sp = found.result.space or space  # an experts re-split decodes in its own space
        s = sp.decode(found.result.best_action)
        assert strategy_mode(engine, sp, s) is not None
        ev = cm.evaluate(sp.encode(s)[None, :], sp)
        assert bool(ev.feasible[0]) and float(ev.tok_s_per_gpu[0]) == pytest.approx(
            found.result.best_value)
        check_script(engine, LaunchPool.of(role_for_phase(wl.phase), s, sp, 4096, 0.9),
                     tmp_path, mesh.gpus_per_node)
