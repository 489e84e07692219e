"""Small constructed search problems with a known optimum (tests, the gym demo).

:func:`toy_graph` builds an IR :class:`~shardc.ir.graph.Graph` with the fused-op structure
of a GPT-MoE block (qkv, attn_core, out_proj, router, expert ffn1/ffn2, embedding, lm_head)
but no nodes; :class:`SyntheticObjective` is a seeded, structured stand-in for the cost
model (a per-component score table plus tp x op interactions, infeasible above a
batch-vs-GPUs "memory" limit), cheap enough to enumerate so its optimum is exact.
"""

from __future__ import annotations

import numpy as np

from shardc.ir.graph import FusedOp, Graph, LayerKind
from shardc.ir.space import StrategySpace
from shardc.ir.strategy import Mesh, Workload
from shardc.search.legal import BATCH, N_DEG, TP


def toy_graph(layers: int = 8, hidden: int = 1024, heads: int = 16, experts: int = 8,
              ffn: int = 4096, vocab: int = 32000) -> Graph:
    """A GPT-MoE-shaped graph (fused ops and config only) for search tests."""
    qkv = FusedOp("qkv", hidden, 3 * hidden, 3 * hidden * hidden, 3 * hidden * hidden,
                  6 * hidden * hidden)
    core = FusedOp("attn_core", hidden, hidden, attrs={"heads": heads, "kv_heads": heads,
                                                       "head_dim": hidden // heads})
    out = FusedOp("out_proj", hidden, hidden, hidden * hidden, hidden * hidden, 2 * hidden * hidden)
    router = FusedOp("router", hidden, experts, hidden * experts, hidden * experts,
                     2 * hidden * experts)
    e1 = FusedOp("expert_ffn1", hidden, ffn, experts * hidden * ffn, experts * hidden * ffn,
                 4 * hidden * ffn, attrs={"num_experts": experts, "top_k": 2})
    e2 = FusedOp("expert_ffn2", ffn, hidden, experts * hidden * ffn, experts * hidden * ffn,
                 4 * hidden * ffn, attrs={"num_experts": experts, "top_k": 2})
    kind = LayerKind("moe_block", layers, list(range(layers)), [qkv, core, out, router, e1, e2])
    emb = FusedOp("embedding", vocab, hidden, vocab * hidden, vocab * hidden, 0)
    head = FusedOp("lm_head", hidden, vocab, vocab * hidden, vocab * hidden, 2 * vocab * hidden)
    return Graph(name="toy_moe", layer_kinds=[kind], global_ops=[emb, head],
                 config={"hidden": hidden, "heads": heads, "num_experts": experts,
                         "num_layers": layers, "vocab": vocab})


def toy_space(mesh: str = "8x1", phase: str = "decode", **graph_kw) -> StrategySpace:
    return StrategySpace(toy_graph(**graph_kw), Mesh.parse(mesh), Workload(phase=phase))


class SyntheticObjective:
    """value = 100 * exp(score), score = sum of per-component table entries + tp x op
    interactions (tok/s/GPU-like magnitudes); infeasible when the batch index exceeds
    ``slack + log2(tp * ep * pp)`` (a memory-like limit that more GPUs per replica relax)."""

    def __init__(self, space: StrategySpace, seed: int = 0, slack: int = 6):
        rng = np.random.default_rng(seed)
        self.space = space
        self.nvec = np.asarray(space.nvec)
        self.tables = [rng.normal(0.0, 0.25, size=n) for n in self.nvec]
        # larger batch is better until the limit, so the optimum sits on the feasibility edge
        self.tables[BATCH] = np.linspace(0.0, 1.5, self.nvec[BATCH])
        n_tp, n_slots = self.nvec[TP], len(self.nvec) - N_DEG
        self.inter = rng.normal(0.0, 0.2, size=(n_tp, n_slots, 3))
        self.slack = slack

    def __call__(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        a = np.atleast_2d(actions)
        score = np.zeros(a.shape[0])
        for j, t in enumerate(self.tables):
            score += t[a[:, j]]
        ops = a[:, N_DEG:]
        slots = np.arange(ops.shape[1])
        score += self.inter[a[:, TP][:, None], slots[None, :], ops].sum(axis=1)
        d = self.space.degree_arrays(a)
        replica = d["tp"] * d["ep"] * d["pp"]
        feasible = a[:, BATCH] <= self.slack + np.log2(replica)
        return 100.0 * np.exp(score), feasible
