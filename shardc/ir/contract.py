"""The sharding contract: what each per-op choice means, in one place.

Every consumer of a strategy -- the search space (legality), the cost model (execution
modes and repair collectives), the annotation pass (placements on the IR), plan.json, the
DTensor backend (which torch ParallelStyle realises a choice, which weight dim it cuts) --
reads this module and nothing else re-derives it.

One :class:`OpChoice` per (fused op, choice index):

* ``need`` / ``produces``: the activation placement the op needs on its input and the one
  it produces, on the tp mesh dim (``R``, ``S(0)`` tokens, ``S(1)`` features/heads, ``P``
  partial sums; :data:`FOLLOW` = a replicated weight that passes ``R`` / ``S(0)`` through);
* ``weight_split``: which logical weight dim the tp group cuts (``"out"`` / ``"in"`` features
  of a linear, ``"vocab"`` / ``"hidden"`` of the embedding table, ``"heads"``, or None);
  the backend maps it to the physical dim of each parameter's layout;
* ``cost_mode``: how tokens, FLOPs and bytes divide over tp (:data:`MODES`,
  :data:`MODE_EXPONENTS`); a replicated op on a token-split input runs ``token_split``;
* ``requires``: the divisibility that makes it legal at a tp degree (:func:`legal`);
* ``parallel_style``: the torch ParallelStyle (or shardc's own style, for what torch lacks)
  that realises it (None: the weight stays replicated).

:func:`walk` follows a branch (:data:`BRANCHES`: residual -> ops -> residual) for given
choices and yields, per op, the placement it needs, the one it produces, the repair
collective before it, and the repair at the branch end -- the one walk the cost tables,
the annotation pass, plan.json and the runtime all use.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

# ------------------------------------------------------------------ choice vocabulary
# Choice index i of every fused op: 0 = shard weight dim 0, 1 = shard weight dim 1, 2 = none.
NUM_CHOICES = 3
FOLLOW = "FOLLOW"

# cost modes: exponent of tp dividing (tokens, flops, weight bytes, input bytes, output bytes)
MODES = ("shard_out", "shard_in", "shard_both", "replicated", "token_split")
SHARD_OUT, SHARD_IN, SHARD_BOTH, REPLICATED, TOKEN_SPLIT = range(len(MODES))
MODE_EXPONENTS = np.array([
    [0, 1, 1, 0, 1],  # shard_out: column-parallel (weight split on output features)
    [0, 1, 1, 1, 0],  # shard_in: row-parallel (input features split, partial output)
    [0, 1, 1, 1, 1],  # shard_both: attention by heads (input and output split)
    [0, 0, 0, 0, 0],  # replicated weight, replicated input: every rank does all the work
    [1, 1, 0, 1, 1],  # replicated weight, tokens (sequences) split over the tp group
], dtype=np.int64)


@dataclass(frozen=True)
class OpChoice:
    """One choice of one fused op (see the module docstring for the fields)."""

    op: str
    index: int
    name: str
    need: str
    produces: str
    weight_split: str | None
    cost_mode: int  # index into MODES (REPLICATED resolves to TOKEN_SPLIT on an S(0) input)
    requires: str  # "heads" | "in" | "out" | "" : what tp must divide
    parallel_style: str | None


def _linear(op: str) -> tuple[OpChoice, ...]:
    """A linear with weight [out, in]: column parallel / row parallel / replicated."""
    return (OpChoice(op, 0, "col", "R", "S(1)", "out", SHARD_OUT, "out", "ColwiseParallel"),
            OpChoice(op, 1, "row", "S(1)", "P", "in", SHARD_IN, "in", "RowwiseParallel"),
            OpChoice(op, 2, "rep", FOLLOW, FOLLOW, None, REPLICATED, "", None))


_TABLE: dict[str, tuple[OpChoice, ...]] = {
    # embedding [vocab, hidden]: vocab-parallel lookup (partial sums) / hidden split / none
    "embedding": (
        OpChoice("embedding", 0, "vocab", "R", "P", "vocab", SHARD_OUT, "in", "RowwiseParallel"),
        OpChoice("embedding", 1, "hidden", "R", "S(1)", "hidden", SHARD_OUT, "out",
                 "ColwiseParallel"),
        OpChoice("embedding", 2, "rep", FOLLOW, FOLLOW, None, REPLICATED, "", None)),
    # the attention core has no weight: heads split / sequences split / none
    "attn_core": (
        OpChoice("attn_core", 0, "heads", "S(1)", "S(1)", "heads", SHARD_BOTH, "heads",
                 "HeadParallelAttention"),
        OpChoice("attn_core", 1, "batch", "S(0)", "S(0)", None, TOKEN_SPLIT, "",
                 "BatchSplitAttention"),
        OpChoice("attn_core", 2, "rep", FOLLOW, FOLLOW, None, REPLICATED, "", None)),
}
for _op in ("qkv", "out_proj", "ffn1", "ffn2", "router", "expert_ffn1", "expert_ffn2",
            "shared_ffn1", "shared_ffn2", "lm_head"):
    _TABLE[_op] = _linear(_op)
# a column split of qkv cuts whole heads (GQA groups stay whole); a row split of out_proj
# consumes head-split input
_qkv, _out = _TABLE["qkv"], _TABLE["out_proj"]
_TABLE["qkv"] = (replace(_qkv[0], requires="heads"), _qkv[1], _qkv[2])
_TABLE["out_proj"] = (_out[0], replace(_out[1], requires="heads"), _out[2])

CHOICE_NAMES: dict[str, tuple[str, ...]] = {op: tuple(c.name for c in cs)
                                            for op, cs in _TABLE.items()}


def op_choice(op: str, index: int) -> OpChoice:
    """The record of choice ``index`` of fused op ``op``."""
    return _TABLE[op][index]


def choice_name(op: str, index: int) -> str:
    return _TABLE[op][index].name


def kv_head_replicas(tp, kv_heads: int):
    """Ranks holding each KV head under a heads split at tensor-parallel degree ``tp``
    (scalar or array): 1 when tp divides the KV heads; ``tp / kv_heads`` when tp is a
    multiple of them -- GQA with tp > kv_heads, where each rank keeps the one KV head its
    query heads read and each KV head is replicated over ``tp / kv_heads`` ranks (as vLLM
    does), instead of replicating the whole attention."""
    return np.maximum(np.asarray(tp) // max(int(kv_heads), 1), 1)


def repeated_kv_growth(core_attrs: dict, qkv_out_features: int, tp):
    """qkv's output grown by repeating each KV head over its :func:`kv_head_replicas` ranks
    (scalar or array ``tp``): ``1 + kv_share x (replicas - 1)``, ``kv_share`` = the K/V
    fraction of qkv's output features; 1 where no KV head is replicated (tp divides the KV
    heads, no GQA, an MLA latent or a recurrent core)."""
    a = core_attrs or {}
    heads = int(a.get("heads", 1) or 1)
    kv = int(a.get("kv_heads", heads) or heads)
    if kv >= heads or not a.get("kv_cache_split_by_heads", True) or a.get("recurrent"):
        return np.ones_like(np.asarray(tp, dtype=np.float64))
    share = min(2.0 * kv * int(a.get("head_dim", 0)) / max(int(qkv_out_features or 1), 1), 1.0)
    return 1.0 + share * (kv_head_replicas(tp, kv).astype(np.float64) - 1.0)


def legal(choice: OpChoice, tp: int, in_features: int, out_features: int, heads: int,
          kv_heads: int, replicate_kv_heads: bool = True) -> bool:
    """Whether ``choice`` is legal at tensor-parallel degree ``tp`` for an op of these
    features. A heads split needs tp | heads and either tp | kv_heads (GQA groups stay whole)
    or, with ``replicate_kv_heads``, kv_heads | tp (each KV head held by tp / kv_heads ranks,
    :func:`kv_head_replicas`)."""
    if choice.requires == "heads":
        kv_ok = kv_heads % tp == 0 or (replicate_kv_heads and tp % kv_heads == 0)
        return heads % tp == 0 and kv_ok
    if choice.requires == "in":
        return in_features % tp == 0
    if choice.requires == "out":
        return out_features % tp == 0
    return True


def cost_mode(choice: OpChoice, need: str) -> int:
    """Execution mode (index into :data:`MODES`) of ``choice`` given the input it consumes."""
    if choice.cost_mode == REPLICATED and need == "S(0)":
        return TOKEN_SPLIT
    return choice.cost_mode


# ----------------------------------------------------------------------- placements
PLACEMENTS = ("R", "S(0)", "S(1)", "P")
# src -> dst placement on one mesh dim: the collective that repairs it (None = local).
_REDISTRIBUTION = {
    ("S(0)", "R"): "all_gather",
    ("S(1)", "R"): "all_gather",
    ("S(0)", "S(1)"): "all_to_all",
    ("S(1)", "S(0)"): "all_to_all",
    ("P", "R"): "all_reduce",
    ("P", "S(0)"): "reduce_scatter",
    ("P", "S(1)"): "reduce_scatter",
}


def op_placements(op: str, choice: int, incoming: str) -> tuple[str, str]:
    """(placement the op needs on its input, placement of its output) on the tp dim,
    given the placement ``incoming`` arriving at it. For FOLLOW ops an ``R``/``S(0)``
    input passes through; ``S(1)``/``P`` inputs are first made ``R``."""
    c = _TABLE[op][choice]
    need, out = c.need, c.produces
    if need == FOLLOW:
        need = incoming if incoming in ("R", "S(0)") else "R"
        out = need
    return need, out


def redistribution(src: str, dst: str) -> str | None:
    """Collective turning placement ``src`` into ``dst`` on one mesh dim (None: local,
    e.g. R -> S(d) is a slice). The byte count is the full (unsharded) tensor size over
    that dim; :mod:`shardc.cost.collectives` gives the time."""
    if src == dst or src == "R":
        return None
    try:
        return _REDISTRIBUTION[(src, dst)]
    except KeyError:
        raise ValueError(f"no redistribution from {src} to {dst}") from None


def dtensor_spelling(p: str) -> str:
    """Placement as plan.json spells it (``P`` -> ``P(sum)``)."""
    return "P(sum)" if p == "P" else p


# ------------------------------------------------------------------------- branches
# Each branch reads the (normed) residual stream and adds back into it.
BRANCHES: dict[str, tuple[str, ...]] = {
    "attention": ("qkv", "attn_core", "out_proj"),
    "mlp": ("ffn1", "ffn2"),
    "router": ("router",),
    "experts": ("expert_ffn1", "expert_ffn2"),  # between ep all-to-all dispatch and combine
    "shared_experts": ("shared_ffn1", "shared_ffn2"),
}
GLOBAL_OPS = ("embedding", "lm_head")


def branch_ends(branch: str, residual: str) -> tuple[str, str]:
    """(placement arriving at the branch's first op, placement required after its last):
    layer branches start and end at the residual; ``embedding`` starts from replicated
    token ids; ``lm_head`` ends with gathered (replicated) logits."""
    if branch == "embedding":
        return "R", residual
    if branch == "lm_head":
        return residual, "R"
    return residual, residual


@dataclass(frozen=True)
class Step:
    """One op of a walked branch: the choice, the placement it needs and produces, the
    repair collective before it (``(src, dst, collective)`` or None) and the placement its
    output is moved to before anything reads it (the next op's need, or the branch end)."""

    op: str
    choice: OpChoice
    need: str
    produced: str
    repair: tuple[str, str, str] | None
    after: str

    @property
    def mode(self) -> int:
        return cost_mode(self.choice, self.need)


@dataclass(frozen=True)
class Walk:
    steps: tuple[Step, ...]
    end_repair: tuple[str, str, str] | None  # (src, dst, collective) after the last op

    def collectives(self) -> list[tuple[str, str, str, str]]:
        """[(before_op, src, dst, collective)] for every repair; ``"<end>"`` for the end."""
        out = [(s.op, *s.repair) for s in self.steps if s.repair]
        if self.end_repair:
            out.append(("<end>", *self.end_repair))
        return out


def walk(ops: tuple[str, ...], choices, start: str, end: str) -> Walk:
    """Walk a branch of ``ops`` at ``choices`` from placement ``start`` to ``end``."""
    steps, cur = [], start
    for op, c in zip(ops, choices):
        need, produced = op_placements(op, int(c), cur)
        coll = redistribution(cur, need)
        steps.append([op, _TABLE[op][int(c)], need, produced,
                      (cur, need, coll) if coll else None, None])
        cur = produced
    for i, s in enumerate(steps):
        s[5] = steps[i + 1][2] if i + 1 < len(steps) else end
    coll = redistribution(cur, end)
    return Walk(tuple(Step(*s) for s in steps), (cur, end, coll) if coll else None)


def branch_collectives(ops: tuple[str, ...], choices, start: str, end: str
                       ) -> list[tuple[str, str, str, str]]:
    """``walk(...).collectives()``: [(before_op, src, dst, collective)] for every repair."""
    return walk(ops, choices, start, end).collectives()
