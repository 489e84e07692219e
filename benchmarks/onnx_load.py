"""Benchmark: load a full-size (Llama-3-8B shape) ONNX graph into the shardc IR.

No real weights exist anywhere. The HF Llama-3-8B architecture is built on the ``meta``
device in bfloat16 and exported with ``torch.onnx.export(dynamo=True, optimize=False)``
(the exporter's optimiser constant-folds, which needs weight data). The graph is saved
without initializers, then every parameter is added back as an ONNX initializer whose data
is *external*: a region of one sparse ``weights.bin`` (``truncate``d to 16 GB, no disk
blocks used). That is exactly what a real exported 8B model with external data looks like
to a loader that does not read weights -- and shardc's ONNX frontend never does.

Usage::

    .venv/bin/python benchmarks/onnx_load.py            # export into a temp dir, then time the load
    .venv/bin/python benchmarks/onnx_load.py --keep DIR # keep the .onnx (never commit it)

Prints the export time (s), the load time (s: ``load_onnx_graph`` = read + checks + shape
inference + IR + passes), node / parameter / layer counts.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import onnx
import torch
from onnx import TensorProto
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardc.frontends.hf_build import build_causal_lm  # noqa: E402

_ONNX_TYPE = {torch.bfloat16: TensorProto.BFLOAT16, torch.float32: TensorProto.FLOAT,
              torch.float16: TensorProto.FLOAT16, torch.int64: TensorProto.INT64}


def llama3_8b_config(layers: int = 32) -> LlamaConfig:
    """Llama-3-8B: hidden 4096, 32/8 heads, ffn 14336, vocab 128256 (8.03e9 parameters)."""
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                       tie_word_embeddings=False)


def export_weightless(out_dir: Path, layers: int = 32, seq: int = 16) -> Path:
    """Export Llama-3-8B (meta weights) to ``out_dir/llama3_8b.onnx`` + sparse external data."""
    model = build_causal_lm(llama3_8b_config(layers), device="meta")
    ids = torch.zeros((1, seq), dtype=torch.int64, device="meta")
    program = torch.onnx.export(model, (ids,), dynamo=True, optimize=False, verbose=False)
    path = out_dir / "llama3_8b.onnx"
    program.save(str(path), include_initializers=False)
    proto = onnx.load_model(str(path), load_external_data=False)
    offset = 0
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    referenced = {i for n in proto.graph.node for i in n.input}
    for name, t in tensors.items():
        if name not in referenced:
            continue
        tp = TensorProto(name=name, dims=list(t.shape), data_type=_ONNX_TYPE[t.dtype])
        length = t.numel() * t.element_size()
        tp.data_location = TensorProto.EXTERNAL
        for key, value in (("location", "weights.bin"), ("offset", str(offset)),
                           ("length", str(length))):
            entry = tp.external_data.add()
            entry.key, entry.value = key, value
        proto.graph.initializer.append(tp)
        offset += length
    with open(out_dir / "weights.bin", "wb") as f:
        f.truncate(offset)  # sparse: no blocks written
    onnx.save_model(proto, str(path))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--keep", help="directory to keep the exported model in")
    ap.add_argument("--compare", action="store_true",
                    help="also trace the same model with the torch.export frontend and compare "
                         "parameters, FLOPs per kind and layer kinds")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.keep) if args.keep else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        path = export_weightless(out, args.layers)
        export_s = time.perf_counter() - t0
        size_mb = os.path.getsize(path) / 1e6
        from shardc.frontends.onnx_frontend import load_onnx_graph

        t0 = time.perf_counter()
        graph = load_onnx_graph(path)
        load_s = time.perf_counter() - t0
        print(f"export (meta, dynamo, optimize=False): {export_s:.1f} s; model file {size_mb:.1f} MB "
              f"+ sparse weights.bin {os.path.getsize(out / 'weights.bin') / 1e9:.2f} GB")
        print(f"trace_onnx load: {load_s:.2f} s; {len(graph.nodes)} IR nodes, "
              f"{graph.num_params:,} parameters, {graph.num_layers} layers "
              f"{[(k.name, k.count) for k in graph.layer_kinds]}")
        for w in graph.warnings:
            print("warning:", w)
        if args.compare:
            from shardc.frontends import graph_from_module

            t0 = time.perf_counter()
            tg = graph_from_module(build_causal_lm(llama3_8b_config(args.layers), device="meta"),
                                   (torch.zeros((1, 16), dtype=torch.int64),))
            print(f"torch.export frontend: {time.perf_counter() - t0:.1f} s; "
                  f"{tg.num_params:,} parameters, {[(k.name, k.count) for k in tg.layer_kinds]}")
            fo, ft = graph.flops_by_kind(), tg.flops_by_kind()
            for kind in sorted(set(fo) | set(ft)):
                if fo.get(kind) or ft.get(kind):
                    print(f"  {kind:15s} onnx {fo.get(kind, 0):>16,}  torch {ft.get(kind, 0):>16,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
