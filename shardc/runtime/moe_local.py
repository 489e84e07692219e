"""Sparse MoE blocks on local weights for the fast runtime (torch only): the HF router module
picks the experts (its own maths: softmax top-k, DeepSeek's sigmoid + score-correction bias +
group-limited top-k, ERNIE's score bias, Phi-3.5-MoE's sparsemixer), tokens reach the experts'
owners over ``ep`` with explicit functional all-to-alls, the experts' two matmuls run on this
rank's shards -- any pair of ``col`` / ``row`` / ``rep`` choices over tp -- and the partial
sums are repaired as the walk says.

Router: a ``rep`` router is the module itself; a ``col`` / ``row`` router runs its own
forward with its scores matmul on the local weight shard (``row``: on this rank's slice of
the features), the scores made whole by the walk's collective (all-gather / all-reduce), the
rest of its code on plain tensors (:class:`RouterLocal`).

Experts (:class:`ExpertsLocal`), the walk's placements on the routed rows: the first matmul's
input is a local slice of the dispatched rows (``row``: this rank's features), its output
repaired to what the second matmul needs (``S(1) -> R`` all-gather, ``P -> R`` all-reduce,
``P -> S(1)`` reduce-scatter, ``R -> S(1)`` a slice) before the gated activation
``act(gate) * up``; the second's output, when not partial sums, is made whole before the
combine (``S(1) -> R``: an all-gather of the routed rows), partial sums after the weighted
top-k sum (on the tokens, not tokens x top_k) -- the layout the cost model charges
(:mod:`shardc.cost.moe_dispatch`, ``"backend"``).

Dispatch over ep: the routed (token, expert) pairs are sorted by expert, the per-expert
counts exchanged (an eager ``all_to_all_single`` of ``E`` int64, read on the host at once:
latency only, not charged by the cost model), the rows sent with one uneven ``all_to_all_single`` (exactly the routed rows:
``T x top_k x hidden``, the charged bytes) and returned with one more. The uneven split
sizes are read on the host, so a decode step with ep > 1 is not captured as a CUDA graph.

Shared experts (:func:`shared_branch`): DeepSeek's / ERNIE's ``shared_experts`` (a gated MLP
on the same input, added) and Qwen2-MoE's ``shared_expert`` scaled per token by
``sigmoid(shared_expert_gate(x))`` (a ``[1, hidden]`` weight kept whole on every rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from shardc.runtime.dbrx_local import dbrx_routing, fused_expert_weights, is_fused_experts
from shardc.runtime.gpt_moe_local import (
    check_activation,
    expert_weights,
    is_plain_router,
    top_k_routing,
)
from shardc.runtime.local_ops import Group, linear, linear_parts, local_tensor, repair


def _router_of(mlp):
    """The MoE block's router module (``gate``: Mixtral, Qwen, DeepSeek, ERNIE; ``router``:
    Phi-3.5-MoE, Granite-MoE)."""
    router = getattr(mlp, "gate", None)
    return router if router is not None else mlp.router


class _LocalScores(torch.overrides.TorchFunctionMode):
    """Active during a sharded router's own forward: its weight (and any dtype conversion of
    it) is read as this rank's shard, and ``F.linear`` over it returns the whole scores
    (:meth:`RouterLocal.scores`); every other op runs as written, on plain tensors."""

    def __init__(self, router: RouterLocal):
        super().__init__()
        self.router = router
        self.views = [router.weight, router.local]

    def _is_view(self, t) -> bool:
        return any(t is v for v in self.views)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.type, torch.Tensor.to, torch.Tensor.float) and args and \
                self._is_view(args[0]):
            out = func(self.router.local, *args[1:], **kwargs)  # a conversion of the shard
            self.views.append(out)
            return out
        if func is F.linear and len(args) >= 2 and self._is_view(args[1]):
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            w = self.router.local if args[1] is self.router.weight else args[1]
            return self.router.scores(args[0], w, bias)
        return func(*args, **kwargs)


class RouterLocal:
    """An HF router module on this rank: ``rep`` -- the module; ``col`` / ``row`` -- its
    class's forward (not the DTensor wrapper ``RouterParallel`` installed) with the scores
    matmul on the local shard, the walk's repairs around it (see the module docstring).
    GPT-MoE's ``nn.Linear`` router (``top_k``: its block's): the scores (local shard and
    repairs alike), then its block's softmax top-k
    (:func:`shardc.runtime.gpt_moe_local.top_k_routing`).
    ``__call__(x [T, h], residual) -> (logits, top_k_weights [T, k], top_k_index [T, k])``."""

    def __init__(self, router, walk: dict, tp: Group, top_k: int | None = None, routing=None):
        (_, self.choice, self.need, self.produced), = walk["steps"]
        self.end, self.tp, self.module = walk["end"], tp, router
        self.weight = router.weight
        self.local = local_tensor(router.weight)
        self.residual = "R"
        self.plain = is_plain_router(router)
        self.top_k = top_k
        self.routing = routing  # DBRX: its block's routing of the whole scores

    def scores(self, x: torch.Tensor, w: torch.Tensor, bias=None) -> torch.Tensor:
        """The whole scores ``[T, E]`` of ``x [T, h]`` (whole) over shard ``w``; ``bias``
        (``[E]`` whole, or a ``col`` router's shard of it): a ``col`` router adds this
        rank's experts' slice before the all-gather, a ``row`` one the whole bias on tp rank
        0 before the all-reduce (:func:`~shardc.runtime.local_ops.linear`)."""
        if bias is not None:
            bias = local_tensor(bias)
            if self.choice == "col" and bias.shape[0] == self.weight.shape[0] and self.tp:
                bias = bias.chunk(self.tp.size)[self.tp.rank]
            bias = bias.to(w.dtype)
        y = linear(repair(x, self.residual, self.need, self.tp), w, bias, self.choice, self.tp)
        y = repair(y, self.produced, self.end, self.tp)
        return y.wait() if hasattr(y, "wait") else y

    def __call__(self, x: torch.Tensor, residual: str):
        if self.plain:
            self.residual = residual
            bias = self.module.bias
            logits = F.linear(x, self.local, local_tensor(bias)) if self.choice == "rep" \
                else self.scores(x, self.local, bias)
            return self.routing(logits) if self.routing else top_k_routing(logits, self.top_k)
        if self.choice == "rep":
            return self.module(x)
        self.residual = residual
        with _LocalScores(self):
            return type(self.module).forward(self.module, x)


def _grouped(rows: torch.Tensor, counts, w: torch.Tensor) -> torch.Tensor:
    """``rows`` grouped by local expert (``counts[e]`` rows of expert e) through ``w[e]``
    (``[E_local, out, in]``). ``counts`` a device tensor: the groups' end offsets (int32),
    one ``F.grouped_mm`` -- no host read, static shapes (the capture-safe path)."""
    if torch.is_tensor(counts):
        return F.grouped_mm(rows, w.transpose(1, 2), offs=counts)
    out, i = [], 0
    for e, n in enumerate(counts):
        if n:
            out.append(F.linear(rows[i:i + n], w[e]))
        i += n
    return torch.cat(out, 0) if out else rows.new_zeros(0, w.shape[1])


def _row_experts(counts, n: int, device) -> torch.Tensor:
    """The local expert of each of ``n`` rows grouped by expert (``counts`` per expert, or
    their end offsets on the device: :func:`_grouped`)."""
    if torch.is_tensor(counts):
        return torch.searchsorted(counts, torch.arange(n, device=device, dtype=counts.dtype),
                                  right=True)
    return torch.repeat_interleave(torch.arange(len(counts), device=device),
                                   torch.tensor(counts, device=device), output_size=n)


class ExpertsLocal:
    """One MoE block's routed experts on this rank: ``gate_up [E_local, 2f or 2f/tp, h or
    h/tp]`` (a ``col`` cut -- and a ``row`` one whose output is reduce-scattered -- holds this
    rank's gate slice then up slice; DBRX's fused experts: gate and up ``[E_local, f or f/tp,
    h]`` apart, :mod:`shardc.runtime.dbrx_local`; GPT-OSS's stored ``[E, h, 2f]`` with gate
    and up alternating -- a contiguous col cut keeps each pair on one rank -- read
    transposed, with their biases and the module's own clamped activation ``_apply_gate``,
    col/row or rep/rep), ``down [E_local, h or h/tp, f or f/tp]``,
    as the pair of choices cut them (the module docstring says what moves between them)."""

    def __init__(self, mlp, walk: dict, tp: Group, ep: Group):
        ex = walk["experts"]
        (_, c1, _, _), (_, c2, _, _) = ex["steps"]
        self.choices = (c1, c2)
        # sequence parallelism: each tp rank dispatches its own rows; a pair that splits the
        # experts over tp then runs on the tp ranks' received rows gathered (the walk from a
        # whole residual, ``whole_rows``), a rep/rep pair on its own rows (no tp collective)
        self.token_rows = "whole_rows" in ex
        self.gather_rows = self.token_rows and self.choices != ("rep", "rep") and bool(tp)
        steps = ex["whole_rows"] if self.gather_rows else ex["steps"]
        (_, _, self.need1, self.prod1), (_, _, self.need2, self.prod2) = steps
        self.src = "S(0)" if self.token_rows and not self.gather_rows else "R"
        self.walk, self.tp, self.ep = walk, tp, ep
        experts = mlp.experts
        router = _router_of(mlp)
        fused = is_fused_experts(experts)  # DBRX: the router's scores linear is its ``layer``
        # GPT-OSS: biases [E_local, 2f or 2f/tp] / [E_local, h] of the two matmuls, added per
        # routed row (the down one held by tp rank 0 alone under a row split: parallelize.py
        # places it Partial, zeros elsewhere), weighted by the routing weight with the rest
        self.biased = getattr(experts, "gate_up_proj_bias", None) is not None
        self.bias1, self.bias2 = (local_tensor(experts.gate_up_proj_bias),
                                  local_tensor(experts.down_proj_bias)) if self.biased \
            else (None, None)
        if self.biased and c2 == "row" and tp.rank and not any(
                p.is_partial() for p in getattr(experts.down_proj_bias, "placements", ())):
            self.bias2 = torch.zeros_like(self.bias2)  # a whole bias: once, on tp rank 0
        self.router = RouterLocal(router.layer if fused else router, walk["router"], tp,
                                  getattr(mlp, "top_k", None), dbrx_routing(mlp) if fused else None)
        if hasattr(experts, "w_in"):  # GPT-MoE: [E, in, out] weights, a GeLU between them
            check_activation(experts)
            self.gate_up, self.down, self.act, self.gated = expert_weights(experts)
        elif fused:
            self.gate_up, self.down, self.act, f = fused_expert_weights(experts)
            self.gated = True
        elif self.biased:  # GPT-OSS: [E, in, out], gate / up alternating, its own activation
            if (c1, c2) not in (("col", "row"), ("rep", "rep")):
                raise NotImplementedError(f"experts with biases split {c1}/{c2} (they run "
                                          "col/row or rep/rep)")
            self.gate_up = local_tensor(experts.gate_up_proj).transpose(1, 2)
            self.down = local_tensor(experts.down_proj).transpose(1, 2)
            self.act, self.gated = experts._apply_gate, False
        else:
            self.gate_up, self.down = local_tensor(experts.gate_up_proj), local_tensor(experts.down_proj)
            self.act, self.gated = experts.act_fn, True
        self.num_experts = int(self.router.weight.shape[0])
        # the first matmul's weights: one packed gate|up, or DBRX's gate and up apart (no
        # copy of its shards: two grouped matmuls, their outputs side by side [g_r | u_r])
        self.first = list(self.gate_up) if isinstance(self.gate_up, tuple) else [self.gate_up]
        self.local_experts = self.first[0].shape[0]
        if not fused:  # the intermediate width
            f = int(experts.down_proj.shape[-1]) if self.gated else None
        if self.biased and self.bias2.shape[0] != self.local_experts:  # placed per rank
            raise NotImplementedError("expert biases not placed with their experts")
        # the packed gate|up widths the repairs keep (S(1): [g_r | u_r]); a row/row gate_up
        # was placed with its outputs in rank order, so its partial sums scatter as they are
        self.parts = None if (c1, c2) == ("row", "row") or not self.gated else (f, f)
        # capture-safe decode (a CUDA graph): no ep dispatch, no row gather over tp -- the
        # per-expert offsets stay on the device and one grouped matmul runs each weight;
        # on a GPU for bf16 weights with 16-byte aligned rows (``F.grouped_mm``'s), else
        # the host-count loop
        self.capture_safe = not ep and not self.gather_rows
        self.static = self.capture_safe and torch.cuda.is_available() and \
            self.first[0].is_cuda and self.first[0].dtype == torch.bfloat16 and all(
                d % 8 == 0 for w in (*self.first, self.down) for d in w.shape[1:])

    def _run(self, rows: torch.Tensor, counts) -> torch.Tensor:
        """Rows grouped by local expert (``counts`` per expert, or their end offsets on the
        device: :func:`_grouped`) through their experts; the output at the placement the
        combine carries (``P`` or ``R``)."""
        tp = self.tp
        x = repair(rows, self.src, self.need1, tp)
        h = torch.cat([_grouped(x, counts, w) for w in self.first], -1) \
            if len(self.first) > 1 else _grouped(x, counts, self.first[0])
        eid = _row_experts(counts, h.shape[0], h.device) if self.biased else None
        if self.biased:
            h = h + self.bias1[eid].to(h.dtype)
        if rows.shape[0] and tp:  # every tp rank holds the same rows: all skip or none
            h = repair(h, self.prod1, self.need2, tp, self.parts)
        if self.gated:
            g, u = h.chunk(2, -1)
            a = self.act(g) * u
        else:
            a = self.act(h)
        y = _grouped(a, counts, self.down)
        if self.biased:
            y = y + self.bias2[eid].to(y.dtype)
        if self.prod2 == "S(1)" and rows.shape[0] and tp:
            y = repair(y, "S(1)", "R", tp)  # whole rows before the combine
        return y

    def _run_gathered(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Sequence parallelism: this tp rank's received ``rows`` (``counts`` per local
        expert) and the other tp ranks' -- per-expert counts all-gathered first (``E_local``
        int64, read on the host), rows padded to the largest rank's count (exact when
        balanced) and all-gathered -- run through :meth:`_run`; this rank's rows of the
        output come back whole (partial sums reduce-scattered)."""
        tp, n = self.tp, self.tp.size
        mine = torch.tensor(counts, dtype=torch.long, device=rows.device)
        every = mine.repeat(n)  # overwritten (a fake process group: all ranks as this one)
        dist.all_gather_single(every, mine, group=tp.pg)
        per_rank = every.view(n, -1).tolist()
        sizes = [sum(c) for c in per_rank]
        m = max(sizes)
        if m == 0:  # no rank received a row (every tp rank knows it)
            return rows.new_zeros(0, rows.shape[1])
        padded = rows.new_zeros(m, rows.shape[1])
        padded[:rows.shape[0]] = rows
        got = funcol.all_gather_single(padded, 0, tp.pg)
        every_rows = torch.cat([got[i * m:i * m + c] for i, c in enumerate(sizes)])
        ids = torch.cat([torch.repeat_interleave(torch.arange(len(c), device=rows.device),
                                                 torch.tensor(c, device=rows.device))
                         for c in per_rank])
        order = torch.argsort(ids, stable=True)  # every rank's rows, grouped by expert
        totals = [sum(c[j] for c in per_rank) for j in range(len(counts))]
        y = self._run(every_rows[order], totals)
        back = torch.empty_like(y).index_copy_(0, order, y)
        start = sum(sizes[:tp.rank])
        if self.prod2 != "P":
            return back[start:start + rows.shape[0]]
        pad = y.new_zeros(n * m, y.shape[1])
        offsets = [sum(sizes[:i]) for i in range(n)]
        for i, c in enumerate(sizes):
            pad[i * m:i * m + c] = back[offsets[i]:offsets[i] + c]
        out = funcol.reduce_scatter_single(pad, "sum", 0, tp.pg)
        return out[:rows.shape[0]]

    def _experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return self._run_gathered(rows, counts) if self.gather_rows else self._run(rows, counts)

    def __call__(self, x: torch.Tensor, residual: str) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        _, weights, idx = self.router(x2, residual)
        t, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // k
        rows = x2[tok]
        if self.static:  # capture-safe: the counts' running sums stay on the device
            counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
            counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
            back = self._run(rows, torch.cumsum(counts, 0, dtype=torch.int32))
            return self._combine(back, weights, order, tok, x2, shape, residual)
        counts = torch.bincount(flat, minlength=self.num_experts)
        n_ep, e_l = self.ep.size, self.local_experts
        if self.ep:
            got_counts = counts.clone()  # overwritten by the exchange, read on the host next
            dist.all_to_all_single(got_counts, counts, group=self.ep.pg)
            send = counts.view(n_ep, e_l).sum(1).tolist()
            recv_by_src = got_counts.view(n_ep, e_l)
            recv = recv_by_src.sum(1).tolist()
            got = funcol.all_to_all_single(rows.contiguous(), recv, send, self.ep.pg)
            eid = torch.arange(e_l, device=x.device).repeat(n_ep)
            eid = torch.repeat_interleave(eid, recv_by_src.reshape(-1))
            by_expert = torch.argsort(eid, stable=True)
            y = self._experts(got[by_expert], recv_by_src.sum(0).tolist())
            y = torch.empty_like(y).index_copy_(0, by_expert, y)
            back = funcol.all_to_all_single(y.contiguous(), send, recv, self.ep.pg)
        else:
            back = self._experts(rows, counts.tolist())
        return self._combine(back, weights, order, tok, x2, shape, residual)

    def _combine(self, back, weights, order, tok, x2, shape, residual) -> torch.Tensor:
        """The expert outputs ``back`` (the routed pairs, grouped by expert) weighted and
        summed per token, at the residual's placement."""
        t = x2.shape[0]
        scaled = back * weights.reshape(-1)[order, None].to(back.dtype)
        out = x2.new_zeros(t, shape[-1]).index_add_(0, tok, scaled.to(x2.dtype))
        if self.token_rows:  # this rank's rows, whole: the residual's placement
            return out.view(shape)
        produced = "P" if self.prod2 == "P" else "R"
        return repair(out.view(shape), produced, residual, self.tp)


class DenseMLP:
    """A gated MLP branch (``mlp`` / ``shared_experts``: ffn1 = gate|up, ffn2 = down) on
    local shards, its activation placed as the walk says; gate / up as two linears, or one
    packed ``gate_up_proj`` (Phi-3's: this rank's ``[g_r | u_r]`` as the styles placed it)."""

    def __init__(self, module, walk: dict, tp: Group):
        self.steps, self.end, self.tp = walk["steps"], walk["end"], tp
        if hasattr(module, "gate_up_proj"):
            self.w1 = [local_tensor(module.gate_up_proj.weight)]
            self.act = module.activation_fn
        else:
            self.w1 = [local_tensor(module.gate_proj.weight), local_tensor(module.up_proj.weight)]  # no copy
            self.act = module.act_fn
        self.w2 = local_tensor(module.down_proj.weight)
        self.inter = module.down_proj.in_features if hasattr(module.down_proj, "in_features") \
            else self.w2.shape[1]

    def __call__(self, x: torch.Tensor, residual: str) -> torch.Tensor:
        (_, c1, need1, prod1), (_, c2, need2, prod2) = self.steps
        parts = (self.inter, self.inter)
        y = linear_parts(repair(x, residual, need1, self.tp), self.w1, (None,) * len(self.w1),
                         c1, self.tp)
        y = repair(y, prod1, need2, self.tp, parts)
        g, u = y.chunk(2, -1)
        y = linear(self.act(g) * u, self.w2, None, c2, self.tp)
        return repair(y, prod2, self.end, self.tp)


class PlainMLP:
    """GPT-2's MLP (``c_fc`` = ffn1, activation, ``c_proj`` = ffn2; Conv1D weights ``[in,
    out]``, read transposed in place) on local shards, placed as the walk says."""

    def __init__(self, module, walk: dict, tp: Group):
        self.steps, self.end, self.tp = walk["steps"], walk["end"], tp
        self.w1, self.b1 = local_tensor(module.c_fc.weight).t(), local_tensor(module.c_fc.bias)
        self.w2, self.b2 = local_tensor(module.c_proj.weight).t(), local_tensor(module.c_proj.bias)
        self.act = module.act

    def __call__(self, x: torch.Tensor, residual: str) -> torch.Tensor:
        (_, c1, need1, prod1), (_, c2, need2, prod2) = self.steps
        y = linear(repair(x, residual, need1, self.tp), self.w1, self.b1, c1, self.tp)
        y = self.act(repair(y, prod1, need2, self.tp))
        return repair(linear(y, self.w2, self.b2, c2, self.tp), prod2, self.end, self.tp)


class GatedShared:
    """Qwen2-MoE's shared expert: a gated MLP (the walk's ``shared_experts`` branch) scaled
    per token by ``sigmoid(x @ shared_expert_gate.T)`` (a ``[1, hidden]`` weight, whole)."""

    def __init__(self, mlp, walk: dict, tp: Group):
        self.mlp = DenseMLP(mlp.shared_expert, walk, tp)
        self.gate = local_tensor(mlp.shared_expert_gate.weight)

    def __call__(self, x: torch.Tensor, residual: str) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.gate)) * self.mlp(x, residual)


def shared_branch(mlp, kind_walk: dict, tp: Group):
    """The MoE block's shared experts on this rank (None: it has none)."""
    if getattr(mlp, "shared_expert_gate", None) is not None:
        return GatedShared(mlp, kind_walk["shared_experts"], tp)
    module = getattr(mlp, "shared_experts", None) or getattr(mlp, "shared_expert", None)
    if module is None:
        return None
    return DenseMLP(module, kind_walk["shared_experts"], tp)
