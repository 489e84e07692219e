"""The benchmark entry of the emitted ``parallelize.py`` (torch only; transformers is
imported when ``--config`` asks for an HF model)::

    torchrun --nproc-per-node N parallelize.py --bench --config CONFIG.json --batch B \\
        --context C --steps S [--phase prefill --prompt P]
    python parallelize.py --bench --model FILE.py ...   # no torchrun: N local gloo processes

Every rank builds the model on ``meta`` (full size: nothing allocated), places it with the
file's ``parallelize`` (DTensor shards of meta tensors), then materialises only its own
shards (``to_empty``, random weights: a rank never holds the whole model; replicated
weights are whole as the plan says), builds the fast runtime's :class:`FastModel` and KV
cache for its rows, marks the cache filled to ``C - S`` steps and times ``S`` decode steps
(or ``S`` prefills of ``[B, P]``, compiled on a GPU: the warm-up calls compile). Rank 0 prints one JSON line: ``step_ms`` (median),
``step_ms_min``, ``predicted_tpot_ms`` (prefill: ``predicted_ttft_ms``; the plan's when
``--batch`` / ``--context`` (``--prompt``) are the plan's, else null), ``tok_s_per_gpu``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from shardc.runtime.fast import FastModel
from shardc.runtime.generate import DecodeGraphs, Prefill, decode_step


def bench_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="time this plan's decode step (or prefill)")
    p.add_argument("--bench", action="store_true", required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="an HF config.json (random weights)")
    src.add_argument("--model", help="a model file with build_model() (random weights)")
    p.add_argument("--batch", type=int, default=1, help="sequences (global batch)")
    p.add_argument("--context", type=int, default=2048, help="KV cache steps filled")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--phase", choices=("decode", "prefill"), default="decode")
    p.add_argument("--prompt", type=int, default=128, help="prefill tokens per sequence")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="default: bfloat16 on a GPU, float32 on CPU")
    p.add_argument("--warmup", type=int, default=3)
    return p.parse_args(argv)


def _hf_auto():
    """transformers' Auto classes (imported here only: ``--config`` builds an HF model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoConfig, AutoModelForCausalLM


def _meta_model(args):
    """The model on ``meta``: an HF config's causal LM (transformers, imported here only), or
    a model file's ``build_model()``."""
    if args.config:
        AutoConfig, AutoModelForCausalLM = _hf_auto()
        with open(args.config) as f:
            raw = json.load(f)
        cfg = AutoConfig.for_model(raw.pop("model_type"), **raw)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg)
    spec = importlib.util.spec_from_file_location("bench_model", args.model)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with torch.device("meta"):
        return mod.build_model()


def materialise(model: nn.Module, device, dtype, seed: int = 1234) -> nn.Module:
    """Allocate this rank's shards of a meta model (``to_empty``) and fill them: random
    normal weights (std 0.02), norms 1, biases 0; rotary tables recomputed, other buffers 0."""
    model.to_empty(device=device)
    model.to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = p.to_local() if isinstance(p, DTensor) else p
            owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
            if "norm" in owner:
                t.fill_(1.0)
            elif name.endswith("bias"):
                t.zero_()
            else:
                t.normal_(0.0, 0.02, generator=gen)
        for mod in model.modules():
            own = dict(mod.named_buffers(recurse=False))
            if "inv_freq" in own and hasattr(mod, "config"):  # a rotary table: rebuilt
                with torch.device("cpu"):
                    fresh = type(mod)(mod.config)
                for bname, b in own.items():
                    b.copy_(getattr(fresh, bname))
                mod.attention_scaling = getattr(fresh, "attention_scaling", 1.0)
            else:
                for b in own.values():
                    b.zero_()
    return model


def _fill(cache, filled: int) -> None:
    """Mark ``filled`` steps of every layer as written (the values are whatever is there)."""
    cache.reset(torch.zeros(cache.rows, dtype=torch.long, device=cache.device))
    for layer in cache.layers.values():
        n = min(filled, layer.slots)
        steps = torch.arange(filled - n, filled, device=cache.device)
        layer.slot_step[steps % layer.slots] = steps
    cache.advance(filled)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step, args, device) -> list[float]:
    """Wall ms of each of ``args.steps`` calls of ``step`` after ``args.warmup`` untimed ones
    (the device synchronised around each call)."""
    times = []
    for i in range(args.warmup + args.steps):
        _sync(device)
        t = time.perf_counter()
        step()
        _sync(device)
        if i >= args.warmup:
            times.append((time.perf_counter() - t) * 1e3)
    return times


def run_bench(args, parallelize, walks, layer_kinds, mesh_shape, dim_names,
              predicted) -> dict | None:
    """Build, place and time on this rank (distributed already initialised); the JSON
    record on rank 0, None elsewhere."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda \
        else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    mesh = init_device_mesh(device.type, tuple(mesh_shape), mesh_dim_names=tuple(dim_names))
    model = parallelize(_meta_model(args), world_mesh=mesh)
    materialise(model, device, dtype)
    fast = FastModel(model, mesh, walks, layer_kinds)
    world = dist.get_world_size()
    if args.batch % fast.batch.size:
        raise ValueError(f"--batch {args.batch} does not split over dp x ep = "
                         f"{fast.batch.size} ranks")
    rows = args.batch // fast.batch.size
    with torch.no_grad():
        if args.phase == "decode":
            cache = fast.new_cache(rows, args.context)
            graphs = DecodeGraphs(fast, cache, 256) if cuda and fast.graphable else None
            ids = torch.randint(0, 100, (rows, 1), device=device)
            start_fill = max(args.context - args.steps - args.warmup, 0)
            _fill(cache, start_fill)
            times = _timed(lambda: decode_step(fast, cache, ids, graphs), args, device)
            tokens = args.batch
        else:
            cache = fast.new_cache(rows, args.prompt)
            ids = torch.randint(0, 100, (rows, args.prompt), device=device)
            start = torch.zeros(rows, dtype=torch.long, device=device)
            run = Prefill(fast, buckets=())  # compiled on a GPU, at the prompt's own length
            times = _timed(lambda: run(cache, ids, start), args, device)
            tokens = args.batch * args.prompt
    med = statistics.median(times)
    rec = {"phase": args.phase, "step_ms": round(med, 4), "step_ms_min": round(min(times), 4),
           **_predicted(args, predicted),
           "tok_s_per_gpu": round(tokens / (med / 1e3) / world, 2), "batch": args.batch,
           "context": args.context, "prompt": args.prompt if args.phase == "prefill" else None,
           "steps": args.steps, "world": world, "device": torch.cuda.get_device_name(device)
           if cuda else "cpu", "dtype": str(dtype).replace("torch.", ""),
           "cuda_graph": bool(cuda and fast.graphable and args.phase == "decode"),
           "compiled_prefill": bool(cuda and args.phase == "prefill")}
    return rec if dist.get_rank() == 0 else None


def _predicted(args, predicted: dict | None) -> dict:
    """``predicted_tpot_ms`` (decode) or ``predicted_ttft_ms`` (prefill): the plan's, when
    this run is the plan's point (its global batch and context / prompt), else None: the
    plan predicts no other point."""
    p = predicted or {}
    if args.phase == "decode":
        same = args.batch == p.get("batch") and args.context == p.get("context")
        return {"predicted_tpot_ms": p.get("tpot_ms") if same else None}
    same = args.batch == p.get("batch") and args.prompt == p.get("prompt")
    return {"predicted_ttft_ms": p.get("ttft_ms") if same else None}


def _spawned(rank, world, port, argv, entry):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    entry(argv)


def bench_main(argv, parallelize, walks, layer_kinds, mesh_shape, dim_names,
               predicted) -> None:
    """``--bench`` entry: under torchrun as is; otherwise (CPU) the mesh's ranks are
    started here as local gloo processes."""
    args = bench_args(argv)
    world = 1
    for s in mesh_shape:
        world *= int(s)
    if "WORLD_SIZE" not in os.environ and not dist.is_initialized():
        if torch.cuda.is_available() and world > 1:
            raise SystemExit(f"this plan runs on {world} GPUs: start it with torchrun "
                             f"--nproc-per-node {world}")
        import socket

        import torch.multiprocessing as mp

        if args.config:
            _hf_auto()  # imported once, before the ranks fork
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]

        import multiprocessing

        refused = multiprocessing.get_context("fork").Value("i", 0)  # a rank's exit code

        def entry(a, _args=args):
            try:
                _run(_args, parallelize, walks, layer_kinds, mesh_shape, dim_names,
                     predicted)
            except SystemExit as e:  # refused (rank 0 said why): every rank ends cleanly,
                refused.value = e.code if isinstance(e.code, int) else 1  # the parent exits

        if world == 1:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                              WORLD_SIZE="1", LOCAL_RANK="0")
            entry(argv)
        else:
            try:
                mp.start_processes(_spawned, args=(world, port, argv, entry), nprocs=world,
                                   start_method="fork")
            except mp.ProcessExitedException as e:  # a rank crashed
                raise SystemExit(e.exit_code or 1) from None
        if refused.value:
            raise SystemExit(refused.value)
        return
    _run(args, parallelize, walks, layer_kinds, mesh_shape, dim_names, predicted)


def _run(args, parallelize, walks, layer_kinds, mesh_shape, dim_names, predicted):
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    try:
        rec = run_bench(args, parallelize, walks, layer_kinds, mesh_shape, dim_names,
                        predicted)
        if rec is not None:
            print(json.dumps(rec), flush=True)
    except (NotImplementedError, ValueError) as e:  # a plan / input the runtime refuses:
        if dist.get_rank() == 0:  # the same on every rank, so rank 0 says it once
            print(f"parallelize.py --bench: {e}", file=sys.stderr, flush=True)
        dist.barrier()  # and the others wait for that line before exiting
        raise SystemExit(2) from None
    finally:
        dist.destroy_process_group()
