"""ONNX operator types -> canonical op kinds (:data:`shardc.ir.graph.OP_KINDS`).

Used for ONNX nodes that carry no torch provenance (files from other exporters, or
hand-built graphs). Nodes lowered by the torch dynamo exporter are instead grouped per
original FX node and classified by their aten op, exactly as the torch.export frontend is.
"""

from __future__ import annotations

ONNX_KIND: dict[str, str] = {}


def _put(kind: str, ops: str) -> None:
    for op in ops.split():
        ONNX_KIND[op] = kind


_put("matmul", "MatMul Gemm MatMulInteger QLinearMatMul Einsum")
_put("norm", "LayerNormalization RMSNormalization SimplifiedLayerNormalization "
             "SkipLayerNormalization SkipSimplifiedLayerNormalization GroupNormalization "
             "BatchNormalization InstanceNormalization LpNormalization")
_put("activation", "Relu Gelu FastGelu Sigmoid HardSigmoid Silu Swish Tanh Softmax LogSoftmax "
                   "Softplus Elu Selu LeakyRelu Mish HardSwish QuickGelu")
_put("elementwise", "Add Sub Mul Div Pow Sqrt Reciprocal Neg Exp Log Abs Cos Sin Erf Where "
                    "Max Min Mod Floor Ceil Round Clip Sign Equal Less Greater LessOrEqual "
                    "GreaterOrEqual And Or Not Xor IsNaN IsInf Cast CastLike Concat Trilu "
                    "Range CumSum BitShift")
_put("reduction", "ReduceMean ReduceSum ReduceMax ReduceMin ReduceProd ReduceL2 "
                  "ReduceSumSquare ReduceLogSumExp ArgMax ArgMin")
_put("view", "Reshape Transpose Squeeze Unsqueeze Flatten Expand Slice Split Identity Shape "
             "Size Tile Pad ConstantOfShape Constant Dropout")
_put("gather_scatter", "Gather GatherND GatherElements ScatterND ScatterElements Scatter "
                       "OneHot NonZero Compress")
_put("router", "TopK")
_put("attention", "Attention MultiHeadAttention GroupQueryAttention")
_put("grouped_matmul", "MoE QMoE")

# View-like ops that, applied to a parameter, yield an alias of it (the parameter is then
# attributed to the consuming node, as the torch.export frontend does).
PARAM_VIEW_OPS = frozenset("Transpose Reshape Cast CastLike Identity Unsqueeze Squeeze "
                           "Flatten".split())


def onnx_kind(op_type: str, domain: str = "") -> str:
    """Canonical kind of an ONNX op type; ``"other"`` for unknown ops or domains."""
    if domain not in ("", "ai.onnx", "com.microsoft"):
        return "other"
    return ONNX_KIND.get(op_type, "other")
