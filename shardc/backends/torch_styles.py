"""A strategy as torch ParallelStyles: per layer kind, module suffix -> style, from the
contract's walk (:func:`shardc.ir.contract.walk`).

This is what ``shardc compile --standalone`` writes into ``parallelize.py`` (see
:func:`shardc.backends.dtensor.emit_style_parallelize`): for each layer kind one
``parallelize_module(layers[i], tp_mesh, {...})`` plan -- torch's ``ColwiseParallel`` /
``RowwiseParallel`` for the ``col`` / ``row`` choices with the input and output layouts the
walk gives, and shardc's few own styles (:mod:`shardc.runtime.styles`) for the rest -- with
the collective each entry implies as a comment.

The activation placements of plan.json (``[tokens, features]``) become layouts of the HF
activation ``[batch, seq, hidden]``: ``R`` -> ``Replicate()``, ``S(1)`` -> ``Shard(-1)``,
``S(0)`` -> ``Shard(0)`` (batch rows: batch-split attention keeps whole sequences).

Covered (else :func:`style_plan` raises :class:`NotCovered` saying what): HF causal LMs whose
decoder layers are ``model.layers.<i>`` with Llama-style attention (``q/k/v/o_proj``, per-head
q/k norms, biases) or DeepSeek MLA (``q_a/q_b`` or ``q_proj``, ``kv_a_proj_with_mqa``,
``kv_b_proj``), a dense gated MLP or an HF sparse-MoE block (``mlp.gate`` + stacked
``mlp.experts``, optional ``shared_experts``); a router of choice ``rep``; experts
``col``/``row`` (not under sequence parallelism) or ``rep``/``rep``; batch-split attention
with ``rep`` q/k/v; under sequence parallelism the rows the attention module receives must
be the rows its core computes on (the model's own attention forward derives shapes from
its input). A repair before a branch's first op is made once at the branch module
(``PrepareModuleInput`` on ``self_attn`` / ``mlp`` / ``mlp.shared_experts``). With pp > 1
the same plans run on each pipeline stage's submesh (:mod:`shardc.backends.pipeline_styles`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from shardc.ir.contract import BRANCHES, CHOICE_NAMES, redistribution, walk
from shardc.ir.strategy import residual_placement

LAYOUT = {"R": "Replicate()", "S(0)": "Shard(0)", "S(1)": "Shard(-1)"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias|gate_up_proj|down_proj)$")
GLOBAL_PARAMS = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}


COVERED = ("covered: HF Llama-style decoders (Llama, Qwen2/3, Gemma-2) with a dense MLP or "
           "Mixtral / Qwen-MoE experts, DeepSeek-V2/V3 MLA with shared experts")


class NotCovered(ValueError):
    """The torch-style path does not (yet) cover this plan; the message says what."""


@dataclass
class Entry:
    """One line of a parallelize_module plan: module suffix, style code (built here from a
    fixed vocabulary, never from input) and the comment naming its collectives."""

    suffix: str
    style: str
    comment: str


@dataclass
class KindPlan:
    kind: str
    layers: list[int]
    notes: list[str]  # per branch: the choices and the collectives of its walk
    entries: list[Entry] = field(default_factory=list)
    experts: Entry | None = None  # applied on the ep x tp mesh


@dataclass
class StylePlan:
    kinds: list[KindPlan]
    model_entries: list[Entry]  # embedding, lm_head (tp mesh, from the model root)
    tp: int
    expert_mesh: bool  # some kind has experts and ep or tp > 1


def _collectives(src: str, need: str, produced: str, after: str) -> str:
    parts = []
    for a, b in ((src, need), (produced, after)):
        coll = redistribution(a, b)
        if coll:
            parts.append(f"{coll} {a}->{b}")
    return ", ".join(parts) or "no collective"


def _style(op: str, step, src: str) -> str | None:
    """Style code realising ``step`` (a contract Walk step) on input placement ``src``."""
    need, produced, after = step.need, step.produced, step.after
    ps = step.choice.parallel_style
    args = []
    if ps == "ColwiseParallel":
        if src != "R":
            args.append(f"input_layouts={LAYOUT[src]}")
        if after != "S(1)":
            args.append(f"output_layouts={LAYOUT[after]}")
    elif ps == "RowwiseParallel":
        if src != "S(1)" or op == "embedding":
            args.append(f"input_layouts={LAYOUT[src]}")
        if after != "R":
            args.append(f"output_layouts={LAYOUT[after]}")
    elif ps is None:
        if src == need == produced == after:
            return None
        args = [f"input_layouts={LAYOUT[src]}"]
        if need != src:
            args.append(f"desired_input_layouts={LAYOUT[need]}")
        if after != need:
            args.append(f"output_layouts={LAYOUT[after]}")
        ps = "ReplicateParallel"
    else:
        raise NotCovered(f"{op} {step.choice.name} ({ps}) is not a linear style")
    return f"{ps}({', '.join(args)})"


def _structure(params: list[dict], layer: int) -> dict[str, list[str]]:
    """Module suffixes of decoder layer ``layer`` grouped by role, from plan.json params."""
    roles: dict[str, list[str]] = {}
    for p in params:
        m = _LAYER.match(str(p["fqn"]))
        if not m or int(m.group(1)) != layer:
            continue
        mod = m.group(2)
        if m.group(3) in ("gate_up_proj", "down_proj"):
            mod = f"{mod}.{m.group(3)}"
        name = mod.rsplit(".", 1)[-1]
        if mod in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                   "self_attn.q_b_proj", "self_attn.kv_b_proj"):
            role = "qkv"
        elif mod in ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa",
                     "self_attn.q_a_layernorm", "self_attn.kv_a_layernorm"):
            role = "mla_down"
        elif mod in ("self_attn.q_norm", "self_attn.k_norm"):
            role = "qk_norm"
        elif mod == "self_attn.o_proj":
            role = "out_proj"
        elif mod in ("mlp.gate_proj", "mlp.up_proj", "mlp.shared_experts.gate_proj",
                     "mlp.shared_experts.up_proj"):
            role = "shared_ffn1" if "shared" in mod else "ffn1"
        elif mod in ("mlp.down_proj", "mlp.shared_experts.down_proj"):
            role = "shared_ffn2" if "shared" in mod else "ffn2"
        elif mod == "mlp.gate":
            role = "router"
        elif mod in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            role = "experts"
        elif "." not in mod and len(p["shape"]) == 1:
            role = "norm"
        else:
            raise NotCovered(f"parameter {name} of {mod!r} in layer {layer} is not in a "
                             f"layer the torch-style runtime knows ({COVERED})")
        if m.group(3) == "bias" and role not in ("qkv", "out_proj", "norm"):
            raise NotCovered(f"a bias on {mod!r} in layer {layer} is not covered")
        roles.setdefault(role, [])
        if mod not in roles[role]:
            roles[role].append(mod)
        if role == "qk_norm":
            roles.setdefault("qk_norm_width", []).append(str(p["shape"][0]))
    return roles


def _qkv_width(params: list[dict], layer: int) -> int:
    for p in params:
        if str(p["fqn"]) == f"model.layers.{layer}.self_attn.q_proj.weight":
            return int(p["shape"][0])
    return -1


def style_plan(plan) -> StylePlan:
    """The :class:`StylePlan` of a :class:`shardc.plan.Plan` (raises :class:`NotCovered`)."""
    st = plan.strategy()
    deg = st.degrees
    others = sorted({str(p["fqn"]) for p in plan.params
                     if not _LAYER.match(str(p["fqn"]))} - GLOBAL_PARAMS)
    if others:
        raise NotCovered(f"{plan.model.get('name')}: parameter {others[0]!r} is outside an HF "
                         "causal LM's model.layers / embed_tokens / norm / lm_head (" + COVERED + ")")
    res = residual_placement(deg)
    tp = deg.tp
    kinds, any_experts = [], False
    for kind, layers in plan.layer_kind_map().items():
        roles = _structure(plan.params, layers[0])

        def choice(op, kind=kind):
            return int(st.choices.get(f"{kind}.{op}", 2))

        kp = KindPlan(str(kind), [int(i) for i in layers], [])
        branches = ["attention"] + (["mlp"] if "ffn1" in roles else []) \
            + (["shared_experts"] if "shared_ffn1" in roles else []) \
            + (["router", "experts"] if "experts" in roles else [])
        for branch in branches:
            ops = BRANCHES[branch]
            w = walk(ops, [choice(o) for o in ops], res, res)
            desc = " -> ".join(f"{s.op} {s.choice.name}" for s in w.steps)
            colls = ", ".join(f"{c} {a}->{b} before {op}" for op, a, b, c in w.collectives())
            kp.notes.append(f"{branch}: {desc} ({colls or 'no collective'})" if tp > 1
                            else f"{branch}: tp=1, no tp collective")
            if tp > 1:
                _branch_entries(kp, branch, w, roles, res, plan.params, layers[0])
        if "experts" in roles:
            any_experts = True
            (f1, f2) = (choice("expert_ffn1"), choice("expert_ffn2"))
            if tp > 1 and (f1, f2) not in ((0, 1), (2, 2)):
                names = "/".join(CHOICE_NAMES[op][c] for op, c in
                                 (("expert_ffn1", f1), ("expert_ffn2", f2)))
                raise NotCovered(f"{kind}: experts {names} (covered: col/row, rep/rep)")
            split = tp > 1 and (f1, f2) == (0, 1)
            if split and res != "R":
                raise NotCovered(f"{kind}: col/row experts under sequence parallelism "
                                 "(covered: rep/rep)")
            what = ("counts exchanged, then uneven all_to_all_single dispatch + combine "
                    f"over ep={deg.ep}") if deg.ep > 1 else "no ep exchange"
            if split:
                what += "; all_reduce P->R of the expert outputs over tp"
            if deg.ep > 1 or tp > 1:
                kp.experts = Entry("mlp.experts",
                                   f"ExpertParallel(tp_split={split})", what)
        kinds.append(kp)
    model_entries = []
    if tp > 1:
        for op, mod, start, end in (("embedding", "model.embed_tokens", "R", res),
                                    ("lm_head", "lm_head", res, "R")):
            step = walk((op,), [int(st.choices.get(op, 2))], start, end).steps[0]
            code = _style(op, step, start)
            if code:
                model_entries.append(Entry(mod, code, f"{op} {step.choice.name}: "
                                           + _collectives(start, step.need, step.produced,
                                                          step.after)))
    return StylePlan(kinds, model_entries, tp, any_experts and (deg.ep > 1 or tp > 1))


# the module each branch's ops live in: a repair before the branch's first op is made once
# there (torch's PrepareModuleInput), so the module's own code sees the rows it computes on
BRANCH_MODULE = {"attention": "self_attn", "mlp": "mlp", "shared_experts": "mlp.shared_experts"}


def _rows(p: str) -> str:
    return "split" if p == "S(0)" else "whole"


def _prepare(kp: KindPlan, branch: str, src: str, want: str, first_op: str) -> str:
    """Entry moving the branch module's input from ``src`` to ``want``; returns the
    placement the first op then receives. With a replicated residual a feature split is
    left to the op's own style (a local slice) and a row split is BatchSplitAttention's."""
    if src == want or src == "R" and want == "S(1)":
        return src
    if src == "R" and want == "S(0)":
        kp.entries.append(Entry(BRANCH_MODULE[branch], "BatchSplitAttention()",
                                "attn_core batch: R->S(0) rows, a local slice"))
        return want
    coll = redistribution(src, want) or "no collective"
    note = f"{coll} {src}->{want} before {first_op}, once for the branch"
    if branch == "attention":  # HF decoder layers pass hidden_states by keyword
        code = (f"PrepareModuleInput(input_kwarg_layouts={{'hidden_states': {LAYOUT[src]}}}, "
                f"desired_input_kwarg_layouts={{'hidden_states': {LAYOUT[want]}}}, "
                "use_local_output=True)")
    else:
        code = (f"PrepareModuleInput(input_layouts=({LAYOUT[src]},), "
                f"desired_input_layouts=({LAYOUT[want]},), use_local_output=True)")
    kp.entries.append(Entry(BRANCH_MODULE[branch], code, note))
    return want


def _branch_entries(kp: KindPlan, branch: str, w, roles, res, params, layer) -> None:
    steps = {s.op: s for s in w.steps}
    if branch == "router":
        s = steps["router"]
        if s.choice.parallel_style is not None or _style("router", s, res):
            raise NotCovered(f"{kp.kind}: router {s.choice.name} (covered: rep)")
        return
    if branch == "experts":
        return
    if branch == "attention":
        qkv, core, out = steps["qkv"], steps["attn_core"], steps["out_proj"]
        batch = core.choice.name == "batch"
        if batch and qkv.choice.name != "rep":
            raise NotCovered(f"{kp.kind}: batch-split attention after qkv "
                             f"{qkv.choice.name} (covered: rep)")
        attn_in = "S(0)" if batch else qkv.need
        if _rows(attn_in) != _rows(core.need):
            raise NotCovered(f"{kp.kind}: qkv {qkv.choice.name} under sequence parallelism "
                             f"before attention by {core.choice.name}")
        if "mla_down" in roles and res != "R" and attn_in == "S(1)":
            raise NotCovered(f"{kp.kind}: MLA qkv row under sequence parallelism")
        src = _prepare(kp, branch, res, attn_in, "qkv")
        if not batch:
            split_norm = [n for n in roles.get("qk_norm_width", [])
                          if int(n) == _qkv_width(params, layer)]
            if split_norm and qkv.after == "S(1)":
                raise NotCovered(f"{kp.kind}: q/k norms over the whole projection under a "
                                 "heads split are not covered")
            code = _style("qkv", qkv, src)
            for mod in roles.get("qkv", []) if code else []:
                kp.entries.append(Entry(mod, code, f"qkv {qkv.choice.name}: " + _collectives(
                    src, qkv.need, qkv.produced, qkv.after)))
        code = _style("out_proj", out, core.produced)
        if code:
            kp.entries.append(Entry("self_attn.o_proj", code, f"out_proj {out.choice.name}: "
                                    + _collectives(core.produced, out.need, out.produced,
                                                   out.after)))
        return
    first, second = BRANCHES[branch]
    src = _prepare(kp, branch, res, steps[first].need, first)
    for op in (first, second):
        s = steps[op]
        code = _style(op, s, src)
        for mod in roles.get(op, []) if code else []:
            kp.entries.append(Entry(mod, code, f"{op} {s.choice.name}: " + _collectives(
                src, s.need, s.produced, s.after)))
        src = s.after
