"""The inference cost model: a batch of strategies -> throughput, latency, memory, verdict.

Semantics (a replica = tp x ep x pp GPUs serving ``batch`` sequences; dp replicas are
independent, so per-GPU numbers are per replica):

* attention and dense ops are data-parallel over ep: each of the ep attention groups (a tp
  group) serves batch/ep sequences; experts: num_experts/ep per ep rank (see layer_costs);
* layers are split over pp stages contiguously and as evenly as possible; the embedding sits
  on the first stage, the lm_head on the last;
* decode: the batch is split into pp micro-batches rotating through the stages;
  ``tick = max stage time (one micro-batch) + inter-stage send``, ``TPOT = pp * tick``,
  ``tok/s/GPU = batch / TPOT / replica_gpus``. ``ttft_ms`` is NaN in decode (prefill is not
  simulated in the decode phase; use ``--phase prefill``);
* prefill: with pp > 1 the batch runs as ``m = batch / ep`` micro-batches (one sequence per
  attention group) through a GPipe schedule, ``time = (m + pp - 1) * tick`` (bubble
  (pp-1)/(m+pp-1)); with pp = 1 the whole batch is one pass. ``TTFT`` = time until the
  last sequence's prefill finishes; ``tok/s/GPU = batch * prompt / TTFT / replica_gpus``
  (prompt tokens); ``tpot_ms`` is NaN;
* decode with ``mixed_prefill`` > 0 (aggregated serving, :mod:`shardc.serving.pool_models`): every
  step also carries a chunk of ``mixed_prefill`` prompt tokens per running sequence (chunked
  prefill in in-flight batching); GEMMs see decode + chunk tokens, attention decodes the
  running sequences and runs context attention for the chunk (``workload.prompt`` = the input
  length); ``TTFT = (ceil(prompt / chunk per micro-batch) + 0.5) * TPOT`` (the prompt's
  chunks spread over steps, plus half a step waiting to join one) and must meet the TTFT SLO;
* memory per GPU (bottleneck stage): weight shards + KV cache of all resident sequences
  (context tokens in decode, prompt tokens in prefill) + activations (4 live buffers of the
  widest activation, the dispatched expert tokens and fp32 logits) + the preset's fixed
  workspace; feasible if <= HBM x (1 - headroom).

Step time decomposes over (layer kind x branch): per layer of kind k,
``layer_k = norms_k + sum_branches branch_time(k, branch, choices of that branch)``; each
stage ``sum_k count[s, k] * layer_k + [s first] embedding + [s last] lm_head``; all
coefficients are >= 0, so (ignoring memory) minimising each branch term independently
minimises every stage. Weight and KV bytes decompose the same way. See
:meth:`CostModel.branch_tables`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from shardc.cost.branch_tables import (
    NEEDS_SEQUENCES_SPLIT,
    NEEDS_TOKENS_SPLIT,
    branch_table,
    split_requirements,
)
from shardc.cost.distinct_rows import context_ids, distinct_branch_cost
from shardc.cost.evaluation import (  # noqa: F401 - re-exported (shardc.cost.model API)
    BAD_BATCH,
    BAD_CHOICE,
    BAD_DEGREES,
    NO_MEMORY,
    OK,
    REASONS,
    TPOT_SLO,
    TTFT_SLO,
    Evaluation,
    reason_text,
)
from shardc.cost.hardware_presets import Hardware, load_hardware
from shardc.cost.layer_costs import norms_cost, op_out_width
from shardc.cost.moe_dispatch import (
    LAYOUT_RULES,
    megatron_combo,
    merge_resplit,
    resplit_batch,
)
from shardc.cost.step_batch import step_batch
from shardc.errors import InputError
from shardc.ir.contract import BRANCHES
from shardc.ir.graph import Graph
from shardc.ir.recurrent import ssm_state_bytes
from shardc.ir.space import DEGREE_COMPONENTS, StrategySpace
from shardc.ir.strategy import Mesh, Strategy, Workload, format_bytes, stage_layer_ranges

DEFAULT_EXPERT_IMBALANCE = 1.3  # the fixed factor shardc used before shardc.cost.routing


@dataclass
class _Kind:
    name: str
    count: int
    other_params: int
    branches: list  # [(branch, [FusedOp], table, [slot names])]


class CostModel:
    """``CostModel(graph, mesh, hardware, workload)``; ``evaluate(actions, space)``.

    Keyword options: ``weight_bytes`` / ``kv_bytes`` / ``act_bytes`` (bytes per element;
    default from ``workload.weights`` / ``workload.kv_cache``: 1 for fp8, else the graph's
    ``dtype_bytes``), ``fp8_gemm`` (GEMMs at the fp8 peak; default: ``workload.weights ==
    "fp8"``), ``fp8_dispatch`` (MoE dispatch in FP8, :mod:`shardc.cost.moe_dispatch`;
    default: as ``fp8_gemm``), ``moe_layouts`` (the tensor layouts the MoE exchange may
    cross at, :data:`shardc.cost.moe_dispatch.LAYOUT_RULES`; default ``"backend"``, what the
    emitted code runs), ``expert_imbalance`` (a fixed busiest-EP-rank / mean rows factor;
    default None: from ``workload.routing`` / ``redundant_experts`` per strategy,
    :func:`shardc.cost.routing.rank_imbalance`), ``kernels``
    (``"roofline"``, the default here, or ``"silicon"``: measured kernel times where the
    tables cover the hardware, :mod:`shardc.cost.silicon`) and ``engine`` (whose kernels).
    ``kernel_source`` says what prices the model (``"roofline"`` or
    ``"silicon:<engine>-<version>:<system>"``), ``kernel_reason`` why not silicon; for serving
    (:mod:`shardc.serving.pool_models`): ``attend_context`` (positions a decode step attends, tokens;
    default the workload's context, which is also the KV length held per sequence),
    ``mixed_prefill`` (prompt tokens per running sequence per decode step; 0 = pure decode)
    ``token_budgets`` (with ``mixed_prefill``: the scheduler's token budget candidates,
    :mod:`shardc.cost.scheduler`; None = the prompt chunk ``mixed_prefill`` rides on every
    step, the budget binding every step) and ``kv_reservation`` (decode: ``"full"`` holds
    ``workload.context`` tokens per sequence, ``"paged"`` what a paged engine holds for
    requests of ``workload.isl`` / ``osl`` tokens, :func:`shardc.cost.scheduler.paged_kv_tokens`).
    """

    def __init__(self, graph: Graph, mesh: Mesh, hardware: Hardware | str, workload: Workload,
                 *, weight_bytes: float | None = None, kv_bytes: float | None = None,
                 act_bytes: float | None = None, fp8_gemm: bool | None = None,
                 fp8_dispatch: bool | None = None, moe_layouts: str = "backend",
                 expert_imbalance: float | None = None, kernels: str = "roofline",
                 engine: str = "vllm", attend_context: float | None = None,
                 mixed_prefill: float = 0.0, token_budgets=None, kv_reservation: str = "full"):
        from shardc.cost.silicon import kernels_for

        self.graph, self.mesh, self.workload = graph, mesh, workload
        self.hw = load_hardware(hardware)
        self.kernels, self.kernel_source, self.kernel_reason = kernels_for(self.hw, kernels, engine)
        self.kernel_options = {"kernels": kernels, "engine": engine}
        cfg = graph.config
        dtype = float(cfg.get("dtype_bytes", 2) or 2)
        self.weight_bytes = float(weight_bytes or format_bytes(workload.weights, dtype))
        self.kv_bytes = float(kv_bytes or format_bytes(workload.kv_cache, dtype))
        self.act_bytes = float(act_bytes or dtype)
        self.ssm_bytes = ssm_state_bytes(engine, cfg, self.act_bytes)  # as engine holds it
        self.fp8_gemm = workload.weights == "fp8" if fp8_gemm is None else bool(fp8_gemm)
        self.fp8_dispatch = self.fp8_gemm if fp8_dispatch is None else bool(fp8_dispatch)
        if moe_layouts not in LAYOUT_RULES:
            raise ValueError(f"moe_layouts {moe_layouts!r}: expected one of {LAYOUT_RULES}")
        self.moe_layouts = moe_layouts
        self.expert_imbalance = None if expert_imbalance is None else float(expert_imbalance)
        self.attend_context = float(attend_context or workload.context)
        self.mixed_prefill = float(mixed_prefill) if workload.phase == "decode" else 0.0
        from shardc.cost.scheduler import KV_RESERVATIONS

        if kv_reservation not in KV_RESERVATIONS:
            raise ValueError(f"kv_reservation {kv_reservation!r}: expected {KV_RESERVATIONS}")
        # paged: serving pools (needs workload.isl / osl); full: the context from step one
        self.kv_reservation = kv_reservation if workload.phase == "decode" else "full"
        self.token_budgets = (np.asarray(sorted(token_budgets), dtype=np.float64)
                              if token_budgets is not None and self.mixed_prefill > 0 else None)
        self.hidden = int(cfg.get("hidden", 0))
        if self.hidden <= 0:
            raise InputError(f"model {graph.name}: config has no hidden size")
        self.num_experts = int(cfg.get("num_experts", 0) or 0)
        self.top_k = int(cfg.get("top_k", 0) or 0) or 1
        self.kinds: list[_Kind] = []
        for k in graph.layer_kinds:
            brs = []
            for bname, names in BRANCHES.items():
                present = [n for n in names if k.op(n) is not None]
                if present:
                    brs.append((bname, [k.op(n) for n in present],
                                branch_table(bname, tuple(present)),
                                [f"{k.name}.{n}" for n in present]))
            other = int((getattr(k, "attrs", None) or {}).get("other_params", 0) or 0)
            self.kinds.append(_Kind(k.name, k.count, other, brs))
        self.globals = []
        for name in ("embedding", "lm_head"):
            fop = graph.global_op(name)
            if fop is not None:
                self.globals.append((name, [fop], branch_table(name, (name,)), [name]))
        self.widest = max([self.hidden] + [op_out_width(o) for k in graph.layer_kinds
                                           for o in k.ops if o.name not in ("expert_ffn1",)])
        self.expert_width = max([0] + [o.out_features for k in graph.layer_kinds for o in k.ops
                                       if o.name == "expert_ffn1"])
        self.vocab = int(cfg.get("vocab", 0) or 0)
        self._layer_kind = self._layer_order()
        self._stage_cache: dict[int, np.ndarray] = {}

    # ------------------------------------------------------------ pipeline layout
    def _layer_order(self) -> np.ndarray:
        """Kind index of every layer in model order (from LayerKind.layers if complete)."""
        total = sum(k.count for k in self.graph.layer_kinds)
        order = np.full(total, -1, dtype=np.int64)
        ok = True
        for i, k in enumerate(self.graph.layer_kinds):
            if len(k.layers) != k.count or any(not 0 <= L < total for L in k.layers):
                ok = False
                break
            order[list(k.layers)] = i
        if not ok or (order < 0).any():
            order = np.repeat(np.arange(len(self.graph.layer_kinds)),
                              [k.count for k in self.graph.layer_kinds])
        return order

    def stage_counts(self, pp: int) -> np.ndarray:
        """[pp, n_kinds] layers of each kind on each stage
        (:func:`shardc.ir.strategy.stage_layer_ranges`, the split the backend deploys)."""
        if pp not in self._stage_cache:
            c = np.zeros((pp, len(self.kinds)), dtype=np.float64)
            for s, layers in enumerate(stage_layer_ranges(len(self._layer_kind), pp)):
                for kind in self._layer_kind[layers.start:layers.stop]:
                    c[s, kind] += 1
            self._stage_cache[pp] = c
        return self._stage_cache[pp]

    # ------------------------------------------------------------------- core
    def _branch(self, branch, a: np.ndarray, step: dict, slot_col: dict, ctx, n_ctx,
                priced=None):
        """(combo [B], BranchCost, rows whose op choice a re-split forbids [B]) of one
        branch ``(name, fops, table, slots)`` at the action rows ``a`` (``ctx`` / ``n_ctx``:
        :func:`~shardc.cost.distinct_rows.context_ids`); ``priced(combo)``: its BranchCost
        already computed (the exact sweep's term grid)."""
        bname, fops, table, slots = branch
        combo = np.zeros(a.shape[0], dtype=np.int64)
        for j, s in enumerate(slots):
            combo += a[:, slot_col[s]] * 3**j
        in_width = {"experts": self.hidden, "embedding": 1}.get(bname, fops[0].in_features)
        b, bx, resplit = step["b"], step["bx"], step["resplit"]
        if priced is not None:
            bc = priced(combo)
        else:
            bc = distinct_branch_cost(bname, fops, table, combo, b, in_width, ctx, n_ctx)
        forbidden = np.zeros(a.shape[0], dtype=bool)
        if bx is not None and bname in ("experts", "router"):
            if priced is None:  # experts: the all-gather path's rows; router: every rank
                other = bx if bname == "experts" else step["b_routed"]  # routes them all
                bc = merge_resplit(bc, distinct_branch_cost(bname, fops, table, combo, other,
                                                            in_width, ctx, n_ctx), resplit)
            forbidden = resplit & (combo != megatron_combo(table.ops))  # router: replicated
        return combo, bc, forbidden

    def _contexts(self, a: np.ndarray, step: dict):
        """:func:`~shardc.cost.distinct_rows.context_ids` of the action rows: each distinct
        (degrees, chunk, branch choices) is priced once."""
        return context_ids(a[:, :len(DEGREE_COMPONENTS)],
                           step["chunk"] if self.workload.phase == "decode" else 0.0)

    def branch_term_cost(self, actions: np.ndarray, space: StrategySpace, kind: int | None,
                         branch: int):
        """The BranchCost (seconds, bytes) of one term -- branch ``branch`` of layer kind
        ``kind`` (None: of the global ops) -- at each action row: the same numbers
        :meth:`_simulate` adds into the step, without pricing the rest of it."""
        a = np.atleast_2d(np.asarray(actions, dtype=np.int64))
        slot_col = {s: len(DEGREE_COMPONENTS) + i for i, s in enumerate(space.op_slots)}
        branches = self.globals if kind is None else self.kinds[kind].branches
        step = step_batch(self, a, space)
        return self._branch(branches[branch], a, step, slot_col, *self._contexts(a, step))[1]

    def _simulate(self, actions: np.ndarray, space: StrategySpace, detail: bool = False,
                  chunk=None, term_costs=None) -> dict:
        """The step of each action row; ``chunk`` [B] overrides the prompt tokens a decode
        step carries per micro-batch per attention group (default ``mixed_prefill`` per
        running sequence). ``term_costs(kind, branch, combo)``: the BranchCost of a term
        at these rows, priced before by :meth:`branch_term_cost` (default chunk)."""
        a = np.atleast_2d(np.asarray(actions, dtype=np.int64))
        B = a.shape[0]
        step = step_batch(self, a, space, detail, chunk)
        deg, b, bx, resplit, tokens, seqs, chunk, micro, batch_ok, residual = (step[k] for k in (
            "deg", "b", "bx", "resplit", "tokens", "seqs", "chunk", "micro", "batch_ok", "residual"))
        tp, ep, pp, batch, dp = (deg[k] for k in ("tp", "ep", "pp", "batch", "dp"))
        wl = self.workload
        tpf, epf, ppf, bf = (x.astype(np.float64) for x in (tp, ep, pp, batch))
        slot_col = {s: len(DEGREE_COMPONENTS) + i for i, s in enumerate(space.op_slots)}
        # legality of op choices and token splits
        masks = space.op_masks(a[:, 0])
        ops = a[:, len(DEGREE_COMPONENTS):]
        choices_ok = np.take_along_axis(masks, ops[:, :, None], axis=2)[:, :, 0].all(axis=1)
        split_ok = np.ones(B, dtype=bool)
        tok_int = np.rint(tokens).astype(np.int64)
        seq_int = np.rint(seqs).astype(np.int64)
        tokens_split, seqs_split = tok_int % tp == 0, seq_int % tp == 0  # tp divides them
        ctx, n_ctx = (None, 0) if term_costs is not None else self._contexts(a, step)

        def run(branches, ki):
            nonlocal choices_ok, split_ok
            res = []
            for bi, br in enumerate(branches):
                bname, fops, table, _ = br
                priced = (None if term_costs is None
                          else lambda combo, bi=bi: term_costs(ki, bi, combo))
                combo, bc, forbidden = self._branch(br, a, step, slot_col, ctx, n_ctx, priced)
                choices_ok &= ~forbidden
                modes = table.modes[combo, residual]
                res.append((bname, fops, table, combo, bc))
                needs = split_requirements(bname, fops, modes)
                split_ok &= ((needs & NEEDS_TOKENS_SPLIT) == 0) | tokens_split
                split_ok &= ((needs & NEEDS_SEQUENCES_SPLIT) == 0) | seqs_split
            return res

        kinds_out, layer_time, layer_mem = [], [], []
        for ki, k in enumerate(self.kinds):
            brs = run(k.branches, ki)
            nt, nw = norms_cost(b, k.other_params)
            t = nt.copy()
            m = nw.copy()
            for _, _, _, _, bc in brs:
                t += bc.time_s
                m += bc.weight_bytes + bc.kv_bytes
            kinds_out.append((k, brs, nt))
            layer_time.append(t)
            layer_mem.append(m)
        glob = dict(zip([g[0] for g in self.globals], run(self.globals, None)))
        sp_res = np.where(residual == 1, tpf, 1.0)
        split_ok &= (residual == 0) | tokens_split

        # ---- pipeline: stage times and memory (bottleneck stage)
        n_st = int(pp.max()) if B else 1
        # [stage, B] (a max over the short outer axis is one vectorised pass per stage)
        stage_t = np.zeros((n_st, B))
        stage_m = np.zeros((n_st, B))
        for p in np.unique(pp):
            rows = pp == p
            cnt = self.stage_counts(int(p))
            lt = [x[rows] for x in layer_time]
            lm = [x[rows] for x in layer_mem]
            for s in range(int(p)):
                t = np.zeros(int(rows.sum()))
                m = np.zeros(int(rows.sum()))
                for ki in range(len(self.kinds)):
                    if cnt[s, ki]:
                        t = t + cnt[s, ki] * lt[ki]
                        m = m + cnt[s, ki] * lm[ki]
                if s == 0 and "embedding" in glob:
                    bc = glob["embedding"][4]
                    t = t + bc.time_s[rows]
                    m = m + bc.weight_bytes[rows]
                if s == int(p) - 1 and "lm_head" in glob:
                    bc = glob["lm_head"][4]
                    t = t + bc.time_s[rows]
                    m = m + bc.weight_bytes[rows]
                stage_t[s, rows] = t
                stage_m[s, rows] = m
        from shardc.cost import collectives as coll

        send_bytes = tokens / sp_res * self.hidden * self.act_bytes
        send = coll.send_recv(send_bytes, b.groups["pp"], self.hw)
        tick = stage_t.max(axis=0) + send
        if wl.phase == "decode":
            tpot = ppf * tick
            tok_s = bf / tpot / (tpf * epf * ppf)
            latency_bad = tpot * 1e3 > wl.tpot_slo_ms
            latency_reason = TPOT_SLO
            if self.mixed_prefill > 0:  # aggregated serving, the budget binding every step
                steps = np.ceil(wl.prompt / np.maximum(chunk, 1e-9) - 1e-9)
                ttft = (steps + 0.5) * tpot
                ttft_bad = ttft * 1e3 > wl.ttft_slo_ms
                latency_reason = np.where(latency_bad, TPOT_SLO, TTFT_SLO)
                latency_bad = latency_bad | ttft_bad
            else:
                ttft = np.full(B, np.nan)
        else:
            ttft = (micro + ppf - 1) * tick
            tpot = np.full(B, np.nan)
            tok_s = bf * wl.prompt / ttft / (tpf * epf * ppf)
            latency_bad = ttft * 1e3 > wl.ttft_slo_ms
            latency_reason = TTFT_SLO
        expert_rows = b.expert_tokens if bx is None else np.where(resplit, bx.expert_tokens,
                                                                   b.expert_tokens)
        act = self.act_bytes * 4 * (tokens * self.widest + expert_rows * self.expert_width)
        act = act + b.lm_tokens * self.vocab * 4.0
        model_bytes = stage_m.max(axis=0) + act
        mem_gb = (model_bytes + self.hw.workspace_gb * 1e9) / 1e9
        mem_bad = model_bytes > self.hw.usable_hbm_bytes

        hard = np.full(B, OK, dtype=np.int64)  # what no scheduling can change
        for cond, code in ((mem_bad, NO_MEMORY), (~(batch_ok & split_ok), BAD_BATCH),
                           (~choices_ok, BAD_CHOICE), (dp <= 0, BAD_DEGREES)):
            hard = np.where(cond, code, hard)
        reason = np.where((hard == OK) & latency_bad, latency_reason, hard)
        bad_deg = dp <= 0
        tok_s = np.where(bad_deg, 0.0, tok_s)
        ev = Evaluation(tok_s_per_gpu=tok_s, tpot_ms=tpot * 1e3, ttft_ms=ttft * 1e3,
                        memory_gb_per_gpu=mem_gb, feasible=reason == OK, reason=reason)
        return dict(ev=ev, hard=hard, chunk=chunk, kinds=kinds_out, glob=glob, stage_t=stage_t.T, stage_m=stage_m.T,
                    send=send, send_bytes=send_bytes, tick=tick, micro=micro, act=act, b=b, deg=deg,
                    layer_time=layer_time, layer_mem=layer_mem)

    # ------------------------------------------------------------------ public
    def _resplit(self, b, deg, routed):
        """(experts' Batch, rows [B]) of the strategies whose experts are split other than
        (tp, ep) (:func:`shardc.cost.moe_dispatch.resplit_batch`), or (None, None)."""
        resplit = (deg["moe_tp"] != deg["tp"]) & (deg["moe_tp"] > 0)
        if not resplit.any():
            return None, None
        mt = np.where(resplit, deg["moe_tp"], deg["tp"])
        me = np.where(resplit, deg["moe_ep"], deg["ep"])
        return resplit_batch(b, mt, me, self.imbalance(routed, me),
                             self.mesh.gpus_per_node), resplit

    def imbalance(self, tokens, ep) -> np.ndarray:
        """Busiest EP rank's routed rows / the mean rank's for ``tokens`` entering a MoE layer
        over the EP group (arrays; 1 where ep = 1 or the model has no experts): the fixed
        ``expert_imbalance`` if given, else the routing model's expectation."""
        ep = np.asarray(ep)
        if self.expert_imbalance is not None:
            return np.where(ep > 1, self.expert_imbalance, 1.0)
        if self.num_experts <= 1:
            return np.ones(np.broadcast(tokens, ep).shape)
        from shardc.cost.routing import rank_imbalance

        wl = self.workload
        return rank_imbalance(tokens, self.num_experts, self.top_k, ep, wl.routing,
                              wl.redundant_experts)

    def kv_tokens_per_sequence(self, resident_seqs):
        """KV tokens held per running sequence (decode; ``resident_seqs`` = sequences
        sharing one GPU's KV pool = batch / ep): ``workload.context`` under the ``full``
        reservation, :func:`shardc.cost.scheduler.paged_kv_tokens` under ``paged``."""
        if self.kv_reservation != "paged":
            return np.full(np.shape(resident_seqs), float(self.workload.context))
        from shardc.cost.scheduler import PAGE_TOKENS, paged_kv_tokens

        wl = self.workload
        return paged_kv_tokens(wl.isl, wl.osl, resident_seqs,
                               PAGE_TOKENS.get(self.kernel_options["engine"], 1))

    def memory_ratio(self, ev: Evaluation) -> np.ndarray:
        """[B] model bytes per GPU (weights, KV cache, activations; the workspace excluded) /
        usable HBM: <= 1 when the strategy fits."""
        model_bytes = np.asarray(ev.memory_gb_per_gpu, float) * 1e9 - self.hw.workspace_gb * 1e9
        return model_bytes / self.hw.usable_hbm_bytes

    def violation(self, ev: Evaluation, tpot_slo_ms: float | None, ttft_slo_ms: float | None,
                  ttft_ms=None) -> np.ndarray:
        """[B] how far each evaluated strategy is from feasible: ``max(model bytes / usable
        HBM, TPOT / TPOT SLO, TTFT / TTFT SLO) - 1`` over the checks that apply (a None SLO
        or a NaN latency is not checked; ``ttft_ms`` overrides ``ev``'s), ``inf`` for a
        discrete failure (degrees, op choices, batch split); <= 0 when every continuous check
        passes. The row polisher's repair step minimises it (:mod:`shardc.search.polish`)."""
        ratios = [self.memory_ratio(ev)]
        ttft = np.asarray(ev.ttft_ms if ttft_ms is None else ttft_ms, float)
        for lat, slo in ((np.asarray(ev.tpot_ms, float), tpot_slo_ms), (ttft, ttft_slo_ms)):
            if slo is not None and np.isfinite(slo) and slo > 0:
                ratios.append(np.where(np.isfinite(lat), lat / slo, 0.0))
        out = np.max(ratios, axis=0) - 1.0
        return np.where(np.isin(ev.reason, (BAD_BATCH, BAD_CHOICE, BAD_DEGREES)), np.inf, out)

    def evaluate(self, actions: np.ndarray, space: StrategySpace,
                 term_costs=None) -> Evaluation:
        """Evaluate a batch of actions [B, A] of ``space`` (see :class:`Evaluation`);
        ``term_costs``: the branch costs already priced (:meth:`_simulate`; unused when a
        token budget schedules the step)."""
        if self.token_budgets is not None:
            return self._scheduled(actions, space)["ev"]
        return self._simulate(actions, space, term_costs=term_costs)["ev"]

    def _scheduled(self, actions: np.ndarray, space: StrategySpace,
                   detail: bool = False) -> dict:
        """The aggregated pool under the scheduler's token budget
        (:func:`shardc.cost.scheduler.evaluate_scheduled`)."""
        from shardc.cost.scheduler import evaluate_scheduled

        return evaluate_scheduled(self, actions, space, detail)

    def reason_text(self, code: int) -> str:
        return reason_text(code)

    def space_for(self, strategy: Strategy) -> StrategySpace:
        """A strategy space whose batch candidates are exactly ``strategy.batch``."""
        d = strategy.degrees
        fixed = ({"moe_tp": d.moe_tp, "moe_ep": d.moe_ep, "ep": d.ep} if d.experts_resplit
                 else {})  # a split's dp_attn need not divide the experts
        return StrategySpace(self.graph, self.mesh, replace(self.workload, batch=strategy.batch),
                             fixed=fixed)

    def simulate(self, strategy: Strategy):
        """One strategy's :class:`~shardc.cost.explain.Breakdown`: predicted numbers (ms,
        tokens/s/GPU, GB), per-op and per-collective rows, stage times, memory -- the same
        vectorised code as :meth:`evaluate` on a batch of one (:mod:`shardc.cost.explain`)."""
        from shardc.cost.explain import simulate

        return simulate(self, strategy)

    def chrome_trace(self, strategy: Strategy) -> dict:
        """The simulated step as Chrome-trace JSON (one lane per pipeline stage)."""
        from shardc.cost.explain import chrome_trace

        return chrome_trace(self, strategy)

    def branch_term_grid(self, degree_rows, space: StrategySpace):
        """Every (kind x branch) cost term at many degree rows; see
        :func:`shardc.cost.decomposition.branch_term_grid` (used by the exact solver)."""
        from shardc.cost.decomposition import branch_term_grid

        return branch_term_grid(self, space, degree_rows)

    def grid_term_costs(self, terms, rows):
        """``term_costs`` for :meth:`evaluate` read off :meth:`branch_term_grid`'s ``terms``
        at degree rows ``rows`` (:class:`shardc.cost.decomposition.GridTermCosts`)."""
        from shardc.cost.decomposition import GridTermCosts

        return GridTermCosts(terms, rows)

    def branch_tables(self, degree_action, space: StrategySpace):
        """Per-(layer kind x branch) cost tables at fixed degrees; see
        :func:`shardc.cost.decomposition.branch_tables`."""
        from shardc.cost.decomposition import branch_tables

        return branch_tables(self, degree_action, space)
