"""ONNX frontend: parity with the torch.export frontend, fallbacks, and one-line errors.

The tiny Llama and tiny Mixtral (experts as transformers' ``batched_mm``) are exported with
``torch.onnx.export(dynamo=True)`` here, into tmp dirs, once per module.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from shardc.cli import main as shardc_main
from shardc.errors import InputError
from shardc.frontends import graph_from_module, load_graph
from shardc.frontends.model_file import load_model_file
from shardc.frontends.onnx_frontend import ONNX_PARALLELIZE_NOTE, trace_onnx
from shardc.frontends.onnx_load import load_onnx
from shardc.ir.graph import Graph

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _tiny(name: str):
    model, inputs = load_model_file(EXAMPLES / f"{name}.py").build(tiny=True)
    if hasattr(model, "set_experts_implementation") and getattr(model.config, "num_local_experts", 0):
        model.set_experts_implementation("batched_mm")  # exportable: bmm over gathered experts
    return model, inputs


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_mixtral"])
def exported(request, tmp_path_factory):
    """(model name, torch.export IR, path of the dynamo-exported .onnx, the module)."""
    torch.set_num_threads(1)
    model, inputs = _tiny(request.param)
    torch_graph = graph_from_module(model, inputs, name=request.param)
    path = tmp_path_factory.mktemp(request.param) / f"{request.param}.onnx"
    torch.onnx.export(model, inputs, str(path), dynamo=True, verbose=False)
    return request.param, torch_graph, path, model


def _kinds(graph):
    return [(k.name, k.count, k.layers, [(o.name, o.params, o.in_features, o.out_features,
                                          o.flops_per_token) for o in k.ops])
            for k in graph.layer_kinds]


def test_parity_params_flops_layer_kinds(exported):
    name, tg, path, model = exported
    og = load_graph(path)
    # parameters: exact, same FQNs and shapes, and equal to the module's own count
    assert og.num_params == tg.num_params == sum(p.numel() for p in model.parameters())
    assert sorted((p.fqn, tuple(p.shape)) for p in og.params) == \
        sorted((p.fqn, tuple(p.shape)) for p in tg.params)
    # FLOPs per op kind within 1%
    ft, fo = tg.flops_by_kind(), og.flops_by_kind()
    for kind in set(ft) | set(fo):
        a, b = ft.get(kind, 0), fo.get(kind, 0)
        assert abs(a - b) <= 0.01 * max(a, b), (kind, a, b)
    assert fo["linear"] > 0 and fo["attention"] > 0
    # layer kinds with their fused ops, global ops and recovered config
    assert _kinds(og) == _kinds(tg)
    assert og.num_layers == 2
    if name == "tiny_mixtral":  # batched_mm experts: expert ops (not a router with all weights)
        for g in (tg, og):
            moe = g.layer_kind("moe_block")
            assert [o.name for o in moe.ops][-3:] == ["router", "expert_ffn1", "expert_ffn2"]
            assert moe.op("router").params == 4 * 64
            assert moe.op("expert_ffn1").attrs == {"num_experts": 4, "top_k": 2, "gated": True}
    assert [(o.name, o.params) for o in og.global_ops] == [(o.name, o.params) for o in tg.global_ops]
    # max_position_embeddings and model_type (the recurrent state's dtype rule) come from the
    # HF model config, which an ONNX file does not carry
    hf_only = ("max_position_embeddings", "model_type", "mamba_ssm_cache_dtype")
    assert og.config == {k: v for k, v in tg.config.items() if k not in hf_only}
    assert og.tokens == tg.tokens
    assert og.source == str(path)
    assert Graph.from_json(og.to_json()) == og


def test_parity_unoptimised_bfloat16_export(tmp_path):
    """``optimize=False`` (the only option for weightless full-size exports) keeps casts,
    Identity-clones and constant subgraphs in the file; the IR still agrees."""
    from shardc.frontends.hf_build import build_causal_lm

    torch.set_num_threads(1)
    src = load_model_file(EXAMPLES / "tiny_llama.py")
    import llama3_70b  # put on sys.path by the model-file loader

    model = build_causal_lm(llama3_70b.tiny_config(), device="cpu", dtype=torch.bfloat16)
    _, inputs = src.build(tiny=True)
    tg = graph_from_module(model, inputs)
    path = tmp_path / "bf16.onnx"
    torch.onnx.export(model, inputs, str(path), dynamo=True, optimize=False, verbose=False)
    og = load_graph(path)
    assert og.num_params == tg.num_params
    assert {p.dtype for p in og.params} == {"bfloat16"}
    ft, fo = tg.flops_by_kind(), og.flops_by_kind()
    for kind in set(ft) | set(fo):
        a, b = ft.get(kind, 0), fo.get(kind, 0)
        assert abs(a - b) <= 0.01 * max(a, b), (kind, a, b)
    assert _kinds(og) == _kinds(tg)


def test_tied_weights_and_dynamic_shapes(tmp_path):
    """Tied embedding / LM head counted once; an export with symbolic batch and sequence
    is traced at 1 x 16 tokens (the exporter's ``seq + 1`` style dims are evaluated)."""
    from shardc.frontends.hf_build import build_causal_lm

    torch.set_num_threads(1)
    src = load_model_file(EXAMPLES / "tiny_llama.py")
    import llama3_70b  # put on sys.path by the model-file loader

    config = llama3_70b.tiny_config()
    config.tie_word_embeddings = True
    model = build_causal_lm(config, device="cpu", dtype=torch.float32)
    _, inputs = src.build(tiny=True)
    assert list(inputs[0].shape) == [1, 16]
    tg = graph_from_module(model, inputs)
    path = tmp_path / "dynamic.onnx"
    example = (torch.randint(0, 256, (2, 24)),)
    torch.onnx.export(model, example, str(path), dynamo=True, verbose=False,
                      dynamic_shapes=({0: "batch", 1: "seq"},))
    og = load_graph(path)
    assert og.num_params == tg.num_params == sum(p.numel() for p in model.parameters())
    assert og.tokens == 16
    assert any("batch=1" in w and "seq=16" in w for w in og.warnings)
    assert og.flops_by_kind() == {k: v for k, v in tg.flops_by_kind().items()
                                  if k in og.flops_by_kind()}
    assert _kinds(og) == _kinds(tg)


def test_folded_transposes_map_back_to_fqns(exported):
    """The exporter's optimiser stores linear weights pre-transposed under new names
    (``val_123`` = W^T); the frontend restores the FQN and the torch [out, in] shape."""
    name, tg, path, model = exported
    onnx_model = load_onnx(path)
    fqns = {p for p, _ in model.named_parameters()}
    renamed = [i for i in onnx_model.initializers.values() if i.is_float and i.name not in fqns
               and len(i.shape) == 2]
    assert renamed, "expected constant-folded weight initializers"
    og = trace_onnx(path)
    q = next(n for n in og.nodes if n.module_path.endswith("layers.0.self_attn.q_proj"))
    weight = dict(model.named_parameters())[q.params[0].fqn]
    assert q.params[0].shape == list(weight.shape)
    assert q.target == "aten.linear.default" and q.layer == 0
    assert q.attrs["onnx_ops"] == ["MatMul"]


def test_without_torch_provenance_counts_weights_and_linears(exported, tmp_path):
    """An ONNX file with no exporter metadata: ONNX op types give the kinds, weights are
    found by use, linear FLOPs still match (the per-FX-node grouping is gone)."""
    name, tg, path, model = exported
    proto = onnx.load(str(path))
    for node in proto.graph.node:
        del node.metadata_props[:]
    del proto.graph.metadata_props[:]
    del proto.metadata_props[:]
    bare = tmp_path / "bare.onnx"
    onnx.save(proto, str(bare))
    og = load_graph(bare)
    assert any("no torch exporter signature" in w for w in og.warnings)
    assert og.flops_by_kind()["linear"] == tg.flops_by_kind()["linear"]
    assert all(n.target.startswith("onnx.") for n in og.nodes if n.op not in ("input", "output"))
    norms = sum(p.numel() for f, p in model.named_parameters() if "norm" in f)
    assert tg.num_params - norms <= og.num_params <= tg.num_params


def test_compile_same_plan_from_either_frontend(exported):
    """Same seed -> the same degrees and per-op choices from the torch and the ONNX IR
    (the RL search, a short budget)."""
    import shardc.api

    name, tg, path, model = exported
    og = load_graph(path)
    plans = [shardc.api.compile(g, mesh="8x1", search="rl", budget=64, seed=0) for g in (tg, og)]
    d0, d1 = (p.to_dict() for p in plans)
    assert d0["degrees"] == d1["degrees"]
    assert [(o["name"], o["choice"]) for o in d0["ops"]] == [(o["name"], o["choice"]) for o in d1["ops"]]


def test_inspect_onnx_json(exported, tmp_path, capsys):
    import json

    name, tg, path, model = exported
    out = tmp_path / "inspect.json"
    assert shardc_main(["inspect", str(path), "--format", "json", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["model"]["params"] == tg.num_params and doc["model"]["layers"] == 2
    assert [(k["name"], k["count"]) for k in doc["layer_kinds"]] == \
        [(k.name, k.count) for k in tg.layer_kinds]
    attention = [n for n in doc["nodes"] if n["op"] == "attention" and n["layer"] == 0]
    assert len(attention) == 1 and attention[0]["fused_op"] == "attn_core"


# ---- errors ---------------------------------------------------------------------------
def _cli(args, capsys) -> tuple[int, str]:
    code = shardc_main(args)
    err = capsys.readouterr().err
    return code, err


def test_corrupt_file_is_exit_2_one_line(tmp_path, capsys):
    bad = tmp_path / "corrupt.onnx"
    bad.write_bytes(b"\x08\x07this is not a protobuf \xff\xfe" * 20)
    code, err = _cli(["inspect", str(bad)], capsys)
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "corrupt.onnx" in err and "not a readable ONNX model" in err


def test_missing_external_data_is_exit_2_one_line(exported, tmp_path, capsys):
    name, tg, path, model = exported
    lonely = tmp_path / "alone.onnx"
    shutil.copy(path, lonely)  # the .onnx.data file stays behind
    code, err = _cli(["inspect", str(lonely)], capsys)
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "external data file" in err and f"{path.name}.data" in err


def test_truncated_external_data_is_exit_2(exported, tmp_path, capsys):
    name, tg, path, model = exported
    shutil.copy(path, tmp_path / path.name)
    data = (path.parent / f"{path.name}.data").read_bytes()
    (tmp_path / f"{path.name}.data").write_bytes(data[: len(data) // 2])
    code, err = _cli(["inspect", str(tmp_path / path.name)], capsys)
    assert code == 2 and "is truncated" in err and err.count("\n") == 1


def _tiny_graph(opset: int, extra_node=None) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])
    w = helper.make_tensor("proj.weight", TensorProto.FLOAT, [8, 8], [0.0] * 64)
    nodes = [helper.make_node("MatMul", ["x", "proj.weight"], ["h"], name="mm")]
    if extra_node is not None:
        nodes.append(extra_node)
    else:
        nodes.append(helper.make_node("Relu", ["h"], ["y"], name="act"))
    imports = [helper.make_opsetid("", opset), helper.make_opsetid("my.ops", 1)]
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y], [w]), opset_imports=imports)


def test_unsupported_opset_is_exit_2(tmp_path, capsys):
    path = tmp_path / "future.onnx"
    onnx.save(_tiny_graph(99), str(path))
    code, err = _cli(["inspect", str(path)], capsys)
    assert code == 2 and "opset 99 is not supported" in err and err.count("\n") == 1


def test_unknown_op_becomes_other_with_warning(tmp_path):
    path = tmp_path / "custom.onnx"
    custom = helper.make_node("FancyOp", ["h"], ["y"], name="fancy", domain="my.ops")
    onnx.save(_tiny_graph(17, custom), str(path))
    g = load_graph(path)
    ops = {n.name: n.op for n in g.nodes}
    assert ops["mm"] == "linear" and ops["fancy"] == "other"
    assert g.num_params == 64
    assert any("my.ops" in w for w in g.warnings)
    assert g.node("mm").flops == 2 * 4 * 8 * 8


def test_missing_file_and_note():
    with pytest.raises(InputError, match="no such file"):
        load_graph("/nonexistent/model.onnx")
    assert "parallelize.py is not" in ONNX_PARALLELIZE_NOTE
