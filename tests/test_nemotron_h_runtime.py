"""Nemotron-H on the fast runtime (``shardc/runtime/mamba2_local.py``): Mamba-2 mixers (the
chunked SSD scan, the conv + SSM state per row beside the KV cache, left padding kept out
of it), MLP-only blocks (relu2, no gate) and attention blocks without rotary embeddings.

The tiny model (``tests/data/tiny_nemotron_h.py``) is examples/configs/nemotron_h_8b's tiny
variant (``tests/family_matrix``) with its Mamba-2 width shrunk further (8 heads of 16
channels in 4 groups, state 16, chunks of 4 steps so the 6-step prompt spans two chunks) to
stay cheap; random fp32 weights, and ``A_log`` / ``D`` / ``dt_bias`` drawn (HF initialises
them to a pattern). On 2 gloo ranks
each case runs its plan's own standalone ``parallelize.py`` and ``generate`` (greedy, left
padded prompts): the tokens must equal the unsharded HF model's (full recompute per token,
HF's torch ``torch_forward``) and the last-position logits of the prefill and of one cached
decode step must agree to 1e-4 relative (``test_fast_runtime_moe._logits_error``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

NEW = 8
# name -> (degrees, choices other than Megatron's); None: the plan shardc's search picks
CASES = {
    "searched": None,
    "tp2 megatron (Mamba-2 heads split: in_proj col, out_proj row)": ({"tp": 2}, {}),
    "tp2 sp megatron": ({"tp": 2, "sp": 2}, {}),
    "tp2 in_proj row": ({"tp": 2}, {"qkv": "row", "out_proj": "col"}),
    "tp2 sp in_proj rep (a slice of the gathered rows)": ({"tp": 2, "sp": 2}, {"qkv": "rep"}),
    "tp2 Mamba-2 batch split": ({"tp": 2}, {"qkv": "rep", "attn_core": "batch",
                                            "out_proj": "col"}),
    "pp2": ({"pp": 2}, {}),
}


@pytest.fixture(scope="module")
def model_file() -> str:
    return str(Path(__file__).resolve().parent / "data" / "tiny_nemotron_h.py")


def _choices(model_file: str, override: dict) -> dict:
    from test_fast_runtime_moe import megatron_choices

    return megatron_choices(model_file, override)


def _payload(model_file: str, case) -> dict:
    from test_fast_runtime import plan_payload

    from shardc.api import compile as compile_plan
    from shardc.ir.strategy import Workload

    if case is None:
        plan = compile_plan(model_file, mesh="2x1", workload=Workload(batch=4, context=512),
                            search="exact", launch=False)
        return {"code": plan.code(standalone=True), "model": model_file}
    degrees, override = case
    return plan_payload(model_file, degrees, _choices(model_file, override))


def _worker(rank, world, port, payloads, out_dir):
    """Per case: the plan file's greedy ``generate`` against the unsharded model's."""
    import copy
    import json
    import os

    import torch
    import torch.distributed as dist
    from test_fast_runtime import PROMPT, prompts, reference_greedy
    from test_fast_runtime_moe import _logits_error
    from torch.distributed.device_mesh import init_device_mesh

    from shardc.backends.verify import _build, _vocab

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results, ref = [], None
    try:
        for p in payloads:
            try:
                ns: dict = {}
                exec(compile(p["code"], "<parallelize.py>", "exec"), ns)
                model, _ = _build(p["model"], 4, PROMPT)
                if ref is None:
                    ref_model = copy.deepcopy(model)
                    ids, mask = prompts(_vocab(model))
                    ref = (ref_model, ids, mask, reference_greedy(ref_model, ids, mask, NEW))
                ref_model, ids, mask, want = ref
                mesh = init_device_mesh("cpu", tuple(ns["MESH_SHAPE"]),
                                        mesh_dim_names=tuple(ns["MESH_DIM_NAMES"]))
                model = ns["parallelize"](model, world_mesh=mesh)
                got = ns["generate"](model, ids, NEW, attention_mask=mask)
                results.append({"equal": bool(torch.equal(got, want)),
                                "got": got[:, PROMPT:].tolist(),
                                "want": want[:, PROMPT:].tolist(),
                                "logits_error": _logits_error(model._shardc_fast, ref_model,
                                                              ids, mask, want)})
            except Exception as e:  # reported per case
                import traceback

                results.append({"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def launched(model_file) -> dict:
    from shardc.testing.launch import launch

    names = list(CASES)
    payloads = [_payload(model_file, CASES[n]) for n in names]
    per_rank = launch(_worker, 2, (payloads,), 600,
                      ("torch", "transformers", "shardc.runtime.fast"))
    return {n: [r[i] for r in per_rank] for i, n in enumerate(names)}


@pytest.mark.parametrize("name", list(CASES))
def test_nemotron_h_plan_generate_equals_unsharded(launched, name):
    from test_fast_runtime import assert_unsharded_tokens

    assert_unsharded_tokens(launched[name], 1e-4)


# one decode step on 4 fake ranks issues exactly the cost model's collectives (kind, mesh
# dim, bytes; test_fast_runtime_bytes): the Mamba-2 heads split's in_proj col / out_proj row
# (one all-reduce; the conv, the state and the gated norm local: tp | groups), under
# sequence parallelism, after an in_proj row (reduce-scatter of the packed parts), and a
# batch-split Mamba-2 core
BYTES_CASES = {
    "tp4 megatron": ({"tp": 4}, {}),
    "tp4 sp megatron": ({"tp": 4, "sp": 4}, {}),
    # (tp 2: at tp 4 > its 2 KV heads the attention layer's row qkv reduce-scatters the
    # repeated KV heads, which the cost model does not charge -- not a Mamba-2 matter)
    "tp2 dp2 in_proj row": ({"tp": 2, "dp": 2}, {"qkv": "row", "out_proj": "col"}),
    "tp2 dp2 Mamba-2 batch split": ({"tp": 2, "dp": 2}, {"qkv": "rep", "attn_core": "batch",
                                                         "out_proj": "col"}),
}


@pytest.mark.parametrize("name", list(BYTES_CASES))
def test_nemotron_h_decode_step_collectives_are_the_cost_models(model_file, name):
    from test_fast_runtime_bytes import decode_collectives_match

    degrees, override = BYTES_CASES[name]
    decode_collectives_match(name, model_file, degrees, _choices(model_file, override))


def test_nemotron_h_moe_blocks_keep_the_backend_gate():
    """A Nemotron-H model with MoE blocks (block type ``moe``: not run by the fast runtime)
    is refused by the backend naming the block type, whatever the torch-style path says."""
    import torch
    from family_matrix import config_path, tiny_config

    from shardc.backends.support import backend_problem, torch_style_verdict
    from shardc.frontends.hf_build import build_causal_lm

    cfg = tiny_config(config_path("nemotron_h_8b"))
    cfg.layers_block_type, cfg.num_hidden_layers = ["linear_attention", "moe"], 2
    cfg.n_routed_experts, cfg.num_experts_per_tok = 4, 2
    cfg.moe_intermediate_size = cfg.moe_shared_expert_intermediate_size = 32
    problem = backend_problem(build_causal_lm(cfg, device="meta", dtype=torch.float32))
    assert problem == ("it runs Nemotron-H's Mamba-2, attention and MLP blocks only, not its "
                       "blocks of type (moe)")
    verdict = {"runs": False, "reason": problem}
    assert torch_style_verdict(verdict, [], None) is verdict


def test_the_ssm_state_is_held_in_the_dtype_the_cost_model_charges():
    """bf16 Nemotron-H: the cache's SSM state is in the config's ``mamba_ssm_cache_dtype``
    (vLLM's rule for Nemotron-H, which the cost model charges this runtime; float32 when it
    names none); the conv window stays in the model's dtype."""
    import runpy

    import torch

    from shardc.ir.recurrent import ssm_state_bytes
    from shardc.runtime.kv_cache import KVCache
    from shardc.runtime.local_ops import Group
    from shardc.runtime.mamba2_local import Mamba2Mixer

    model = runpy.run_path(str(Path(__file__).resolve().parent / "data" /
                               "tiny_nemotron_h.py"))["build_model"]()
    model = model.to(torch.bfloat16)
    mixer = model.model.layers[0].mixer
    walk = {"steps": [["qkv", "rep", "R", "R"], ["attn_core", "rep", "R", "R"],
                      ["out_proj", "rep", "R", "R"]], "end": "R"}
    for named, want in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        mixer.config.mamba_ssm_cache_dtype = named
        cache = KVCache(2, 8, "cpu", torch.bfloat16)
        Mamba2Mixer(mixer, walk, Group(), 0).alloc(cache, 2)
        st = cache.states[0]
        assert st.ssm.dtype == want and st.conv.dtype == torch.bfloat16
        assert tuple(st.ssm.shape) == (2, 8, 16, 16) and tuple(st.conv.shape) == (2, 128 + 2 * 64, 3)
        charged = ssm_state_bytes("dtensor", {"model_type": "nemotron_h",
                                              "mamba_ssm_cache_dtype": named}, 2.0)
        assert st.ssm.element_size() == charged


def test_the_mamba2_heads_split_places_its_own_per_head_vectors(model_file):
    """tp=2 Megatron: in_proj cut per z|x|B|C|dt part, the mixer's conv / per-head vectors /
    gated norm by Mamba2HeadsParallel alone (no second per-head slicing on the module)."""
    from test_fast_runtime import plan_payload

    code = plan_payload(model_file, {"tp": 2}, _choices(model_file, {}))["code"]
    entries = [line.strip() for line in code.splitlines() if line.strip().startswith("'mixer")
               and "Parallel(" in line and "in_proj" in line or "'mixer': " in line]
    assert "'mixer.in_proj': WeightColwiseParallel(out_dim=0, parts=(128, 128, 64, 64, 8))," \
        in [e.split("  #")[0] for e in entries], entries
    assert "'mixer': Mamba2HeadsParallel(conv_parts=(128, 64, 64))," in \
        [e.split("  #")[0] for e in entries], entries
