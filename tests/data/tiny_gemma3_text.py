"""Tiny Gemma-3 text model (``Gemma3ForCausalLM``) from examples/configs/gemma3_27b's tiny
variant's text config (tests/test_fast_runtime_gemma3.py): the multimodal tiny variant keeps
its full-size vision tower (417M parameters), too large for 4 gloo processes."""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import torch  # noqa: E402
from family_matrix import tiny_config  # noqa: E402
from transformers import Gemma3ForCausalLM  # noqa: E402

from shardc.frontends.hf_build import token_ids  # noqa: E402

CONFIG = HERE.parents[1] / "examples" / "configs" / "gemma3_27b" / "config.json"


def build_model():
    text = tiny_config(CONFIG).get_text_config()
    text.use_cache = False
    torch.manual_seed(0)
    return Gemma3ForCausalLM(text).float().eval()


def example_inputs():
    return token_ids(256)


tiny_model = build_model
tiny_inputs = example_inputs
