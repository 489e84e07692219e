"""What each serving engine can express, as data: the strategy subspace an engine runs.

``--runtime dtensor`` (the default) searches the whole :class:`~shardc.ir.space.StrategySpace`
(``parallelize.py`` runs any point of it). ``--runtime vllm|sglang|trtllm`` and every launch
script search only what that engine's command line expresses. An engine is one or more
*modes* (:class:`EngineMode`); a mode fixes the per-op choice of every op slot at each tp
(one op row per tp: Megatron's column / row dims for the MLPs and experts, attention split
by heads with KV heads replicated when tp exceeds them -- as the engines' QKV layers do -- or
attention data-parallel inside the tp group) and says which degree combinations the engine
has flags for. :func:`mode_spaces` turns each mode into a restricted copy of a space (same
components and candidate values, so actions decode the same; narrower masks), which every
searcher and the exact solver explore unchanged: the constraint lives in the masks, not in
the evaluator.

The degrees each engine spells (docs/deploy.md maps them to flags):

* vLLM (``vllm serve``): ``--tensor-parallel-size tp --pipeline-parallel-size pp``; ep > 1
  only at tp = 1 (``--data-parallel-size ep --enable-expert-parallel``: attention
  data-parallel over the ep ranks, experts split over them: vLLM's expert-parallel size is
  tp x dp); sequence parallelism through its compilation pass; attention split by heads.
* SGLang (``python -m sglang.launch_server``): ``--tp-size tp*ep``; ep > 1 adds ``--dp-size
  --enable-dp-attention --ep-size ep`` (attention tp = tp, experts split over ep with expert
  tp = tp); a model with dense MLP or shared-expert layers runs those at the instance's whole
  tp, so tp > 1 beside ep > 1 is not expressible there (tp = 1: ``--moe-dense-tp-size 1``);
  attention data-parallel inside the tp group (``--enable-dp-attention``); no sequence
  parallelism.
* TensorRT-LLM (``trtllm-serve``): ``--tp_size tp*ep --ep_size ep`` (expert tp = tp);
  attention runs tensor-parallel over the whole tp_size or data-parallel over every rank
  (``enable_attention_dp``), so ep > 1 needs tp = 1 or attention data-parallel; dense layers
  beside tp > 1 and ep > 1 as in SGLang; no sequence parallelism.

The experts split other than (tp, ep) (``moe_tp x moe_ep``, :class:`shardc.ir.strategy.Degrees`;
the all-gather dispatch), as each engine spells it (:func:`experts_split_ok`):

* vLLM: data parallel without ``--enable-expert-parallel`` runs the experts tensor-parallel
  over all tp x ep ranks (``moe_tp = tp x ep``), with it expert-parallel over all of them
  (``moe_ep = tp x ep``, also at tp > 1);
* SGLang: ``--tp-size tp*ep --ep-size moe_ep`` (its MoE tp is tp-size / ep-size), any split;
* TensorRT-LLM: ``--tp_size tp*ep --ep_size moe_ep`` (its moe_tp is tp_size / ep_size), any
  split; ep > 1 runs attention data-parallel over every rank, so it needs tp = 1.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from shardc.ir.space import MEGATRON_CHOICE, StrategySpace, megatron_op_choices
from shardc.validate import divisors

RUNTIMES = ("dtensor", "vllm", "sglang", "trtllm")
ENGINES = RUNTIMES[1:]
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}
COL, ROW, REP = 0, 1, 2  # choice indices of the contract (shardc.ir.contract)
# attention split by heads (column qkv, heads, row out-proj): the engines' default
ATTENTION_HEADS = {"qkv": COL, "attn_core": COL, "out_proj": ROW}
# attention data-parallel inside the tp group: weights replicated, sequences split
ATTENTION_DP = {"qkv": REP, "attn_core": ROW, "out_proj": REP}
# ops an engine always splits when the tp degree is > 1 (it refuses a tp that does not
# divide them); any other op falls back to replicated where its dim does not divide (the
# MLA down-projections, an odd vocabulary)
SPLIT_REQUIRED = ("attn_core", "ffn1", "ffn2", "expert_ffn1", "expert_ffn2", "shared_ffn1",
                  "shared_ffn2")
DENSE_MLP_OPS = ("ffn1", "shared_ffn1")


@dataclass(frozen=True)
class EngineMode:
    """One way an engine runs a model. ``attention``: "heads" or "dp" (data-parallel inside
    the tp group; a mode with tp > 1 only); ``ep_with_tp``: ep > 1 allowed beside tp > 1
    (experts split over tp inside each ep group); ``dense_with_tp_ep``: a dense MLP (or
    shared experts) allowed at tp beside ep > 1; ``sequence_parallel``: sp on allowed."""

    name: str
    attention: str
    ep_with_tp: bool
    dense_with_tp_ep: bool
    sequence_parallel: bool
    engine: str = ""  # the engine the mode belongs to (its experts-split rule)


ENGINE_MODES: dict[str, tuple[EngineMode, ...]] = {
    "vllm": (EngineMode("tp", "heads", ep_with_tp=False, dense_with_tp_ep=False,
                        sequence_parallel=True, engine="vllm"),),
    "sglang": (EngineMode("tp", "heads", ep_with_tp=True, dense_with_tp_ep=False,
                          sequence_parallel=False, engine="sglang"),
               EngineMode("dp-attention", "dp", ep_with_tp=True, dense_with_tp_ep=False,
                          sequence_parallel=False, engine="sglang")),
    "trtllm": (EngineMode("tp", "heads", ep_with_tp=False, dense_with_tp_ep=False,
                          sequence_parallel=False, engine="trtllm"),
               EngineMode("attention-dp", "dp", ep_with_tp=True, dense_with_tp_ep=False,
                          sequence_parallel=False, engine="trtllm")),
}


def _ops(space: StrategySpace) -> list[str]:
    return [slot.split(".")[-1] for slot in space.op_slots]


def has_dense_mlp(space: StrategySpace) -> bool:
    """Whether some layer has a dense MLP or shared experts."""
    return any(op in DENSE_MLP_OPS for op in _ops(space))


def mode_row(space: StrategySpace, mode: EngineMode, tp_idx: int) -> np.ndarray | None:
    """[n_slots] the op choices ``mode`` runs at candidate ``tp_idx`` (at tp = 1 every op
    is whole: Megatron's names, what the cost model charges the same), or None when the
    engine cannot run this tp (an op it always splits does not divide, or data-parallel
    attention at tp = 1, which is the heads mode)."""
    tp = space.values["tp"][int(tp_idx)]
    mask = space.op_mask_by_tp[int(tp_idx)]
    if tp == 1:
        if mode.attention == "dp":
            return None
        return megatron_op_choices(space, tp_idx)
    attention = ATTENTION_DP if mode.attention == "dp" else ATTENTION_HEADS
    row = np.empty(len(space.op_slots), dtype=np.int64)
    for i, op in enumerate(_ops(space)):
        c = attention.get(op, MEGATRON_CHOICE[op])
        if mask[i, c]:
            row[i] = c
        elif op in SPLIT_REQUIRED or not mask[i, REP]:
            return None
        else:
            row[i] = REP
    return row


# Whether the dtensor search (``--runtime dtensor``) sweeps the re-splits
# :func:`dtensor_runs_split` allows: one more run of the searcher (RL: its whole budget) per
# split, as RL's action vector has no split component yet; off, so the dtensor plans and
# their compile time stay those of the default split. Set True to sweep them.
DTENSOR_SEARCH_SWEEPS_RESPLITS = False


def plan_places_split(tp: int, ep: int, moe_tp: int, moe_ep: int) -> bool:
    """Whether the searches sweep the experts split ``moe_tp x moe_ep`` at (tp, ep): every
    split that tiles the tp x ep ranks, as plan.json places them -- the default, all-TP
    ``moe_ep = 1`` and all-EP ``moe_tp = 1`` one placement per mesh dim, a mixed split (both
    > 1, e.g. DeepSeek-V3's tp8 with expert TP2 x EP4) on the experts mesh ``(moe_ep,
    moe_tp)`` (:func:`shardc.backends.layout.resplit_expert_placements`). Whether a runtime
    runs it is :func:`experts_split_ok`'s. The outer loop of the searches is over the
    ``moe_tp`` values (:func:`searched_splits`), so a mixed split adds (tp, ep) pairs inside
    a fixed-split copy that the all-TP / all-EP splits already make, rarely a copy."""
    mt, me = int(moe_tp), int(moe_ep)
    return mt >= 1 and me >= 1 and mt * me == int(tp) * int(ep)


def dtensor_runs_split(tp: int, ep: int, moe_tp: int, moe_ep: int) -> bool:
    """THE one place saying which experts splits ``moe_tp x moe_ep`` over tp x ep ranks the
    DTensor backend (``parallelize.py`` and the fast runtime) runs: every split that tiles
    the tp x ep ranks -- the default (``moe_tp = tp``, ``moe_ep = ep``), all-TP (``moe_tp =
    tp x ep``), all-EP (``moe_ep = tp x ep``) and mixed ones (both > 1, on the experts mesh;
    :mod:`shardc.runtime.gathered_experts`). plan.json ``backend``
    (:func:`shardc.backends.support.experts_split_problem`) and the dtensor search
    (:func:`searched_splits` with ``"dtensor"``, when
    :data:`DTENSOR_SEARCH_SWEEPS_RESPLITS`) read it. It runs every split plan.json places
    (:func:`plan_places_split`)."""
    return plan_places_split(tp, ep, moe_tp, moe_ep)


def experts_split_ok(engine: str, tp: int, ep: int, moe_tp: int, moe_ep: int,
                     dense: bool) -> bool:
    """Whether ``engine`` (or ``"dtensor"``: :func:`dtensor_runs_split`) runs the experts
    split ``moe_tp x moe_ep`` other than (tp, ep) over tp x ep ranks (module docstring);
    ``dense``: the model has dense MLP or shared-expert layers (SGLang / TensorRT-LLM run
    them at the instance's whole tp, so not beside tp > 1 and ep > 1)."""
    if engine == "dtensor":
        return dtensor_runs_split(tp, ep, moe_tp, moe_ep)
    group = tp * ep
    if engine == "vllm":
        return (moe_tp, moe_ep) in ((group, 1), (1, group))
    if dense and tp > 1 and ep > 1:
        return False
    if engine == "trtllm":
        return ep == 1 or tp == 1
    return engine == "sglang"


def searched_splits(space: StrategySpace, runtime: str, sweep_dtensor: bool = False
                    ) -> list[int]:
    """The ``moe_tp`` values (ascending) whose fixed-split copies of ``space``
    (:func:`shardc.ir.space.with_experts_split`) hold some experts split other than (tp, ep)
    that ``runtime`` runs (:func:`experts_split_ok`; ``"any"``: some engine runs it) and
    plan.json places (:func:`plan_places_split`: all-TP, all-EP or mixed) at a
    (tp, ep) pair of ``space``: the splits a search sweeps as an outer loop besides
    ``space`` itself. Empty for a dense model, a space whose user fixed the split or sp on,
    and ``"dtensor"`` unless :data:`DTENSOR_SEARCH_SWEEPS_RESPLITS` or ``sweep_dtensor`` (the
    re-pricing of the dtensor search's best rows, :mod:`shardc.search.resplit`)."""
    if (not int(space.graph.config.get("num_experts", 0) or 0) or "moe_tp" in space.fixed
            or "moe_ep" in space.fixed or 0 not in space.values["sp"]
            or (runtime == "dtensor" and not (DTENSOR_SEARCH_SWEEPS_RESPLITS or sweep_dtensor))):
        return []
    runtimes = ENGINES if runtime == "any" else (runtime,)
    dense, world = has_dense_mlp(space), space.mesh.gpus
    widths = {int(k.op("expert_ffn2").in_features or 0) for k in space.graph.layer_kinds
              if k.op("expert_ffn2") is not None}
    # a re-split copy keeps a dp_attn that does not divide the experts where moe_ep does
    # (:func:`shardc.ir.space.with_experts_split`)
    eps = space.values["ep"] if "ep" in space.fixed else divisors(world)
    out = set()
    for tp in space.values["tp"]:
        for ep in eps:
            group = tp * ep
            if world % group:
                continue
            for mt in range(1, group + 1):
                if group % mt or mt == tp or any(w and w % mt for w in widths):
                    continue
                me = group // mt
                if int(space.graph.config["num_experts"]) % me:
                    continue
                if plan_places_split(tp, ep, mt, me) and any(
                        experts_split_ok(r, tp, ep, mt, me, dense) for r in runtimes):
                    out.add(mt)
    return sorted(out)


def split_spaces(space: StrategySpace, runtime: str, sweep_dtensor: bool = False
                 ) -> list[StrategySpace]:
    """``space`` then its fixed-split copies for :func:`searched_splits` (``runtime``,
    ``sweep_dtensor``), each
    holding only the (tp, ep) pairs whose split differs from (tp, ep) (``space`` has those)
    and is one plan.json places (:func:`plan_places_split`)."""
    from shardc.ir.space import with_experts_split

    out = [space]
    for mt in searched_splits(space, runtime, sweep_dtensor):
        sp = with_experts_split(space, mt)
        pairs = []
        for tp in sp.values["tp"]:
            for ep in sp.values["ep"]:
                smt, sme = (int(x) for x in sp.experts_split(tp, ep))
                if (smt, sme) != (tp, ep) and plan_places_split(tp, ep, smt, sme) and (
                        space.allowed_tp_ep is None or (tp, ep) in space.allowed_tp_ep):
                    pairs.append((int(tp), int(ep)))
        sp.allowed_tp_ep = tuple(pairs)
        out.append(sp)
    return out


def degree_pairs(space: StrategySpace, mode: EngineMode, tps) -> tuple[tuple[int, int], ...]:
    """The (tp, ep) values of ``space`` that ``mode`` expresses, for the tp values ``tps``
    (with a fixed experts split: where its engine spells it, :func:`experts_split_ok`)."""
    dense = has_dense_mlp(space)
    out = []
    for tp in tps:
        for ep in space.values["ep"]:
            mt, me = (int(x) for x in space.experts_split(tp, ep))
            if mt and (mt, me) != (tp, ep):  # re-split: the engine's own rule
                if mode.engine and experts_split_ok(mode.engine, tp, ep, mt, me, dense):
                    out.append((int(tp), int(ep)))
                continue
            if tp > 1 and ep > 1 and (not mode.ep_with_tp or (dense and not mode.dense_with_tp_ep)):
                continue
            out.append((int(tp), int(ep)))
    return tuple(out)


def mode_space(space: StrategySpace, mode: EngineMode) -> StrategySpace | None:
    """``space`` restricted to what ``mode`` expresses (None when nothing is): same
    components and candidate values, every op slot's mask one choice per tp, the (tp, ep)
    pairs it has flags for, sp off where the engine has none."""
    rows = {t: mode_row(space, mode, t) for t in range(len(space.values["tp"]))}
    tps = [space.values["tp"][t] for t, r in rows.items() if r is not None]
    if not tps:
        return None
    out = copy.copy(space)
    out.values = dict(space.values)
    if not mode.sequence_parallel:
        if 0 not in space.values["sp"]:
            return None  # the user fixed sp on
        out.values["sp"] = [0]
    mask = np.zeros_like(space.op_mask_by_tp)
    for t, r in rows.items():
        if r is not None:
            mask[t, np.arange(len(r)), r] = True
        else:  # unreachable (degree_pairs drops this tp); keep every slot samplable
            mask[t, :, REP] = True
    out.op_mask_by_tp = mask
    pairs = degree_pairs(space, mode, tps)
    if not pairs:
        return None
    out.allowed_tp_ep = pairs
    return out


def mode_spaces(space: StrategySpace, engine: str) -> list[tuple[EngineMode, StrategySpace]]:
    """Every mode of ``engine`` with its restricted space (modes that express nothing left
    out); with fixed degrees (``--degrees``) the restriction applies inside them."""
    if engine not in ENGINE_MODES:
        raise ValueError(f"unknown engine {engine!r}")
    out = []
    for mode in ENGINE_MODES[engine]:
        ms = mode_space(space, mode)
        if ms is not None and _any_degrees(ms):
            out.append((mode, ms))
    return out


def _any_degrees(space: StrategySpace) -> bool:
    """Whether some (tp, ep, pp) of the restricted space tiles the mesh."""
    world = space.mesh.gpus
    for tp, ep in space.allowed_tp_ep:
        for pp in space.values["pp"]:
            if world % (tp * ep * pp) == 0 and bool(space.fixed_degrees_fit(tp, ep, pp)):
                return True
    return False


def strategy_mode(engine: str, space: StrategySpace, strategy) -> EngineMode | None:
    """The mode of ``engine`` that runs ``strategy`` as it is (None: none does)."""
    d = strategy.degrees
    for mode in ENGINE_MODES[engine]:
        if d.sp > 1 and not mode.sequence_parallel:
            continue
        if d.tp not in space.values["tp"]:
            continue
        row = mode_row(space, mode, space.values["tp"].index(d.tp))
        if row is None or (d.tp, d.ep) not in degree_pairs(space, mode, [d.tp]):
            continue
        if all(int(strategy.choices[s]) == int(c) for s, c in zip(space.op_slots, row)):
            return mode
    return None


def uses_dp_attention(space: StrategySpace, strategy) -> bool:
    """Every attention op of ``strategy`` runs data-parallel inside its tp group (tp > 1)."""
    att = [(s, op) for s, op in zip(space.op_slots, _ops(space)) if op in ATTENTION_DP]
    return (strategy.degrees.tp > 1 and bool(att)
            and all(int(strategy.choices[s]) == ATTENTION_DP[op] for s, op in att))


__all__ = ["RUNTIMES", "ENGINES", "ENGINE_NAMES", "ENGINE_MODES", "EngineMode", "mode_spaces",
           "mode_space", "mode_row", "strategy_mode", "uses_dp_attention", "has_dense_mlp"]


def runtime_choices(engine: str, space: StrategySpace, tp: int, ep: int, sp: int
                    ) -> tuple[list[dict[str, int]], str]:
    """The per-op choices of every mode of ``engine`` that runs degrees (tp, ep, sp) in
    ``space`` ([{slot: choice}], one per mode), and why none does when the list is empty."""
    name = ENGINE_NAMES[engine]
    if tp not in space.values["tp"]:
        return [], f"tp={tp} is not a candidate here"
    t = space.values["tp"].index(tp)
    out, why = [], []
    for mode in ENGINE_MODES[engine]:
        row = mode_row(space, mode, t)
        if row is None:
            if not (tp == 1 and mode.attention == "dp"):
                why.append(f"{mode.name}: an op {name} always splits does not divide by tp={tp}")
            continue
        if sp > 1 and not mode.sequence_parallel:
            why.append(f"{mode.name}: no sequence parallelism")
            continue
        mt, me = (int(x) for x in space.experts_split(tp, ep))
        if (tp, ep) not in degree_pairs(space, mode, [tp]) and mt and (mt, me) != (tp, ep):
            why.append(f"{mode.name}: its flags do not split the experts moe_tp={mt} x "
                       f"moe_ep={me} over tp={tp} x dp_attn={ep}")
            continue
        if (tp, ep) not in degree_pairs(space, mode, [tp]):
            why.append(f"{mode.name}: " + ("dense MLP layers at tp beside ep (they run at the "
                                            "instance's whole tp)" if mode.ep_with_tp else
                                            "experts split over tp inside ep groups (its expert "
                                            "parallelism spans all of an instance's ranks)"))
            continue
        out.append({s: int(c) for s, c in zip(space.op_slots, row)})
    return out, "; ".join(why)
