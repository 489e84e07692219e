"""Can the DTensor backend run this model faithfully? Checked before ``compile`` writes files.

:func:`backend_problem` answers from the module structure (the adapter of
:mod:`shardc.backends.models`), not from a list of model names:

* the adapter must know the layout (decoder layers, attention, MLP or MoE block);
* every parameter must be placed by some op of the runtime (the projections, the MoE
  router and expert weights, the layer's own norms, q/k norms inside attention) -- an
  unplaced one (an attention sink, an expert bias, a shared-expert gate) is a part the
  sharded forward would skip;
* the MoE routing must be one shardc models and charges (softmax top-k, DeepSeek-V2 / V3,
  sparsemixer: :func:`shardc.backends.models.routing_kind`; the runtime runs the model's own
  router), the stacked expert weights in the layout the runtime reads;
* q/k norms inside attention must be weight-only RMSNorms (per head, or over the whole
  projection: ``FullWidthNormParallel``);
* attention features the layout-aware forward does not implement are refused (chunked
  attention, layers without rotary embeddings).

:func:`backend_verdict` answers for ``shardc compile``: the plan, its reports and the engine
launch scripts are written whatever the answer (neither engine needs this backend), and
plan.json ``backend {runs, reason}`` records it; a model the backend cannot run gets no
``parallelize.py``. :func:`check_module` raises :class:`InputError` (exit 2) naming the family
and the part, for what needs the backend (``shardc verify``, ``Plan.apply``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

from shardc.errors import InputError


def _params_of(mod: nn.Module, prefix: str, names=None) -> set[str]:
    if names is not None:
        return {f"{prefix}.{n}" for n in names}
    return {f"{prefix}.{n}" for n, _ in mod.named_parameters()}


def _attention_problem(att, family: str) -> str | None:
    mod = att.module
    if family == "gpt2" and (getattr(mod, "reorder_and_upcast_attn", False)
                             or getattr(mod, "is_cross_attention", False)):
        return "GPT-2 attention with reorder_and_upcast_attn or cross-attention"
    if family not in ("hf", "gpt2"):
        return None
    if not att.mla and not all(hasattr(mod, a) for a in ("head_dim", "scaling", "layer_idx")):
        return f"attention {type(mod).__name__} without head_dim / scaling / layer_idx"
    cfg = getattr(mod, "config", None)
    if float(getattr(cfg, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        return "partial rotary embeddings"
    if getattr(mod, "attention_chunk_size", None) or getattr(cfg, "attention_chunk_size", None):
        return "chunked attention"  # Llama-4
    if getattr(mod, "use_rope", True) is False:
        return "attention layers without rotary embeddings"
    for norm, pre in att.qk_norms:
        names = [n for n, _ in norm.named_parameters()]
        if names != ["weight"]:
            return f"{pre}: q/k norm with parameters {names} (only weight-only RMSNorm)"
    return None


def _owned(ad) -> tuple[set[str], str | None]:
    """Parameter FQNs the runtime places, and the first unsupported part (or None)."""
    owned: set[str] = set()
    for mod, pre in [ad.embedding, ad.final_norm, ad.lm_head] + \
            list(getattr(ad, "position_embeddings", [])):
        owned |= _params_of(mod, pre)
    for i in range(ad.num_layers):
        try:
            site = ad.layer(i)
        except InputError as e:
            return owned, str(e)
        except AttributeError as e:
            return owned, f"layer {i}: a layout the DTensor backend does not know ({e})"
        att = site.attention
        for mod, pre in att.qkv + [att.out] + att.down + att.down_norms + att.qk_norms:
            owned |= _params_of(mod, pre)
        sinks = getattr(att.module, "sinks", None)  # GPT-OSS: a learned logit per head
        if sinks is not None and tuple(getattr(sinks, "shape", ())) == (att.heads,):
            owned.add(f"{att.qkv[0][1].rsplit('.', 1)[0]}.sinks")
        problem = _attention_problem(att, ad.family)
        if problem:
            return owned, f"layer {i}: {problem}"
        for mod, pre in site.norms:
            owned |= _params_of(mod, pre)
        if site.mlp is not None:
            ffn1, ffn2 = site.mlp
            for mod, pre in ffn1 + [ffn2]:
                owned |= _params_of(mod, pre)
        if site.moe is not None:
            moe = site.moe
            owned |= _params_of(moe.router[0], moe.router[1], ["weight"] + (
                ["bias"] if getattr(moe.router[0], "bias", None) is not None and moe.biases
                else []))  # GPT-OSS's router adds a bias to its scores
            if moe.fused:  # DBRX: experts.mlp.{w1, v1, w2}
                owned |= _params_of(moe.experts, f"{moe.prefix}.experts.mlp", moe.fused)
            else:  # GPT-OSS: their biases too ([E, 2f], [E, h]: split with the weights)
                owned |= _params_of(moe.experts, f"{moe.prefix}.experts",
                                    [moe.w1, moe.w2, *moe.biases])
            if moe.shared is not None:
                ffn1, ffn2, _ = moe.shared
                for mod, pre in ffn1 + [ffn2]:
                    owned |= _params_of(mod, pre)
            problem = _moe_problem(moe, ad)
            if problem:
                return owned, f"layer {i}: {problem}"
    return owned, None


def _moe_problem(moe, ad) -> str | None:
    if moe.routing is None:
        return (f"router {type(moe.router[0]).__name__}: routing the backend does not "
                "implement (softmax top-k, DeepSeek-V2 / V3, sparsemixer)")
    if moe.fused:  # DBRX: [E * f, h] each, placed as [E, f, h] views
        return None
    w1 = getattr(moe.experts, moe.w1)
    hidden = int(ad.embedding[0].weight.shape[-1])
    in_dim = w1.shape[-1] if moe.transposed else w1.shape[1]
    if w1.ndim != 3 or int(in_dim) != hidden:
        return (f"expert weights {moe.prefix}.experts.{moe.w1} {list(w1.shape)} are not "
                "stacked [experts, out, in] as the backend reads them")
    return None


def backend_problem(model: nn.Module) -> str | None:
    """Why the DTensor backend cannot run ``model`` as the model computes it (None if it can)."""
    from shardc.backends.models import adapter_for
    from shardc.frontends.stateful_layers import stateful_layers

    blocks = sorted({str(m.block_type) for _, m in model.named_modules()
                     if hasattr(m, "mixer") and isinstance(getattr(m, "block_type", None), str)}
                    - set(HYBRID_BLOCKS))
    if blocks:
        return f"{HYBRID_PROBLEM} ({', '.join(blocks)})"
    recurrent = stateful_layers(model)
    runs = _runtime_recurrent_layers(model)
    refused = {i: k for i, k in recurrent.items() if i not in runs}
    if refused:
        return recurrent_problem(sorted(set(refused.values())))
    try:
        ad = adapter_for(model)
    except InputError as e:
        return str(e)
    owned, problem = _owned(ad)
    if problem:
        return problem
    missing = [n for n, _ in model.named_parameters() if n not in owned]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        return f"parameters the backend would not place: {', '.join(missing[:3])}{more}"
    return None


RECURRENT_PROBLEM = "it does not run linear-attention / state-space (recurrent) layers yet"
# Nemotron-H block types (one mixer per block) the fast runtime runs
HYBRID_BLOCKS = ("linear_attention", "full_attention", "mlp")
HYBRID_PROBLEM = ("it runs Nemotron-H's Mamba-2, attention and MLP blocks only, not its blocks "
                  "of type")
# what the fast runtime's Mamba-2 mixer reads (shardc.runtime.mamba2_local.Mamba2Mixer)
MAMBA2_MIXER = ("in_proj", "conv1d", "A_log", "D", "dt_bias", "norm", "out_proj", "num_heads",
                "n_groups", "head_dim", "ssm_state_size", "chunk_size", "time_step_limit")


# a Mamba-2 mixer's parameters other than in_proj / out_proj (the conv, the per-head vectors,
# the gated group norm), placed by Mamba2HeadsParallel
MAMBA2_CORE_PARAMS = (".conv1d.weight", ".conv1d.bias", ".A_log", ".D", ".dt_bias",
                      ".norm.weight")


def recurrent_problem(kinds: list[str]) -> str:
    """The backend's reason for a model with linear-attention / Mamba layers of ``kinds``
    (those the fast runtime does not run: all but Nemotron-H's Mamba-2 mixers)."""
    return (f"{RECURRENT_PROBLEM} ({', '.join(kinds)}; of such layers it runs Nemotron-H's "
            "Mamba-2 mixers only)")


def _runtime_recurrent_layers(model) -> set[int]:
    """Decoder-layer indices whose recurrent part the fast runtime runs: a Nemotron-H block
    (one ``norm``, one ``mixer``) whose mixer is a Mamba-2 mixer with a gated group norm
    (:mod:`shardc.runtime.mamba2_local`)."""
    from shardc.frontends.stateful_layers import layer_index

    out: set[int] = set()
    for path, mod in model.named_modules():
        mixer = getattr(mod, "mixer", None)
        i = layer_index(path)
        if i is None or getattr(mod, "block_type", None) != "linear_attention" \
                or not hasattr(mod, "norm") or mixer is None:
            continue
        if all(hasattr(mixer, a) for a in MAMBA2_MIXER) and \
                hasattr(mixer.norm, "group_size") and hasattr(mixer, "act"):
            out.add(i)
    return out


def _has_fused_experts(plan) -> bool:
    """Whether ``plan``'s params rows list experts stored fused (DBRX: two ``[E, f, h]``
    views in one layer's ``expert_ffn1``, the gate and the up projection)."""
    seen: dict = {}
    for r in plan.params:
        if r.get("op") == "expert_ffn1" and len(r.get("shape", ())) == 3:
            seen[r.get("layer")] = seen.get(r.get("layer"), 0) + 1
    return any(n > 1 for n in seen.values())


def _has_biased_experts(plan) -> bool:
    """Whether ``plan``'s params rows list expert biases (GPT-OSS: ``[E, out]`` rows of the
    expert ops, :mod:`shardc.ir.param_roles`)."""
    return any(r.get("op") in ("expert_ffn1", "expert_ffn2") and len(r.get("shape", ())) == 2
               and r.get("expert_dim") == 0 for r in plan.params)


def fused_experts_verdict(verdict: dict, plans) -> dict:
    """plan.json ``backend`` once the plans are known, for a model whose experts are stored
    fused (DBRX: :mod:`shardc.backends.fused_styles`) or carry biases (GPT-OSS): runs False,
    naming the plan's choice, when ``parallelize.py`` does not place them as some plan of
    ``plans`` chose (the pairs other than col/row and rep/rep over tp; for fused experts a
    re-split other than col/row, for biased ones any re-split); else ``verdict``."""
    if not verdict.get("runs", True):
        return verdict
    from shardc.backends.torch_styles import NotCovered, style_plan

    for plan in plans:
        fused, biased = _has_fused_experts(plan), _has_biased_experts(plan)
        if not (fused or biased):
            continue
        try:
            style_plan(plan)
        except NotCovered as e:
            name = str((plan.model or {}).get("name") or "the model")
            what = "experts stored fused" if fused else "experts with biases"
            return {"runs": False, "reason": f"{name}: the DTensor backend does not run this "
                    f"plan's {what} ({e})"}
    return verdict


def family_name(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "model_type", "") or type(model).__name__)


_NORM_ARITHMETIC = ("mul", "add", "sub", "div", "addcmul")  # a decomposed norm's scale / shift


def _base_op(target: str) -> str:
    parts = str(target).split(".")
    return (parts[1] if len(parts) >= 3 else parts[-1]).lower()


def unplaced_by_styles(graph) -> str | None:
    """Why the torch-style runtime (:mod:`shardc.backends.torch_styles`, which runs the
    model's own forward with its parameters placed per plan.json ``params``) would compute a
    different model (None if it would not), read from the graph: a parameter of the attention
    core, one read by a node no fused op claims (other than a per-token scalar gate) or a
    1-D one read other than as a norm's scale or shift (an attention sink concatenated to
    the scores: one value per head, which a heads split would have to cut) would stay whole
    where the rank holds a share of the heads or features."""
    kinds = sorted({str(n.attrs.get("recurrent")) for n in graph.nodes
                    if n.op == "recurrent_scan"} - {"mamba2"})
    if kinds:
        return recurrent_problem(kinds)
    mamba2 = {i for k in graph.layer_kinds if k.op("attn_core") is not None
              and k.op("attn_core").attrs.get("recurrent") == "mamba2" for i in k.layers}
    for n in graph.nodes:
        if n.layer in mamba2 and n.params and all(
                p.fqn.endswith(MAMBA2_CORE_PARAMS) for p in n.params):
            continue  # placed by Mamba2HeadsParallel (a heads split) or whole

        if not n.params or n.attrs.get("scalar_gate") or (n.fused_op == "norm" and (
                n.op == "norm" or _base_op(n.target) in _NORM_ARITHMETIC)):
            continue
        if n.fused_op == "attn_core":
            return (f"attention-core parameter {n.params[0].fqn} (per head) that the "
                    "torch-style runtime does not split")
        if n.fused_op in (None, "norm"):
            return (f"parameter {n.params[0].fqn} read by {n.op} node {n.name} "
                    f"({_base_op(n.target)}), which no op the torch-style runtime places "
                    "claims")
    return None


def torch_style_verdict(verdict: dict, plans, graph) -> dict:
    """plan.json ``backend`` once the plans are known: a model the first runtime's adapter
    refuses (``verdict`` runs False) runs when the torch-style runtime covers every plan of
    ``plans`` (:func:`~shardc.backends.torch_styles.style_plan`) and places every parameter
    (:func:`unplaced_by_styles`): the emitted ``parallelize.py`` is then the torch-style one.
    Otherwise ``verdict``, its reason extended with the torch-style path's."""
    if verdict.get("runs", True) or any(p in str(verdict.get("reason"))
                                        for p in (RECURRENT_PROBLEM, HYBRID_PROBLEM)):
        return verdict
    from shardc.backends.torch_styles import NotCovered, style_plan

    problem = unplaced_by_styles(graph)
    if problem is None:
        for plan in plans:
            try:
                style_plan(plan)
            except NotCovered as e:
                problem = f"the torch-style runtime does not cover the plan: {e}"
                break
    if problem is None:
        return {"runs": True, "reason": None}
    return {"runs": False, "reason": f"{verdict['reason']}; {problem}"}


def experts_split_problem(degrees) -> str | None:
    """Why the DTensor backend cannot run these degrees (None: it can): of the experts
    splits other than (tp, ep) -- moe_tp x moe_ep, the all-gather dispatch -- the backend
    runs the all-TP (moe_tp = tp x ep) and all-EP (moe_ep = tp x ep) ones
    (:mod:`shardc.runtime.gathered_experts`; the one place saying so:
    :func:`shardc.ir.engines.dtensor_runs_split`); another is priced and launched by the
    engines but not run by ``parallelize.py`` / the runtime."""
    from shardc.ir.engines import dtensor_runs_split

    if not degrees.experts_resplit or dtensor_runs_split(
            degrees.tp, degrees.ep, degrees.expert_tp, degrees.expert_ep):
        return None
    return (f"the experts split moe_tp={degrees.moe_tp} x moe_ep={degrees.moe_ep} over "
            f"tp={degrees.tp} x dp_attn={degrees.ep} is not implemented in parallelize.py / "
            "the runtime (they run moe_tp = tp x dp_attn or moe_ep = tp x dp_attn)")


def plan_verdict(verdict: dict, strategies) -> dict:
    """plan.json ``backend`` once the plans' strategies are known: ``verdict``, or runs False
    when some strategy's degrees need what the backend does not run
    (:func:`experts_split_problem`)."""
    for st in strategies:
        problem = experts_split_problem(st.degrees)
        if problem:
            reason = f"{verdict['reason']}; {problem}" if verdict.get("reason") else problem
            return {"runs": False, "reason": reason}
    return verdict


def refusal(family: str, problem: str) -> str:
    """The one line that says why the DTensor backend cannot run a model of ``family``."""
    return f"{family}: the DTensor backend cannot run this model ({problem})"


def verdict_of_module(model) -> dict:
    """plan.json ``backend`` of an ``nn.Module``: ``{"runs": True, "reason": None}`` or
    ``{"runs": False, "reason": <family and unsupported part>}``."""
    problem = backend_problem(model)
    return {"runs": problem is None,
            "reason": refusal(family_name(model), problem) if problem else None}


def check_module(model: nn.Module, source: str = "") -> None:
    """:class:`InputError` (one line: family and unsupported part) if the backend cannot run it."""
    problem = backend_problem(model)
    if problem:
        where = f"{source}: " if source else ""
        raise InputError(f"{where}{refusal(family_name(model), problem)}; no parallelize.py "
                         "would work")


def backend_verdict(path: str) -> dict:
    """plan.json ``backend`` (see :func:`verdict_of_module`) of the model file ``path``:
    built as ``tiny_model()`` when the file has one (same structure, cheaper; otherwise
    ``build_model()``, on meta for full-size models). The verdict is cached beside the traced
    graph (keyed by the model file, the source files it imported and the backend's code), so
    a warm compile neither builds the model again nor imports torch for it."""
    import json

    from shardc.frontends import graph_cache

    key = graph_cache.derived_key(path, "backend-support", ("backends",)) \
        if graph_cache.cache_enabled() and Path(path).is_file() else None
    cached = graph_cache.load_text(key) if key else None
    try:  # a damaged cache entry is a miss, as in graph_cache
        verdict = json.loads(cached) if cached is not None else None
    except (ValueError, RecursionError):
        verdict = None
    if not (isinstance(verdict, dict) and {"problem", "family"} <= set(verdict)):
        from shardc.frontends.imports import recording_imports
        from shardc.frontends.model_file import load_model_file

        with recording_imports() as imported:
            src = load_model_file(path)
            model, _ = src.build(tiny=src.tiny_model is not None)
            verdict = {"problem": backend_problem(model), "family": family_name(model)}
        if key:
            graph_cache.store_text(key, json.dumps(verdict), deps=imported)
    problem = verdict["problem"]
    return {"runs": problem is None,
            "reason": refusal(verdict["family"], problem) if problem else None}


def check_model_file(path: str) -> None:
    """:class:`InputError` (exit 2) when the backend cannot run the model of ``path``."""
    verdict = backend_verdict(path)
    if not verdict["runs"]:
        raise InputError(f"{path}: {verdict['reason']}; no parallelize.py would work")
