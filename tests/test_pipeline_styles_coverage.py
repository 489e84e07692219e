"""Pipeline stages (pp = 2) on the torch-style path for the families and choices the
torch styles newly cover (:mod:`test_styles_coverage`): the emitted standalone
``parallelize.py`` of each plan, on 4 gloo ranks, reproduces the unsharded logits.

* Phi-3.5-MoE pp=2 x tp=2 (sparsemixer routing, lm_head bias on the last stage);
* OLMoE pp=2 x tp=2, attention split by heads (q/k norms over all heads);
* tiny Mixtral pp=2 x tp=2 with the router row split;
* Phi-3.5-MoE pp=2 x ep=2 (experts split over ep inside each stage). Tiny Mixtral
  pp=2 x ep=2 is :mod:`test_pipeline_styles`' case, not repeated here;
* GPT-2 pp=2 x tp=2 (``transformer.h``, learned positions zero on the later stage, a tied
  lm_head) and GPT-MoE pp=2 (a plain model: token ids in, hidden states through a
  pass-through embedding) with tp + sp and with ep.
"""

from __future__ import annotations

import pytest
from test_backend_gloo import TOL, ruff_clean
from test_pipeline_styles import _world
from test_runtime_styles import TORCH_ONLY, _imported_modules
from test_styles_coverage import GPT2, GPT_MOE, MIXTRAL, OLMOE, PHI, build

from shardc.backends.verify import Case, run_suites

# name -> (model file, degrees, choice overrides of the Megatron choices)
CASES = {
    "phi-3.5-moe pp2 tp2 (sparsemixer, lm_head bias)": (PHI, {"pp": 2, "tp": 2}, {}),
    "olmoe pp2 tp2 heads split (q/k norms over all heads)": (OLMOE, {"pp": 2, "tp": 2}, {}),
    "mixtral pp2 tp2 router row": (MIXTRAL, {"pp": 2, "tp": 2}, {"router": "row"}),
    "phi-3.5-moe pp2 ep2": (PHI, {"pp": 2, "ep": 2}, {}),
    # layouts other than an HF model.layers (issue 20: formerly the first runtime's)
    "gpt2 pp2 tp2 (transformer.h, learned positions, tied lm_head)": (GPT2, {"pp": 2, "tp": 2}, {}),
    "gpt-moe pp2 tp2 sp (plain model: token ids in)": (GPT_MOE, {"pp": 2, "tp": 2, "sp": 2}, {}),
    "gpt-moe pp2 ep2": (GPT_MOE, {"pp": 2, "ep": 2}, {}),
}


@pytest.fixture(scope="module")
def emitted(tmp_path_factory) -> dict[str, str]:
    """name -> path of the plan's standalone parallelize.py."""
    tmp = tmp_path_factory.mktemp("pipeline_coverage")
    out = {}
    for i, (name, (model, degrees, overrides)) in enumerate(CASES.items()):
        path = tmp / f"case{i}_parallelize.py"
        path.write_text(build(model, degrees, overrides).code(standalone=True))
        out[name] = str(path)
    return out


@pytest.fixture(scope="module")
def gloo_results(emitted) -> dict[str, dict]:
    suites: dict[tuple, list] = {}
    for name, (model, degrees, _) in CASES.items():
        assert _world(degrees) == 4
        # a config.json's tiny model is shaped for its degrees
        key = (model, tuple(sorted(degrees.items())) if model.endswith(".json") else ())
        suites.setdefault(key, []).append(Case(name, {}, {}, None, code=emitted[name]))
    runs = [(model, cases, dict(degs) if degs else None) for (model, degs), cases in suites.items()]
    return {r["name"]: r for r in run_suites(runs, world=4)}


def test_files_are_standalone_pipelines(emitted):
    ruff_clean(list(emitted.values()))
    for name, path in emitted.items():
        src = open(path).read()
        assert {m.split(".")[0] for m in _imported_modules(src)} <= TORCH_ONLY, name
        assert "model = pipeline(model, world_mesh, microbatches=2" in src, name
        assert "ModelSharder" not in src, name


@pytest.mark.parametrize("name", list(CASES))
def test_pipelined_covered_cases_match_unsharded(gloo_results, name):
    r = gloo_results[name]
    assert r["error"] is None, r["error"]
    assert r["rel_err"] <= TOL, r
