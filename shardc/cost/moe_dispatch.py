"""The MoE token exchange as served: dispatch and combine over ep, priced by direction,
mode and topology, on the tensor layout the tp group holds (vectorised over strategies).

Units: seconds, bytes, rows (one row = one token's hidden vector). Notation as
:mod:`shardc.cost.layer_costs`: ``T`` tokens per attention group, ``k`` = top_k, ``E``
routed experts, the ep communicator of ``n`` ranks, ``g`` per node over ``N`` nodes.

**Modes** (DeepEP's two kernels, as SGLang / vLLM serve DeepSeek-style MoE):

* prefill, *normal mode*: a token is sent once to each node hosting >= 1 of its top-k
  experts (over the NIC, to the GPU of the same local index) and forwarded inside the node
  over NVLink once to each rank hosting >= 1 of them. With experts spread evenly and the
  top-k drawn without replacement, a given node (rank) is hit with probability
  ``p = 1 - C(E - E/N, k) / C(E, k)`` (``E/n`` for a rank), so per token
  ``NIC rows = (N - 1) p_node`` and ``NVLink rows = p_rank ((g - 1) + (n - g)(g - 1)/g)``
  (direct sends inside the own node + forwarding of the rows other nodes land on this GPU).
  Latency: the per-rank counts are exchanged first (one round, ``a0 + hop``), then the
  data as an all-to-all (``a0 + (n - 1) a_peer + hop``, :func:`shardc.cost.collectives.all_to_all`).
* decode, *low-latency mode*: every (token, expert) copy goes straight to the expert's rank
  (GPU-initiated RDMA, no deduplication, all peers at once): ``k (n - g) / n`` rows per
  token over the NIC, ``k (g - 1) / n`` over NVLink; latency ``a0 + hop`` (no per-peer
  term: the sends to all peers are issued concurrently).

Both: NVLink and NIC run concurrently; the busiest *receiving* rank gets ``imbalance`` x
the mean rows, so the transfer takes ``imbalance x max(NVLink bytes / B_nv, NIC bytes /
B_nic)``; its receive phase then reads every received row once from HBM (dispatch copies
it into the expert-major buffer, combine reduces the k copies of a token):
``memory_time(imbalance x received bytes)``. The combine moves the same rows back.

**Bytes per row**: dispatch in FP8 (option) is ``hidden`` bytes plus one fp32 scale per
128 channels (DeepEP's per-block scaling); otherwise, and for the combine, ``hidden x
act_bytes``.

**Layout** (the tp group's view of the tensor that crosses): a token-split (``S(0)``) or
hidden-split (``S(1)``) tensor crosses at ``1/tp`` of the bytes, a replicated or partial
(``P``) one at all of them. The dispatch crosses at a placement ``X`` reached from the
residual before it (on ``T`` rows), repaired to the first expert op's input placement on
the receiving side (on ``T_e`` rows); the combine crosses at a placement ``Y`` the last
expert op's output reaches (on ``T_e`` rows), repaired to the residual after the weighted
top-k sum, on ``T`` rows -- so a tp all-reduce of the expert outputs is charged on ``T``
rows, not ``T x top_k``. Which ``X`` / ``Y`` (:data:`LAYOUT_RULES`):

* ``"backend"`` (default; what shardc's runtimes execute): ``X`` = the residual placement
  (a sequence-parallel residual crosses at ``1/tp``); ``Y`` = the residual placement, or
  ``P`` when the experts end in partial sums under a replicated residual (the partial sums
  cross, the all-reduce follows the top-k sum);
* ``"best"``: the cheapest reachable ``X`` and ``Y`` per strategy: ``R`` -> anything is a
  local slice, so the reduce-scatter / all-gather deduplication (each tp rank sends only
  its ``1/tp`` of the tokens, or of the hidden vector) is available to every layout, as
  serving engines that scatter the MoE input over the tp group do (a what-if until the
  runtime does the same: the cost model must price what the emitted code runs).

The ``bytes`` reported for the dispatch and combine are the routed bytes ``T_x x top_k x
row bytes`` (what a plain all-to-all of the layout carries); the seconds are the served
kernel's above.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from shardc.cost import collectives as coll
from shardc.cost.roofline import memory_time
from shardc.cost.topology import CommGroup
from shardc.ir.contract import redistribution, walk

FP8_SCALE_BLOCK = 128  # channels per fp32 scale in an FP8 dispatch (DeepEP's layout)
FP8_SCALE_BYTES = 4.0
PLACES = ("R", "S(0)", "S(1)", "P")
_R, _S0, _S1, _P = range(len(PLACES))
_IMPOSSIBLE = -1
LAYOUT_RULES = ("backend", "best")


def fp8_dispatch_row_bytes(hidden: float) -> float:
    """Bytes of one FP8-dispatched row of ``hidden`` channels (values + block scales)."""
    return hidden * (1.0 + FP8_SCALE_BYTES / FP8_SCALE_BLOCK)


def _repair_code(src: str, dst: str) -> int:
    """Collective code (:data:`shardc.cost.collectives.COLLECTIVE_KINDS`) moving ``src`` to
    ``dst`` on the tp dim, 0 if local, :data:`_IMPOSSIBLE` if no collective makes it (only a
    partial sum is a partial sum)."""
    if dst == "P":
        return 0 if src == "P" else _IMPOSSIBLE
    kind = redistribution(src, dst)
    return 0 if kind is None else coll.COLLECTIVE_KINDS.index(kind)


REPAIR = np.array([[_repair_code(s, d) for d in PLACES] for s in PLACES], dtype=np.int64)
# bytes divisor of a tensor crossing at each placement: 1/tp when split over tp
_SPLIT = np.array([False, True, True, False])


@lru_cache(maxsize=None)
def _layout(ops: tuple[str, ...]) -> np.ndarray:
    """[3**m, 2 residuals, 2] placement indices of (the first expert op's input, the last
    op's output) for every choice combination of the experts branch."""
    m = len(ops)
    out = np.zeros((3**m, 2, 2), dtype=np.int64)
    for idx in range(3**m):
        choices = [(idx // 3**j) % 3 for j in range(m)]
        for r, res in enumerate(("R", "S(0)")):
            w = walk(ops, choices, res, res)
            out[idx, r] = PLACES.index(w.steps[0].need), PLACES.index(w.steps[-1].produced)
    return out


def _hit_probability(experts: float, per_group: np.ndarray, k: int) -> np.ndarray:
    """P(a group holding ``per_group`` of the ``experts`` experts holds >= 1 of a token's
    ``k`` distinct experts): ``1 - C(experts - per_group, k) / C(experts, k)``."""
    miss = np.ones_like(per_group, dtype=np.float64)
    for i in range(k):
        miss = miss * np.clip((experts - per_group - i) / (experts - i), 0.0, 1.0)
    return 1.0 - miss


def exchange_rows(mode: str, group: CommGroup, num_experts: int, top_k: int):
    """Rows one rank sends per token it exchanges: ``(nvlink, nic, total)`` arrays
    (``total`` includes the rows that stay on the rank). ``mode`` = ``"normal"`` or
    ``"low_latency"`` (module docstring)."""
    n = group.size.astype(np.float64)
    g = group.per_node.astype(np.float64)
    N = group.nodes.astype(np.float64)
    k = float(top_k)
    if mode == "low_latency":
        return k * (g - 1) / n, k * (n - g) / n, np.full_like(n, k)
    E = float(max(num_experts, top_k, 1))
    p_rank = _hit_probability(E, E / n, top_k)
    p_node = _hit_probability(E, E / N, top_k)
    nvlink = p_rank * ((g - 1) + (n - g) * (g - 1) / g)
    return nvlink, (N - 1) * p_node, p_rank * n


def exchange_time(mode: str, tokens, row_bytes, group: CommGroup, num_experts: int,
                  top_k: int, imbalance, hw) -> tuple[np.ndarray, np.ndarray]:
    """(seconds, routed bytes) of one dispatch or combine of ``tokens`` tokens of
    ``row_bytes`` each over the ep ``group`` (module docstring; 0 where ``n == 1``).
    The routed bytes are ``tokens x top_k x row_bytes``, what a plain all-to-all of the
    layout carries (the backend's own exchange); the seconds are the served kernel's, which
    in normal mode moves fewer (deduplicated) rows."""
    nv_rows, nic_rows, all_rows = exchange_rows(mode, group, num_experts, top_k)
    tokens = np.asarray(tokens, dtype=np.float64)
    row_bytes = np.asarray(row_bytes, dtype=np.float64)
    imb = np.asarray(imbalance, dtype=np.float64)
    nodes = group.nodes
    hop = np.where(nodes > 1, hw.net_hop_us, hw.nvlink_hop_us) * 1e-6
    a0 = hw.collective_base_us * 1e-6
    if mode == "low_latency":
        lat = a0 + hop
    else:  # a count-exchange round, then the data as an all-to-all
        lat = 2 * (a0 + hop) + (group.size - 1) * hw.a2a_peer_us * 1e-6
    wire = imb * np.maximum(tokens * nv_rows * row_bytes / hw.nvlink_bytes_s,
                            tokens * nic_rows * row_bytes / hw.nic_bytes_s)
    received = imb * tokens * all_rows * row_bytes
    t = lat + wire + memory_time(received, hw)
    sent = tokens * top_k * row_bytes
    return np.where(group.size > 1, t, 0.0), np.where(group.size > 1, sent, 0.0)


def _coll_table(S, group: CommGroup, hw) -> np.ndarray:
    """[len(COLLECTIVE_KINDS) + 1, B] seconds of every tp repair on ``S`` full-tensor bytes;
    the last row (index :data:`_IMPOSSIBLE`) is +inf."""
    ag = coll.all_gather(S, group, hw)
    return np.stack([np.zeros_like(ag), ag, coll.reduce_scatter(S, group, hw),
                     coll.all_reduce(S, group, hw), coll.all_to_all(S / group.size, group, hw),
                     np.full_like(ag, np.inf)])


def _pick(table: np.ndarray, codes: np.ndarray) -> np.ndarray:
    return table[codes, np.arange(codes.shape[0])]


def experts_exchange(ops: tuple[str, ...], combo: np.ndarray, b, detail: bool = False):
    """Seconds of the experts branch's exchange for each strategy: the tp repair before the
    dispatch (on ``T`` rows), the dispatch, the repair to the first expert op's input (on
    ``T_e`` rows), and after the experts the repair before the combine (``T_e`` rows), the
    combine and the repair to the residual after the weighted top-k sum (``T`` rows).

    ``b`` is a :class:`shardc.cost.layer_costs.Batch`. Returns ``(time [B], rows)``; with
    ``detail`` ``rows`` = ``[(before_op, code [B], mesh dim, bytes [B], seconds [B])]`` in
    execution order (before_op: ``"before dispatch"``, ``"dispatch"``, the first expert op,
    ``"<end>"``, ``"combine"``, ``"after combine"``), else ``[]``."""
    res = b.residual
    B = res.shape[0]
    lay = _layout(tuple(ops))[combo, res]  # [B, 2]
    need, produced = lay[:, 0], lay[:, 1]
    res_p = np.where(res == 1, _S0, _R)
    tp_group, ep_group = b.groups["tp"], b.groups["ep"]
    T, T_e = b.tokens, b.expert_tokens
    hidden, ab, tp = float(b.hidden), float(b.act_bytes), b.tp
    on_T = _coll_table(T * hidden * ab, tp_group, b.hw)
    on_Te = _coll_table(T_e * hidden * ab, tp_group, b.hw)
    mode = "low_latency" if b.phase == "decode" else "normal"
    imb = b.expert_imbalance
    d_row = fp8_dispatch_row_bytes(hidden) if b.fp8_dispatch else hidden * ab
    E, k = b.num_experts, b.top_k

    free = b.moe_layouts == "best"
    combine_at = np.where((produced == _P) & (res_p == _R), _P, res_p)  # the backend's Y

    def best(places, chosen, before_codes, before_tab, after_codes, after_tab, row_bytes):
        cand = []
        for x in places:
            c1, c2 = before_codes(x), after_codes(x)
            if not free:  # only the backend's placement is a candidate
                c1 = np.where(chosen == x, c1, _IMPOSSIBLE)
            div = tp if _SPLIT[x] else 1.0
            a2a, sent = exchange_time(mode, T / div, row_bytes, ep_group, E, k, imb, b.hw)
            cand.append((_pick(before_tab, c1) + a2a + _pick(after_tab, c2), c1, c2, a2a, sent))
        totals = np.stack([c[0] for c in cand])
        i = np.argmin(totals, axis=0)
        ar = np.arange(B)
        parts = [np.stack([c[j] for c in cand])[i, ar] for j in range(5)]
        return parts

    # dispatch at X: residual -> X on T rows (before), X -> first op's input on T_e rows (after)
    d_tot, d_c1, d_c2, d_t, d_sent = best(
        (_R, _S0, _S1), res_p, lambda x: REPAIR[res_p, x], on_T, lambda x: REPAIR[x, need], on_Te,
        d_row)
    # combine at Y: last op's output -> Y on T_e rows (before), Y -> residual on T rows (after)
    c_tot, c_c1, c_c2, c_t, c_sent = best(
        (_R, _S0, _S1, _P), combine_at, lambda y: REPAIR[produced, y], on_Te,
        lambda y: REPAIR[y, res_p], on_T, hidden * ab)
    rows = []
    if detail:
        a2a_code = np.where(ep_group.size > 1, coll.ALL_TO_ALL, 0)
        rows = [("before dispatch", d_c1, "tp", T * hidden * ab, _pick(on_T, d_c1)),
                ("dispatch", a2a_code, "ep", d_sent, d_t),
                (ops[0], d_c2, "tp", T_e * hidden * ab, _pick(on_Te, d_c2)),
                ("<end>", c_c1, "tp", T_e * hidden * ab, _pick(on_Te, c_c1)),
                ("combine", a2a_code, "ep", c_sent, c_t),
                ("after combine", c_c2, "tp", T * hidden * ab, _pick(on_T, c_c2))]
    return d_tot + c_tot, rows


# ------------------------------------------------- experts re-split: the all-gather path
# When the experts are split moe_tp x moe_ep over the tp x ep ranks other than (tp, ep)
# (:class:`shardc.ir.strategy.Degrees`; e.g. tp=1 ep=8 moe_tp=8: AIConfigurator's
# ``tp1 dp8 etp8``), the engines (SGLang ``--enable-dp-attention`` without DeepEP, vLLM data
# parallel without ``--enable-expert-parallel``, TensorRT-LLM attention DP) run the MoE as:
#
# * all-gather the routed tokens over the ep attention groups: every rank then holds the
#   ``T x ep`` tokens of the replica's tp x ep ranks (the tp group's residual is replicated,
#   so no tp step);
# * each rank runs its ``E / moe_ep`` experts at ``1 / moe_tp`` of their ffn width on the
#   tokens routed to them (``T x ep x top_k / moe_ep x imbalance`` rows), ending in partial
#   sums over the whole tp x ep group;
# * reduce-scatter over the ep groups (each gets its ``T`` tokens back, summed over the
#   other ep ranks), then all-reduce over tp (the sum over the tp ranks' expert slices).
#
# The experts' Batch of such a strategy is the attention's with tp := moe_tp, ep := moe_ep
# and ``T x ep / moe_ep`` tokens per moe_tp group (so ``tokens x ep`` stays the replica's
# routed tokens), and ``gather`` the attention side it came from.


@dataclass
class GatherView:
    """The attention layout an all-gather dispatch starts from (arrays [B]): ``tokens``
    per attention group, its ``tp`` and ``ep`` communicators."""

    tokens: np.ndarray
    tp_group: CommGroup
    ep_group: CommGroup


def gather_exchange(ops: tuple[str, ...], b, detail: bool = False):
    """Seconds of the all-gather dispatch and reduce-scatter combine (above) for each
    strategy of the experts Batch ``b`` (``b.gather`` set); ``rows`` as
    :func:`experts_exchange`'s (the all-gather is the "dispatch", the reduce-scatter the
    "combine", the tp all-reduce "after combine")."""
    g = b.gather
    hidden, ab = float(b.hidden), float(b.act_bytes)
    d_row = fp8_dispatch_row_bytes(hidden) if b.fp8_dispatch else hidden * ab
    n_ep = g.ep_group.size.astype(np.float64)
    gathered = g.tokens * n_ep  # the replica's tokens, on every rank after the all-gather
    ag = coll.all_gather(gathered * d_row, g.ep_group, b.hw)
    rs = coll.all_gather(gathered * hidden * ab, g.ep_group, b.hw)  # RS costs as AG
    ar = coll.all_reduce(g.tokens * hidden * ab, g.tp_group, b.hw)
    rows = []
    if detail:
        zero = np.zeros_like(ag)
        code = np.zeros(ag.shape, dtype=np.int64)
        rows = [("dispatch", np.where(n_ep > 1, coll.ALL_GATHER, 0), "ep",
                 gathered * d_row, ag),
                (ops[0], code, "tp", zero, zero),
                ("combine", np.where(n_ep > 1, coll.REDUCE_SCATTER, 0), "ep",
                 gathered * hidden * ab, rs),
                ("after combine", np.where(g.tp_group.size > 1, coll.ALL_REDUCE, 0), "tp",
                 g.tokens * hidden * ab, ar)]
    return ag + rs + ar, rows


def gathered_batch(b):
    """The attention Batch ``b`` with every ep rank's tokens (``tokens x ep`` per rank): what
    the router of a re-split runs on -- after the all-gather every rank routes the replica's
    tokens (replicated router), as the engines and :mod:`shardc.runtime.gathered_experts`
    do, not its attention group's."""
    from dataclasses import replace

    return replace(b, tokens=b.tokens * b.ep)


def resplit_batch(b, moe_tp, moe_ep, imbalance, gpus_per_node: int):
    """The experts' Batch of strategies whose experts are split ``moe_tp`` x ``moe_ep``
    (arrays [B]) over the tp x ep ranks of the attention Batch ``b``: tp := moe_tp, ep :=
    moe_ep, ``T x ep / moe_ep`` tokens per moe_tp group, the busiest of the moe_ep ranks'
    ``imbalance`` [B], replicated residual, and ``gather`` = ``b``'s attention side. The
    moe_tp groups are the innermost ranks (stride 1), the moe_ep groups stride moe_tp."""
    from dataclasses import replace

    from shardc.cost.topology import comm_group

    mt = np.asarray(moe_tp, dtype=np.float64)
    me = np.asarray(moe_ep, dtype=np.float64)
    tokens = b.tokens * b.ep / me
    groups = dict(b.groups, tp=comm_group(mt, 1, gpus_per_node),
                  ep=comm_group(me, mt, gpus_per_node))
    return replace(b, tp=mt, ep=me, sp=np.ones_like(mt), tokens=tokens,
                   expert_tokens=tokens * b.top_k * imbalance, residual=np.zeros_like(b.residual),
                   groups=groups, expert_imbalance=imbalance,
                   gather=GatherView(b.tokens, b.groups["tp"], b.groups["ep"]))


def megatron_combo(ops: tuple[str, ...]) -> int:
    """The experts branch's choice combination (base-3 digits, first op lowest) of Megatron's
    column / row split: the only one a re-split runs (each rank's expert slice ends in
    partial sums that the reduce-scatter and all-reduce add up)."""
    from shardc.ir.space import MEGATRON_CHOICE

    return sum(MEGATRON_CHOICE[op] * 3**j for j, op in enumerate(ops))


def merge_resplit(bc, bc_resplit, rows: np.ndarray):
    """A BranchCost taking ``bc_resplit``'s time and bytes on ``rows`` [B] and ``bc``'s
    elsewhere (detail lists: the one strategy's own)."""
    from dataclasses import replace

    pick = bool(np.asarray(rows).reshape(-1)[0]) if rows.size else False
    detail = bc_resplit if pick else bc
    return replace(bc, time_s=np.where(rows, bc_resplit.time_s, bc.time_s),
                   weight_bytes=np.where(rows, bc_resplit.weight_bytes, bc.weight_bytes),
                   kv_bytes=np.where(rows, bc_resplit.kv_bytes, bc.kv_bytes),
                   ops=detail.ops, collectives=detail.collectives)
