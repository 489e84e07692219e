"""The best-practice baseline (SGLang / Megatron-Core practice, swept over degrees and batch):
legal, deterministic, never below the Megatron heuristic, equal to the best of its candidates
(expert TP tried apart from attention TP), and it takes up options the space gains."""

from types import SimpleNamespace

import numpy as np
import pytest
from cost_graphs import fixture_graph

from shardc.commands.compile import baseline_ratios, summary_table
from shardc.cost import CostModel
from shardc.ir.space import DEGREE_COMPONENTS, StrategySpace, megatron_op_choices
from shardc.ir.strategy import Mesh, Workload
from shardc.search import run_search
from shardc.search.baselines import (
    DP_ATTENTION,
    EXPERT_TP1,
    best_practice_actions,
    best_practice_op_choices,
    megatron_actions,
)
from shardc.search.legal import LegalSampler
from shardc.search.objective import cost_model_objective


def problem(name, mesh, phase, fixed=None):
    g = fixture_graph(name)
    m = Mesh.parse(mesh)
    wl = Workload(phase=phase)
    space = StrategySpace(g, m, wl, fixed=dict(fixed or {}))
    return space, cost_model_objective(CostModel(g, m, "h100", wl), space)


def ops_of(space, row):
    return {slot.split(".")[-1]: int(c) for slot, c in zip(space.op_slots, row)
            if slot.startswith("moe_block.") or "." not in slot}


@pytest.mark.parametrize("case", [("mixtral_8x7b", "8x1", "decode", None),
                                  ("mixtral_8x7b", "8x2", "prefill", None),
                                  ("deepseek_v3", "8x16", "decode", None),
                                  ("mixtral_8x7b", "8x2", "prefill", {"tp": 8})])
def test_best_practice_is_never_below_megatron(case):
    space, obj = problem(*case)
    mega = run_search("megatron", space, obj)
    bp = run_search("best_practice", space, obj)
    assert bp.found and bp.best_value >= mega.best_value


def test_best_practice_value_is_the_best_of_its_candidates_closed_form():
    # a sweep: its value is the max over its candidate set, priced by the same objective;
    # at tp 8 (fixed) the candidates hold both expert layouts, so it is >= either one alone
    space, obj = problem("mixtral_8x7b", "8x2", "prefill", {"tp": 8})
    sampler = LegalSampler(space)
    acts = best_practice_actions(sampler)
    values, feasible = obj(acts)
    bp = run_search("best_practice", space, obj)
    assert bp.best_value == pytest.approx(float(np.max(np.where(feasible, values, 0.0))))
    mega = run_search("megatron", space, obj)
    assert bp.best_value >= mega.best_value
    f1 = space.op_slots.index("moe_block.expert_ffn1")
    split = {int(a[len(DEGREE_COMPONENTS) + f1]) for a in acts}
    assert len(split) >= 2  # experts tried split over tp and unsplit


@pytest.mark.parametrize("case", [("mixtral_8x7b", "8x2", "decode"),
                                  ("deepseek_v3", "8x4", "prefill"),
                                  ("tiny_llama", "8x1", "decode")])
def test_best_practice_actions_are_legal_and_contain_megatron(case):
    space, _ = problem(*case)
    sampler = LegalSampler(space)
    acts = best_practice_actions(sampler)
    assert sampler.legal(acts).all()
    assert len({a.tobytes() for a in acts}) == len(acts)  # no strategy twice
    mine = {a.tobytes() for a in acts}
    assert all(a.tobytes() in mine for a in megatron_actions(sampler))
    for t in range(len(space.values["tp"])):
        rows = best_practice_op_choices(space, t)
        assert 1 <= len(rows) <= 4


def test_best_practice_is_deterministic():
    space, obj = problem("deepseek_v3", "8x4", "decode")
    a = run_search("best_practice", space, obj, seed=0)
    b = run_search("best_practice", space, obj, seed=5)
    np.testing.assert_array_equal(a.best_action, b.best_action)
    assert a.best_value == b.best_value and a.evaluations == b.evaluations
    sampler = LegalSampler(space)
    np.testing.assert_array_equal(best_practice_actions(sampler), best_practice_actions(sampler))


def test_rules_dp_attention_for_mla_expert_tp_free():
    # DeepSeek (MLA: the latent KV cache is not split by heads): DP-attention is tried
    space, _ = problem("deepseek_v3", "8x1", "decode")
    t = space.values["tp"].index(8)
    rows = [ops_of(space, r) for r in best_practice_op_choices(space, t)]
    assert any(all(r[op] == c for op, c in DP_ATTENTION.items()) for r in rows)
    assert any(all(r[op] == c for op, c in EXPERT_TP1.items()) for r in rows)
    # Mixtral (GQA, 8 KV heads, tp 8 splits them): heads only, experts both ways
    space, _ = problem("mixtral_8x7b", "8x1", "decode")
    t = space.values["tp"].index(8)
    rows = [ops_of(space, r) for r in best_practice_op_choices(space, t)]
    assert len(rows) == 2
    assert all(r["attn_core"] == 0 for r in rows)
    assert {(r["expert_ffn1"], r["expert_ffn2"]) for r in rows} == {(0, 1), (2, 2)}


def test_rules_take_up_a_heads_split_the_space_makes_legal():
    # tiny_llama has 4 KV heads: at tp 8 the space replicates KV heads, so best practice
    # splits attention by heads where Megatron's rule replicates all of attention ...
    space, _ = problem("tiny_llama", "8x1", "decode")
    t = space.values["tp"].index(8)
    core = space.op_slots.index("dense_block.attn_core")
    assert int(megatron_op_choices(space, t)[core]) == 2
    rows = best_practice_op_choices(space, t)
    assert [int(r[core]) for r in rows] == [0, 2]  # KV-head replication first, then Megatron
    # ... and where the heads split is illegal, attention is tried data-parallel in the tp
    # group besides Megatron's replicated fallback
    i = space.op_slots.index("dense_block.attn_core")
    space.op_mask_by_tp[t, i, 0] = False
    rows = best_practice_op_choices(space, t)
    assert sorted(int(r[core]) for r in rows) == [1, 2]


def test_summary_claims_the_gain_against_the_stronger_baseline():
    plan = SimpleNamespace(
        degrees={"tp": 8, "ep": 2, "pp": 1, "dp": 1, "sp": 8}, workload={"batch": 32}, model={},
        predicted={"tok_s_per_gpu": 120.0, "tpot_ms": None, "ttft_ms": 900.0,
                   "memory_gb_per_gpu": 60.0},
        baseline={"megatron": {"tok_s_per_gpu": 100.0}, "best_practice": {"tok_s_per_gpu": 110.0}},
        search={"policy": "rl", "chosen_from": "rl"})
    r = baseline_ratios(plan)
    assert r == {"megatron": "1.200x", "best_practice": "1.091x", "stronger": "best_practice"}
    text = summary_table(plan)
    assert "vs best practice" in text and "1.091x" in text
    assert "gain vs stronger baseline (best practice)" in text
    plan.search["chosen_from"] = "best_practice"
    assert "best practice baseline" in summary_table(plan)


def test_bench_report_shows_both_baselines_and_the_gain_over_the_stronger():
    import argparse

    from shardc.commands.bench import add_arguments
    from shardc.search.report import baselines, markdown

    rows = [{"case": "c", "policy": p, "seeds": 1, "mean": v, "best": v, "evaluations": 1,
             "wall_s": 0.0} for p, v in (("rw", 50.0), ("sa", 90.0), ("ga", 95.0),
                                         ("rl", 121.0), ("megatron", 100.0),
                                         ("best_practice", 110.0))]
    line = [x.strip() for x in baselines(rows).splitlines()[2].split("|")[1:-1]]
    assert line[1:5] == ["100.00", "110.00", "1.100", "best practice"]
    assert line[5:9] == ["0.455", "0.818", "0.864", "1.100"]
    assert "stronger baseline" in markdown("zoo", rows, "shardc bench")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    default = parser.parse_args(["--suite", "zoo"]).policies.split(",")
    assert {"megatron", "best_practice"} <= set(default)  # bench runs both by default
