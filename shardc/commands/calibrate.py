"""``shardc calibrate --out FILE.npz [--grid tiny|full] [--model M] [--routing R]``: measure this
machine's kernels (GEMMs, attention, grouped expert GEMMs under a routing model) into a table
that ``--kernels FILE.npz`` prices plans with (:mod:`shardc.cost.calibrate`)."""

from __future__ import annotations

import sys
from pathlib import Path

from shardc.errors import InputError

HELP = "Measure this machine's kernels into a table that --kernels FILE.npz reads."


def add_arguments(p) -> None:
    from shardc.commands.compile import add_routing_arguments

    p.add_argument("--out", required=True, help="the table to write (.npz)")
    p.add_argument("--grid", default="tiny", choices=["tiny", "full"],
                   help="tiny: a few points of each kernel (seconds; tests the mechanism); "
                        "full: the sizes serving needs (minutes on a GPU)")
    p.add_argument("--model", default=None,
                   help="measure this model's attention and expert shapes (.py, .onnx or HF "
                        "config.json); without it: GEMMs and a Llama-like attention only")
    p.add_argument("--device", default=None, help="torch device (default cuda if present)")
    add_routing_arguments(p)


def run(args) -> int:
    from shardc.cost.calibrate import calibrate, save_tables
    from shardc.ir.strategy import parse_routing

    out = Path(args.out)
    if out.suffix != ".npz":
        raise InputError(f"--out {args.out!r}: the table is an .npz file (--kernels reads "
                         "FILE.npz)")
    kind, alpha = parse_routing(args.routing)
    routing = kind if kind != "powerlaw" else f"powerlaw:{alpha:g}"
    graph = None
    if args.model:
        from shardc.api import load_model_graph

        graph = load_model_graph(args.model)
    tables = calibrate(args.grid, graph, routing, args.device,
                       progress=lambda what: print(f"measuring {what} ...", file=sys.stderr))
    tmp = out.with_name(out.name + ".tmp.npz")
    save_tables(tmp, tables)
    tmp.replace(out)
    n = sum(v.size for k, v in tables.items() if k.startswith(("gemm_", "ctx_", "gen_", "moe_"))
            and k in ("gemm_bf16", "gemm_fp8", "ctx_attn", "gen_attn", "moe_bf16"))
    print(f"wrote {out}: {n} measured points on {tables['system']} "
          f"({', '.join(k for k in ('gemm_bf16', 'gemm_fp8', 'ctx_attn', 'gen_attn', 'moe_bf16') if k in tables)}); "
          f"use it with --kernels {out}")
    return 0
