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

Covered (else :func:`style_plan` raises :class:`NotCovered` saying what): every model the
backend accepts (decoder layers under one module list: HF ``model.layers``, GPT-2's
``transformer.h``, a plain model's ``layers``), every choice except: batch-split
attention after a ``col`` / ``row`` qkv; under sequence parallelism a ``rep`` qkv before a
heads split (the model's attention forward sizes its output from the rows it receives);
expert pairs other than ``col``/``row`` and ``rep``/``rep``
for experts that are not HF gated ``[E, out, in]`` or under sequence parallelism; a heads
split at tp > kv_heads (KV heads replicated). Which
module realises which op, how its weight is stored and what it packs come from plan.json's
params rows (``op``, ``layer``, ``split_dims``, ``parts``, ``tied``: the IR's, see
:mod:`shardc.ir.param_roles`). A repair before a branch's first op is made once at the
branch module (``PrepareHiddenStates`` on the attention module, ``PrepareModuleInput`` on
the MLP / shared-experts module). With pp > 1 the same plans run on each pipeline stage's
submesh (:mod:`shardc.backends.pipeline_styles`: HF causal LMs' ``model.layers`` /
``embed_tokens`` / ``norm`` / ``lm_head`` only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardc.backends.emit_text import _literal
from shardc.backends.fused_styles import fused_experts_entry
from shardc.backends.gathered_styles import gathered_entry
from shardc.backends.head_styles import (
    head_vectors,
    heads_split,
    kv_modules,
    kv_repeat,
    mamba2_core,
)
from shardc.backends.layer_modules import (
    LayerModules,
    attention_module,
    global_modules,
    layer_modules,
    parent_module,
)
from shardc.backends.style_entry import Entry, NotCovered
from shardc.ir.contract import BRANCHES, CHOICE_NAMES, redistribution, walk
from shardc.ir.strategy import residual_placement

LAYOUT = {"R": "Replicate()", "S(0)": "Shard(0)", "S(1)": "Shard(-1)"}




@dataclass
class KindPlan:
    kind: str
    layers: list[int]
    notes: list[str]  # per branch: the choices and the collectives of its walk
    entries: list[Entry] = field(default_factory=list)
    experts: Entry | None = None  # applied on the ep x tp mesh
    kv_replicas: int = 1  # GQA heads split at tp > kv_heads: ranks holding each KV head
    heads: int = 0  # query heads (plan.json model.heads), read when kv_replicas > 1
    recurrent: str | None = None  # plan.json layer_kinds attention of a recurrent core


@dataclass
class StylePlan:
    kinds: list[KindPlan]
    model_entries: list[Entry]  # embedding, lm_head (tp mesh, from the model root)
    tp: int
    expert_mesh: bool  # some kind has experts and ep or tp > 1
    layers: str = "model.layers"  # module path of the decoder-layer list


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


def _for_weight(code: str | None, row: dict | None) -> str | None:
    """``code`` adapted to the module's weight (its params row): torch's Colwise / Rowwise
    styles take ``nn.Linear`` weights ``[out, in]``; a weight stored otherwise (GPT-2's Conv1D
    ``[in, out]``) or packing parts gets :class:`~shardc.runtime.styles.WeightColwiseParallel`
    / ``WeightRowwiseParallel`` with the dims and part widths (integers) from the row."""
    if code is None or row is None or len(row["shape"]) != 2:
        return code
    dims = [int(d) for d in row.get("split_dims") or (0, 1)]
    parts = tuple(int(w) for w in row.get("parts") or ())
    inner = code[code.index("(") + 1:-1]
    if code.startswith("ColwiseParallel(") and (dims != [0, 1] or parts):
        head = f"out_dim={dims[0]}" + (f", parts={parts}" if parts else "")
        return f"WeightColwiseParallel({head}{', ' + inner if inner else ''})"
    if code.startswith("RowwiseParallel(") and (dims != [0, 1] or parts):
        head = f"in_dim={dims[1]}" + (f", parts={parts}" if parts else "")
        return f"WeightRowwiseParallel({head}{', ' + inner if inner else ''})"
    if code.startswith("WeightRowwiseParallel(") and parts:
        return code.replace("WeightRowwiseParallel(", f"WeightRowwiseParallel(parts={parts}, ", 1)
    if code.startswith("ReplicateParallel(") and parts:
        return f"{code[:-1]}, parts={parts})"
    return code


def style_plan(plan) -> StylePlan:
    """The :class:`StylePlan` of a :class:`shardc.plan.Plan` (raises :class:`NotCovered`)."""
    from shardc.backends.layout import rows_with_ops

    st = plan.strategy()
    deg = st.degrees
    rows = rows_with_ops(plan.params)
    res = residual_placement(deg)
    tp = deg.tp
    kinds, any_experts, container = [], False, None
    recurrent = {row.get("name"): str(row.get("attention")) for row in plan.layer_kinds or ()
                 if row.get("recurrent_state")}
    for kind, layers in plan.layer_kind_map().items():
        lm = layer_modules(rows, layers[0])
        if container not in (None, lm.container):
            raise NotCovered(f"decoder layers under {container!r} and {lm.container!r}")
        container = lm.container

        def choice(op, kind=kind):
            return int(st.choices.get(f"{kind}.{op}", 2))

        kp = KindPlan(str(kind), [int(i) for i in layers], [],
                      recurrent=recurrent.get(kind) or mamba2_core(lm))
        kv_heads = int(plan.model.get("kv_heads") or 0)
        if tp > 1 and kv_heads and tp > kv_heads and choice("attn_core") == 0 \
                and kp.recurrent is None:  # a recurrent core splits its own heads
            if tp % kv_heads:
                raise NotCovered(f"{kind}: heads split at tp={tp} over {kv_heads} KV heads")
            kp.kv_replicas = tp // kv_heads
            kp.heads = int(plan.model.get("heads") or 0)
        branches = (["attention"] if "qkv" in lm.ops else []) \
            + (["mlp"] if "ffn1" in lm.ops else []) \
            + (["shared_experts"] if "shared_ffn1" in lm.ops else []) \
            + (["router", "experts"] if "expert_ffn1" in lm.ops else [])
        for branch in branches:
            ops = BRANCHES[branch]
            w = walk(ops, [choice(o) for o in ops], res, res)
            desc = " -> ".join(f"{s.op} {s.choice.name}" for s in w.steps)
            colls = ", ".join(f"{c} {a}->{b} before {op}" for op, a, b, c in w.collectives())
            if branch == "experts" and deg.experts_resplit:  # the all-gather dispatch
                colls = f"moe_tp={deg.moe_tp} x moe_ep={deg.moe_ep}: GatheredExperts below"
            kp.notes.append(f"{branch}: {desc} ({colls or 'no collective'})" if tp > 1
                            else f"{branch}: tp=1, no tp collective")
            if tp > 1:
                _branch_entries(kp, branch, w, lm, res)
        if "expert_ffn1" in lm.ops:
            any_experts = True
            if deg.experts_resplit and expert_biases(lm):
                raise NotCovered(f"{kind}: experts with biases re-split moe_tp={deg.moe_tp} x "
                                 f"moe_ep={deg.moe_ep} (they run on the tp x ep mesh)")
            kp.experts = (gathered_entry(str(kind), lm, choice, deg)
                          if deg.experts_resplit else
                          _experts_entry(str(kind), lm, choice, deg, res))
        seen = [e.suffix for e in kp.entries]
        if len(set(seen)) != len(seen):  # a dict literal keeps one style per module
            raise NotCovered(f"{kind}: two styles on one module {seen}")
        kinds.append(kp)
    model_entries = []
    where = global_modules(rows)
    if tp > 1:
        for op, start, end in (("embedding", "R", res), ("lm_head", res, "R")):
            step = walk((op,), [int(st.choices.get(op, 2))], start, end).steps[0]
            code = _style(op, step, start)
            if code and op not in where:
                raise NotCovered(f"{op} {step.choice.name}: no {op} module in the plan's "
                                 "params")
            if code:
                model_entries.append(Entry(where[op], code, f"{op} {step.choice.name}: "
                                           + _collectives(start, step.need, step.produced,
                                                          step.after)))
    return StylePlan(kinds, model_entries, tp, any_experts and (deg.ep > 1 or tp > 1),
                     container or "model.layers")


HF_EXPERT_WEIGHTS = {"gate_up_proj": (1, (2,)), "down_proj": (2, ())}  # the style's default


def _experts_entry(kind: str, lm: LayerModules, choice, deg, res) -> Entry | None:
    """The ExpertParallel entry of a layer with stacked experts (ep x tp mesh): the weights'
    names, tp dims (the first weight's output features, the second's input features) and
    packed parts come from the params rows."""
    tp = deg.tp
    (f1, f2) = (choice("expert_ffn1"), choice("expert_ffn2"))
    chain = tp > 1 and (f1, f2) not in ((0, 1), (2, 2))
    split = tp > 1 and (f1, f2) != (2, 2)
    mods = lm.ops["expert_ffn1"] + [m for m in lm.ops.get("expert_ffn2", [])
                                    if m not in lm.ops["expert_ffn1"]]
    first = [(n, r) for _, n, r in lm.params_of("expert_ffn1") if len(r["shape"]) == 3]
    second = [(n, r) for _, n, r in lm.params_of("expert_ffn2") if len(r["shape"]) == 3]
    if len(mods) == 1 and len(first) == 2 and len(second) == 1:
        return fused_experts_entry(kind, mods[0], first + second, (f1, f2), deg, res)
    biases = expert_biases(lm)
    if len(mods) != 1 or len(first) != 1 or len(second) != 1 or \
            len(lm.params_of("expert_ffn1")) + len(lm.params_of("expert_ffn2")) != \
            2 + len(biases):
        raise NotCovered(f"{kind}: experts in {mods}: one stacked weight per expert matmul "
                         "(and GPT-OSS's [E, out] biases) is covered")
    if biases and tp > 1 and (f1, f2) not in ((0, 1), (2, 2)):
        raise NotCovered(f"{kind}: experts with biases run col/row or rep/rep over tp (not "
                         f"{CHOICE_NAMES['expert_ffn1'][f1]}/{CHOICE_NAMES['expert_ffn2'][f2]})")
    (n1, r1), (n2, r2) = first[0], second[0]
    if r1.get("expert_dim") != 0 or r2.get("expert_dim") != 0:
        raise NotCovered(f"{kind}: experts stacked on a dim other than 0")
    parts1 = tuple(int(w) for w in r1.get("parts", ()))
    what = ("counts exchanged, then uneven all_to_all_single dispatch + combine "
            f"over ep={deg.ep}") if deg.ep > 1 else "no ep exchange"
    if chain:
        names = "/".join(CHOICE_NAMES[op][c] for op, c in
                         (("expert_ffn1", f1), ("expert_ffn2", f2)))
        layouts = [r1["split_dims"], r2["split_dims"]]
        if parts1 and len(parts1) != 2 or layouts not in ([[1, 2], [1, 2]], [[2, 1], [2, 1]]):
            raise NotCovered(f"{kind}: experts {names} stored {layouts} with parts {parts1} "
                             "(covered: [E, out, in] or [E, in, out], gate|up or no parts)")
        in_out = layouts == [[2, 1], [2, 1]]
        dims = tuple(None if c == 2 else int(r["split_dims"][c])
                     for r, c in ((r1, f1), (r2, f2)))
        what += f"; experts {names} over tp, the activation moved between them as the walk says"
        if res != "R":
            what += " (the tp ranks' rows all-gathered first, each keeps its own rows)"
    else:
        dims = (int(r1["split_dims"][0]), int(r2["split_dims"][1]))
        if split and res != "R":
            what += ("; all_gather S(0)->R of the tokens, reduce_scatter P->S(0) of the "
                     "outputs over tp")
        elif split:
            what += "; all_reduce P->R of the expert outputs over tp"
    if parts1:  # equal parts: the style's count form
        parts1 = (len(parts1),) if len(set(parts1)) == 1 else parts1
    weights = {str(n1): (dims[0], parts1), str(n2): (dims[1], ())}
    # GPT-OSS: the first bias cut with its weight's output features, the second whole over
    # tp -- Partial under a row split (added once to the partial sums)
    weights.update({str(n): (1 if op == "expert_ffn1" else None, ()) for n, op in biases})
    partial = tuple(str(n) for n, op in biases if op == "expert_ffn2" and split)
    args = [f"tp_split={split}"]
    if weights != HF_EXPERT_WEIGHTS:  # names from the plan: literals; dims and widths: ints
        items = ", ".join(f"{_literal(k)}: ({d}, {tuple(int(w) for w in ps)!r})"
                          for k, (d, ps) in weights.items())
        args.append(f"weights={{{items}}}")
    if chain:
        args.append(f"chain=({CHOICE_NAMES['expert_ffn1'][f1]!r}, "
                    f"{CHOICE_NAMES['expert_ffn2'][f2]!r})")
        if in_out:
            args.append("in_out=True")
    if split and res != "R":
        args.append("token_rows=True")
    if partial:
        args.append(f"partial={_literal(partial)}")
        what += "; the down-projection bias on tp rank 0 (Partial)"
    if deg.ep > 1 or tp > 1:
        return Entry(mods[0], f"ExpertParallel({', '.join(args)})", what)
    return None


def expert_biases(lm: LayerModules) -> list[tuple[str, str]]:
    """(parameter name, op) of the layer's expert biases: ``[E, out]`` rows of the expert
    ops (GPT-OSS's ``gate_up_proj_bias`` / ``down_proj_bias``, :mod:`shardc.ir.param_roles`)."""
    return [(n, op) for op in ("expert_ffn1", "expert_ffn2") for _, n, r in lm.params_of(op)
            if len(r["shape"]) == 2 and r.get("expert_dim") == 0]


def _rows(p: str) -> str:
    return "split" if p == "S(0)" else "whole"


def _prepare(kp: KindPlan, module: str, branch: str, src: str, want: str,
             first_op: str) -> str:
    """Entry moving the branch ``module``'s input from ``src`` to ``want`` (a repair before
    the branch's first op is made once there, torch's PrepareModuleInput, so the module's
    own code sees the rows it computes on); returns the placement the first op then
    receives. With a replicated residual a feature split is left to the op's own style (a
    local slice) and a row split is BatchSplitAttention's."""
    if src == want or src == "R" and want == "S(1)":
        return src
    if src == "R" and want == "S(0)":
        kp.entries.append(Entry(module, "BatchSplitAttention()",
                                "attn_core batch: R->S(0) rows, a local slice"))
        return want
    coll = redistribution(src, want) or "no collective"
    note = f"{coll} {src}->{want} before {first_op}, once for the branch"
    if branch == "attention":  # by keyword (HF decoder layers) or positionally (GPT-2)
        code = (f"PrepareHiddenStates(input_layouts={LAYOUT[src]}, "
                f"desired_input_layouts={LAYOUT[want]})")
    else:
        code = (f"PrepareModuleInput(input_layouts=({LAYOUT[src]},), "
                f"desired_input_layouts=({LAYOUT[want]},), use_local_output=True)")
    kp.entries.append(Entry(module, code, note))
    return want


def _core_rows(kp: KindPlan, lm: LayerModules, attn: str, res: str, attn_in: str,
               core_need: str) -> str:
    """The ``CoreRowsAttention`` entry of an attention module whose core runs on other
    batch rows than its q/k/v projections read (batch-split attention after a ``col`` /
    ``row`` qkv; under sp a ``rep`` qkv before a heads split); returns the placement the
    projections receive. Module suffixes enter the code as literals."""
    projections = tuple(m[len(attn) + 1:] for m in lm.ops.get("qkv", []))
    args = [f"core_layouts={LAYOUT['S(0)' if _rows(core_need) == 'split' else 'R']}",
            f"projections={_literal(projections)}"]
    moved = not (res == attn_in or res == "R" and attn_in == "S(1)")
    if moved:
        args += [f"input_layouts={LAYOUT[res]}", f"desired_input_layouts={LAYOUT[attn_in]}"]
    if _rows(core_need) == "split":
        note = "attn_core batch: the module runs on this rank's rows, q/k/v moved to them"
    else:
        note = "attn_core on whole rows: q/k/v computed on this rank's rows, then moved"
    if moved:
        note = f"{redistribution(res, attn_in)} {res}->{attn_in} before qkv; " + note
    kp.entries.append(Entry(attn, f"CoreRowsAttention({', '.join(args)})", note))
    return attn_in if moved else res


def _branch_entries(kp: KindPlan, branch: str, w, lm: LayerModules, res) -> None:
    steps = {s.op: s for s in w.steps}
    if branch == "router":
        s = steps["router"]
        code = _style("router", s, res)
        if code and s.choice.parallel_style is not None:
            code = f"RouterParallel({code})"  # an HF router module computes its own top-k
        routers = lm.ops.get("router", []) if code else []
        for mod in routers:
            if any(mod.startswith(m + ".") for m in routers):
                continue  # a module inside the router (ERNIE's moe_statics): its own code
            kp.entries.append(Entry(mod, code, f"router {s.choice.name}: " + _collectives(
                res, s.need, s.produced, s.after)))
        return
    if branch == "experts":
        return
    if branch == "attention":
        qkv, core, out = steps["qkv"], steps["attn_core"], steps["out_proj"]
        attn = attention_module(lm)
        batch = core.choice.name == "batch" and qkv.choice.name == "rep"
        attn_in = "S(0)" if batch else qkv.need
        if lm.replicated and res != "R" and (attn_in == "S(1)" or qkv.choice.name == "rep"
                                             and _rows(attn_in) != _rows(core.need)):
            # MLA under sp: the replicated down projections need the whole hidden vector:
            attn_in = "R"  # all-gathered (the walk charges an all-to-all after qkv), sliced
        if _rows(attn_in) != _rows(core.need):  # the core runs on other rows than qkv reads
            src = _core_rows(kp, lm, attn, res, attn_in, core.need)
        else:
            src = _prepare(kp, attn, branch, res, attn_in, "qkv")
        if not batch:
            code = _style("qkv", qkv, src)
            if qkv.choice.name == "rep" and src != qkv.need:  # MLA under sp: sliced locally
                code = (f"ReplicateParallel(input_layouts={LAYOUT[src]}, "
                        f"output_layouts={LAYOUT[qkv.after]})")
            kv_mods = kv_modules(kp, lm) if qkv.after == "S(1)" else {}
            for mod in lm.ops.get("qkv", []) if code else []:
                kp.entries.append(Entry(mod, kv_repeat(_for_weight(code, lm.weight_of(mod)),
                                                        kv_mods.get(mod), kp.kv_replicas),
                                        f"qkv {qkv.choice.name}: " + _collectives(
                                            src, qkv.need, qkv.produced, qkv.after)
                                        + ("; KV heads repeated x"
                                           f"{kp.kv_replicas}" if mod in kv_mods else "")))
            if qkv.after == "S(1)":
                heads_split(kp, lm, attn)
        if core.choice.name == "heads" and kp.recurrent is None:  # (Mamba-2: its own style)
            head_vectors(kp, lm, attn)
        code = _style("out_proj", out, core.produced)
        for mod in lm.ops.get("out_proj", []) if code else []:
            kp.entries.append(Entry(mod, _for_weight(code, lm.weight_of(mod)),
                                    f"out_proj {out.choice.name}: " + _collectives(
                                        core.produced, out.need, out.produced, out.after)))
        return
    first, second = BRANCHES[branch]
    module = parent_module(lm.ops.get(first, []) + lm.ops.get(second, []), branch)
    src = _prepare(kp, module, branch, res, steps[first].need, first)
    for op in (first, second):
        s = steps[op]
        code = _style(op, s, src)
        for mod in lm.ops.get(op, []) if code else []:
            kp.entries.append(Entry(mod, _for_weight(code, lm.weight_of(mod)),
                                    f"{op} {s.choice.name}: " + _collectives(
                                        src, s.need, s.produced, s.after)))
        src = s.after
