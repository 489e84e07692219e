"""The emitted ``parallelize.py``'s own benchmark entry: ``python parallelize.py --bench``
of a ``--standalone`` file (imports only torch and the standard library; transformers only
inside ``--config``'s builder) runs on CPU under gloo -- it starts the plan's 2 ranks itself
-- builds the tiny config's model on meta, materialises each rank's shards and prints one
JSON line. The file also defines ``generate``. (Numbers: benchmarks/ only; here the line's
shape and consistency.)"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from test_backend_gloo import DENSE, LLAMA
from test_fast_runtime import plan_payload

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    from shardc.frontends.model_file import load_model_file

    tmp = tmp_path_factory.mktemp("fast_bench")
    payload = plan_payload(LLAMA, {"tp": 2}, DENSE)
    path = tmp / "parallelize.py"
    path.write_text(payload["code"])
    model, _ = load_model_file(LLAMA).build(tiny=True)
    model.config.to_json_file(str(tmp / "config.json"))
    return path, tmp / "config.json"


def _bench(path: Path, config: Path, *extra: str) -> dict:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(path), "--bench", "--config", str(config),
                          "--batch", "4", *extra], capture_output=True, text=True,
                         timeout=600, cwd=path.parent, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, out.stdout  # rank 0 alone prints
    return json.loads(lines[0])


def test_standalone_bench_prints_one_json_line(standalone):
    path, config = standalone
    src = path.read_text()
    assert "\ndef generate(model, input_ids, max_new_tokens" in src
    assert "import shardc" not in src and "from shardc" not in src
    rec = _bench(path, config, "--context", "32", "--steps", "3")
    assert rec["phase"] == "decode" and rec["world"] == 2 and rec["device"] == "cpu"
    assert 0 < rec["step_ms_min"] <= rec["step_ms"] and math.isfinite(rec["step_ms"])
    # tokens per second per GPU = global batch / step time / ranks
    assert rec["tok_s_per_gpu"] == pytest.approx(4 / (rec["step_ms"] / 1e3) / 2, rel=1e-3)
    assert rec["predicted_tpot_ms"] is None  # batch 4 / context 32 is not the plan's point
    pre = _bench(path, config, "--phase", "prefill", "--prompt", "8", "--steps", "2")
    assert pre["phase"] == "prefill" and pre["prompt"] == 8 and pre["step_ms"] > 0
    assert "predicted_ttft_ms" in pre and "predicted_tpot_ms" not in pre


def test_bench_of_a_batch_that_does_not_split_exits_2_with_one_line(standalone, tmp_path):
    """--batch 3 over dp = 2 ranks: bad input, one line on stderr, exit 2 (no traceback)."""
    _, config = standalone
    path = tmp_path / "parallelize.py"
    path.write_text(plan_payload(LLAMA, {"dp": 2}, DENSE)["code"])
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(path), "--bench", "--config", str(config),
                          "--batch", "3", "--context", "16", "--steps", "1"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert lines == ["parallelize.py --bench: --batch 3 does not split over dp x ep = 2 ranks"], \
        out.stderr[-2000:]


def test_inlined_runtime_modules_define_distinct_names():
    """``--standalone`` pastes the runtime modules into one namespace: a top-level name
    defined by two of them would silently replace the other's."""
    import ast
    from collections import defaultdict

    from shardc.runtime import PIPELINE_SOURCES, SOURCES

    defined = defaultdict(list)
    for name in SOURCES + PIPELINE_SOURCES:
        tree = ast.parse((ROOT / "shardc" / "runtime" / name).read_text())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined[node.name].append(name)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        defined[t.id].append(name)
    assert {k: v for k, v in defined.items() if len(v) > 1 and k != "__all__"} == {}
