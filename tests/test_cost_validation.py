"""Cost model vs published serving numbers (REFERENCE.md); see docs/validation.md.

Each ratio (predicted / published) must lie within +-30%, except the misses documented in
docs/validation.md, which are pinned to their documented band so they cannot drift silently.
Runs on the hand-built fixture graphs (fast); the slow variant uses graphs traced from
examples/ by the real frontend.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import validate_cost  # noqa: E402
from cost_graphs import fixture_graph  # noqa: E402

# documented misses: case -> (low, high) band of the ratio, explained in docs/validation.md
DOCUMENTED = {
    "TRT-LLM Mixtral-8x7B TP8 128/128": (1.3, 1.65),
    "TRT-LLM Mixtral-8x7B TP8 2048/2048": (1.3, 1.6),
}


def _check(rows):
    assert len(rows) == len(validate_cost.CASES)
    for r in rows:
        lo, hi = DOCUMENTED.get(r["case"], (0.7, 1.3))
        assert lo <= r["ratio"] <= hi, f"{r['case']}: ratio {r['ratio']:.2f} outside [{lo}, {hi}]"


def test_validation_ratios_on_fixture_graphs(monkeypatch):
    monkeypatch.setattr(validate_cost, "model_graph", lambda n: (fixture_graph(n), "fixture"))
    _check(validate_cost.validation_rows())


@pytest.mark.slow
def test_validation_ratios_on_traced_graphs():
    pytest.importorskip("shardc.frontends")
    _check(validate_cost.validation_rows())


def test_measured_kernels_meet_issue_23_bar(monkeypatch):
    """With the measured kernel tables (the default for h100): every TRT-LLM figure within
    +-25% and the geometric-mean error over all published points <= 15% (issue 23); the
    DeepSeek-V3 prefill point (H800 TOML hardware, so priced by the roofline) is the documented
    miss of docs/validation.md."""
    monkeypatch.setattr(validate_cost, "model_graph", lambda n: (fixture_graph(n), "fixture"))
    rows = validate_cost.validation_rows("silicon")
    for r in rows:
        if r["case"].startswith("TRT-LLM"):
            assert 0.75 <= r["ratio"] <= 1.25, f"{r['case']}: ratio {r['ratio']:.2f}"
    assert validate_cost.geomean_error(rows) <= 0.15


def test_geomean_error_is_factor_symmetric():
    rows = [{"ratio": 0.8}, {"ratio": 1.25}]
    assert abs(validate_cost.geomean_error(rows) - 0.25) < 1e-12
    assert validate_cost.geomean_error([{"ratio": 1.0}]) == 0.0
