"""Tiny Nemotron-H: examples/configs/nemotron_h_8b's tiny variant (tests/family_matrix.py) with
its Mamba-2 width shrunk further (8 heads of 16 channels in 4 groups, state 16, chunks of 4
steps) to keep the runtime tests cheap; A_log / D / dt_bias drawn (HF initialises them to a
pattern). Used by tests/test_nemotron_h_runtime.py and tests/test_standalone_every_plan.py."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
from family_matrix import config_path, tiny_config  # noqa: E402

from shardc.frontends.hf_build import build_causal_lm, token_ids  # noqa: E402


def build_model():
    cfg = tiny_config(config_path("nemotron_h_8b"))
    cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups = 8, 16, 4
    cfg.ssm_state_size, cfg.chunk_size = 16, 4
    torch.manual_seed(0)
    model = build_causal_lm(cfg, device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("dt_bias", ".D")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 2)
    return model.eval()


def example_inputs():
    return token_ids(256)


tiny_model = build_model
tiny_inputs = example_inputs
