"""`shardc calibrate` (tiny grid on CPU): it writes a kernel table that `--kernels FILE.npz`
reads -- the simulated ops are priced from the measured file, exactly on its grid points."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardc.cli import main
from shardc.cost import load_hardware
from shardc.cost.calibrate import calibrate, load_calibrated, measure_moe, save_tables
from shardc.cost.silicon import MEASURED, kernels_for

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny_llama.py")  # hidden 64, 8 / 4 heads, ffn 128


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    from shardc.api import load_model_graph

    tables = calibrate("tiny", graph=load_model_graph(TINY), device="cpu")
    import torch

    from shardc.cost.calibrate import GRIDS, _timer

    tables.update(measure_moe(torch.device("cpu"), torch.bfloat16, GRIDS["tiny"],
                              [(64, 32, 2, 8)], "uniform", _timer(torch.device("cpu"))))
    path = tmp_path_factory.mktemp("cal") / "cpu.npz"
    save_tables(path, tables)
    return path


def test_calibrate_writes_the_silicon_table_format(table):
    t = load_calibrated(table)
    assert t["gemm_bf16"].shape == (3, 2, 2) and (t["gemm_bf16"] > 0).all()
    assert (np.diff(t["gemm_bf16"], axis=0) >= 0).all()  # non-decreasing in m
    assert t["gen_attn_keys"].shape[1] == 4 and t["ctx_attn"].ndim == 3
    assert t["moe_bf16_keys"].tolist()[0] == [64.0, 32.0, 2.0, 8.0, 1.0, 1.0]
    assert str(t["system"]) == "calibrated:cpu" and str(t["routing"]) == "uniform"
    k, source, reason = kernels_for(load_hardware("h100"), str(table), "vllm")
    assert k is not None, reason
    assert source.startswith("silicon:calibrated-torch-") and source.endswith("calibrated:cpu")
    got, status = k.gemm(t["gemm_m"], 128.0, 64.0, False)  # exact on the grid
    np.testing.assert_allclose(got, t["gemm_bf16"][:, 1, 0], rtol=1e-12)
    assert (status == MEASURED).all()
    moe, status = k.moe(t["moe_tokens"], 64, 32, 2, 8, np.ones(3), np.ones(3), fp8=False)
    np.testing.assert_allclose(moe, t["moe_bf16"][0], rtol=1e-12)


def test_kernels_file_prices_simulate(table, tmp_path, capsys):
    out = tmp_path / "sim.json"
    base = ["simulate", TINY, "--mesh", "1x1", "--degrees", "tp=1", "--batch", "2",
            "--context", "32", "--tpot-slo", "1000000", "--json", str(out)]
    assert main(base + ["--kernels", str(table)]) == 0
    p = json.loads(out.read_text())["predicted"]
    assert p["kernel_source"].startswith("silicon:calibrated-")
    src = {r["op"]: r["kernel_source"] for r in p["breakdown"]["ops"]}
    assert src["dense_block.qkv"].startswith("silicon")
    assert src["dense_block.attn_core"] == "silicon"  # its (8, 4, 8) heads at batch 2, KV 32
    capsys.readouterr()
    code = None
    try:
        code = main(base + ["--kernels", str(tmp_path / "missing.npz")])
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("shardc: error: --kernels") and len(err.strip().splitlines()) == 1


def test_calibrate_command_refuses_a_non_npz_out(tmp_path, capsys):
    assert main(["calibrate", "--out", str(tmp_path / "table.json")]) == 2
    assert "--out" in capsys.readouterr().err
