"""An inference script using shardc as a library: compile, apply under gloo, generate.

    python examples/serve_tiny.py [--model examples/tiny_mixtral.py] [--world 4] [--tokens 8]

1. ``shardc.compile`` traces the model file, searches a plan for a ``<world>x1`` mesh with the
   RL agent and saves ``plan.json``;
2. ``<world>`` CPU processes join a gloo process group; each loads the plan and calls
   ``plan.apply(model)``, which turns every parameter into a DTensor on the plan's mesh;
3. every rank greedily generates ``--tokens`` tokens for a batch of prompts of 3-6 tokens,
   left-padded with a padding mask (the batch is split over the plan's dp/ep ranks and
   gathered back), prefilling the prompts once and then
   decoding one token per step with the model's KV cache (each rank caches its own heads or
   rows), and rank 0 checks them against the unsharded model's generation, which re-runs
   the whole prefix every step (no KV cache).

Exit code 0 when the sharded and unsharded generations agree token for token.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import shardc

HERE = Path(__file__).resolve().parent


def greedy_generate(model, prompt_ids: torch.Tensor, new_tokens: int, kv_cache: bool = True,
                    attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Append ``new_tokens`` argmax tokens to each (left-padded) prompt: with ``kv_cache`` a
    prefill of the prompts then one-token steps that reuse a KV cache made here with
    transformers' public API (``DynamicCache``, passed under the keyword the model's
    ``forward`` declares: ``cache`` from transformers 5.24, ``past_key_values`` before);
    without it every step re-runs the whole prefix. ``attention_mask`` [batch, prompt] marks
    the real prompt tokens (1) and the padding (0)."""
    from transformers import DynamicCache

    ids, step, mask, kw = prompt_ids, prompt_ids, attention_mask, {}
    if kv_cache:
        name = "cache" if "cache" in inspect.signature(model.forward).parameters \
            else "past_key_values"
        kw = {name: DynamicCache(config=model.config), "use_cache": True}
    for _ in range(new_tokens):
        with torch.no_grad():
            out = model(step if kv_cache else ids, attention_mask=mask, **kw)
        logits = out.logits if hasattr(out, "logits") else out
        next_id = logits[:, -1, :].argmax(dim=-1, keepdim=True)
        ids = torch.cat([ids, next_id], dim=1)
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(next_id)], dim=1)
        step = next_id if kv_cache else ids
    return ids[:, prompt_ids.shape[1]:]


def _worker(rank: int, world: int, port: int, model_file: str, plan_path: str, batch: int,
            tokens: int, result_path: str) -> None:
    from shardc.frontends.model_file import load_model_file

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        source = load_model_file(model_file)
        reference, _ = source.build(tiny=True)
        model, _ = source.build(tiny=True)
        vocab = reference.config.vocab_size if hasattr(reference, "config") else 256
        gen = torch.Generator().manual_seed(1)
        prompts = torch.randint(0, vocab, (batch, 6), generator=gen)
        lengths = torch.randint(3, 7, (batch,), generator=gen)  # prompts of 3-6 tokens,
        mask = (torch.arange(6)[None, :] >= 6 - lengths[:, None]).long()  # left-padded to 6
        plan = shardc.load_plan(plan_path)
        # HF models take a padding mask, and a KV cache unless pipelined (pp > 1); GPT-MoE
        # takes neither (its prompts are then unpadded)
        hf = hasattr(reference, "config")
        kv_cache = hf and plan.degrees.get("pp", 1) == 1
        mask = mask if hf else None
        # the reference re-runs the whole prefix every step: no cache to share a bug with
        expected = greedy_generate(reference, prompts, tokens, False, mask)
        sharded = plan.apply(model)
        got = greedy_generate(sharded, prompts, tokens, kv_cache, mask)
        if rank == 0:
            Path(result_path).write_text(json.dumps({
                "degrees": plan.degrees, "kv_cache": kv_cache, "expected": expected.tolist(),
                "got": got.tolist()}))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(HERE / "tiny_mixtral.py"))
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=6)
    ap.add_argument("--budget", type=int, default=500)
    args = ap.parse_args(argv)

    batch = 2 * args.world  # divisible by any dp x ep of the plan
    plan = shardc.compile(args.model, mesh=f"{args.world}x1",
                          workload=shardc.Workload(phase="decode", batch=batch, context=64),
                          search="rl", budget=args.budget, seed=0, name=None)
    plan.summary()  # prints the degrees, prediction and per-op choices
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = plan.save(Path(tmp) / "plan.json")
        result_path = Path(tmp) / "result.json"
        mp.spawn(_worker, nprocs=args.world, join=True,
                 args=(args.world, _free_port(), args.model, str(plan_path), batch,
                       args.tokens, str(result_path)))
        result = json.loads(result_path.read_text())
    same = result["expected"] == result["got"]
    cache = "with the KV cache" if result["kv_cache"] else "re-running the prefix"
    print(f"generated {args.tokens} tokens x {batch} prompts on {args.world} gloo ranks "
          f"({cache}) with degrees {result['degrees']}: "
          f"{'identical to' if same else 'DIFFERENT from'} the unsharded model")
    print("first prompt:", result["got"][0])
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
