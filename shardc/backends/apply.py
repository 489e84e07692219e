"""Apply a strategy to a model in process: the one implementation behind ``parallelize.py``
and ``Plan.apply``.

The readable sequence the emitted ``parallelize.py`` spells out (see
:mod:`shardc.backends.dtensor`) is::

    sharder = ModelSharder(model, STRATEGY, world_mesh, LAYER_KINDS, PARAMS)
    sharder.embedding()
    for i in sharder.layers_of("dense_block"):
        sharder.attention(i)
        sharder.mlp(i)
    sharder.lm_head()
    model = sharder.finish()

``finish`` installs the batch split over dp/ep at the model's input and the gather at its
output (so the returned model maps the same global batch to the same global logits), and
with pp > 1 wraps the stages in a ``torch.distributed.pipelining`` schedule. ``PARAMS`` is
plan.json's ``params`` rows: the fused op, sharded dims and stage of every parameter, from
the IR (:mod:`shardc.ir.param_roles`); without a plan they are derived from the model's
traced graph as ``build_plan`` does (:func:`params_from_module`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardc.backends.attention import install_attention
from shardc.backends.mla import shard_mla
from shardc.backends.models import adapter_for, default_layer_kinds
from shardc.backends.moe import shard_moe
from shardc.backends.runtime import ShardingRuntime
from shardc.ir.strategy import Strategy, pipeline_stages


def strategy_from_names(degrees: dict, choices: dict, batch: int = 1) -> Strategy:
    """Strategy from plan-style data: ``{"tp": 8, ...}`` and ``{"<kind>.<op>": "col", ...}``
    (choice names or indices)."""
    from shardc.ir.contract import CHOICE_NAMES
    from shardc.ir.strategy import Degrees

    idx = {}
    for slot, c in choices.items():
        names = CHOICE_NAMES[slot.split(".")[-1]]
        idx[slot] = c if isinstance(c, int) else names.index(c)
    return Strategy(Degrees(**degrees), int(batch), idx)


def make_mesh(strategy: Strategy, device_type: str | None = None) -> DeviceMesh:
    """``init_device_mesh`` with the strategy's logical mesh (SPEC section 4)."""
    shape, names = strategy.degrees.logical_mesh()
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def params_from_module(model: nn.Module, strategy: Strategy,
                       kind_of_layer: dict[int, str], seq: int = 8) -> list[dict]:
    """plan.json ``params`` rows for ``model`` under ``strategy`` as ``build_plan`` writes
    them: the model traced on one sequence of ``seq`` tokens, the graph's parameter roles
    (:func:`shardc.backends.layout.param_plan`). Tracing costs seconds: pass the rows of a
    plan (or of a graph already traced) when there is one."""
    from shardc.backends.layout import param_plan
    from shardc.frontends import graph_from_module

    ids = torch.zeros(1, seq, dtype=torch.long)
    graph = graph_from_module(model, (ids,), name=type(model).__name__)
    return param_plan(graph, strategy, kind_of_layer)


class ModelSharder:
    """Shards ``model`` per ``strategy``; see the module docstring for the call sequence.

    ``layer_kinds`` maps kind name -> decoder-layer indices (plan.json ``layer_kinds``);
    None infers ``dense_block`` / ``moe_block`` from the model. ``params``: plan.json's
    ``params`` rows (None: :func:`params_from_module`).
    """

    def __init__(self, model: nn.Module, strategy: Strategy, world_mesh: DeviceMesh | None = None,
                 layer_kinds: dict[str, list[int]] | None = None,
                 params: list[dict] | None = None):
        self.model = model
        self.strategy = strategy
        self.adapter = adapter_for(model)
        if layer_kinds is None:
            kind_of_layer = default_layer_kinds(model)
        else:
            kind_of_layer = {i: k for k, ls in layer_kinds.items() for i in ls}
        self.kind_of_layer = kind_of_layer
        self.world_mesh = world_mesh if world_mesh is not None else make_mesh(strategy)
        if params is None:
            params = params_from_module(model, strategy, kind_of_layer)
        self.rt = ShardingRuntime(model, strategy, self.world_mesh, kind_of_layer, params)
        deg = strategy.degrees
        self.stage_of_layer = pipeline_stages(self.adapter.num_layers, deg.pp)
        self.stage = self.world_mesh.get_local_rank("pp") if deg.pp > 1 else 0

    def on_stage(self, layer: int | None, where: str = "") -> bool:
        if layer is not None:
            return self.stage_of_layer[layer] == self.stage
        return self.stage == (0 if where == "first" else self.strategy.degrees.pp - 1)

    def layers_of(self, kind: str) -> list[int]:
        """This rank's pipeline stage's layers of ``kind``."""
        return [i for i, k in sorted(self.kind_of_layer.items())
                if k == kind and self.on_stage(i)]

    # --------------------------------------------------------------- global ops
    def embedding(self) -> None:
        if not self.on_stage(None, "first"):
            return
        rt = self.rt
        mod, pre = self.adapter.embedding
        rt.place_module_params(mod, pre)
        steps = rt.walk(("embedding",), None, start="R")
        rt.hook_chain([[mod]], steps, "R")
        for pos, ppre in getattr(self.adapter, "position_embeddings", []):  # GPT-2's wpe
            rt.place_module_params(pos, ppre)
            rt.hook_local(pos, "R")

    def lm_head(self) -> None:
        if not self.on_stage(None, "last"):
            return
        rt = self.rt
        norm, npre = self.adapter.final_norm
        rt.place_module_params(norm, npre)
        rt.hook_local(norm, rt.residual)
        mod, pre = self.adapter.lm_head
        rt.place_module_params(mod, pre)
        rt.hook_chain([[mod]], rt.walk(("lm_head",), None, end="R"), rt.residual)

    # --------------------------------------------------------------- per layer
    def _norms(self, sites) -> None:
        for mod, pre in sites.norms:
            self.rt.place_module_params(mod, pre)
            self.rt.hook_local(mod, self.rt.residual)

    def attention(self, layer: int) -> None:
        """qkv -> attention core -> out-proj, with this layer's choices."""
        rt, sites = self.rt, self.adapter.layer(layer)
        self._norms(sites)
        att = sites.attention
        steps = rt.walk("attention", layer)
        attn_need = steps[1][0]
        repeat = 1
        if rt.tp > 1 and attn_need == "S(1)":
            if att.heads % rt.tp or (att.kv_heads % rt.tp and rt.tp % att.kv_heads):
                raise ValueError(f"layer {layer}: tp={rt.tp} does not divide heads "
                                 f"{att.heads}/{att.kv_heads} for a heads split")
            repeat = max(rt.tp // att.kv_heads, 1)  # GQA, tp > kv_heads: KV heads repeated
            if repeat > 1 and (att.fused > 1 or any(
                    m.weight.numel() != att.module.head_dim for m, _ in att.qk_norms)):
                raise ValueError(f"layer {layer}: a heads split at tp={rt.tp} over "
                                 f"{att.kv_heads} KV heads (KV heads replicated) with a packed "
                                 "q|k|v or a q/k norm over the whole projection is not supported")
        if att.mla:
            shard_mla(rt, att, layer)
            return
        kv_mods = att.qkv[1:] if att.fused == 1 else []  # separate k, v after q
        for mod, pre in att.qkv + [att.out] + att.qk_norms:
            rt.place_module_params(mod, pre, att.kv_heads if any(mod is m for m, _ in kv_mods)
                                   else 0)
        if repeat > 1 and steps[0][1] != "S(1)":  # qkv not column split: repeat activations
            for mod, _ in att.qkv[1:]:
                rt.kv_expand[id(mod)] = (att.kv_heads, repeat)
        rt.hook_chain([[m for m, _ in att.qkv], [], [att.out[0]]], steps, rt.residual,
                      unfuse=[att.fused, 1, 1])
        install_attention(att, self.adapter.family, self.rt)

    def mlp(self, layer: int) -> None:
        """Dense ffn1 -> ffn2, or the MoE block (router, ep dispatch, experts, combine)."""
        rt, sites = self.rt, self.adapter.layer(layer)
        if sites.moe is not None:
            shard_moe(rt, sites.moe, layer)
            return
        ffn1, ffn2 = sites.mlp
        for mod, pre in ffn1 + [ffn2]:
            rt.place_module_params(mod, pre)
        rt.hook_chain([[m for m, _ in ffn1], [ffn2[0]]], rt.walk("mlp", layer), rt.residual)

    def moe(self, layer: int) -> None:
        self.mlp(layer)

    # --------------------------------------------------------------- finish
    def finish(self) -> nn.Module:
        """Batch split / gather over dp, ep at the model boundary; pipeline when pp > 1."""
        from shardc.backends.pipeline import PipelinedModel, install_batch_io

        unplaced = [n for n, p in self.model.named_parameters()
                    if self.rt.mesh is not None and not hasattr(p, "placements")
                    and self._param_on_stage(n)]
        if unplaced:
            raise ValueError(f"parameters the backend did not place: {unplaced[:5]}")
        if self.strategy.degrees.pp > 1:
            return PipelinedModel(self)
        install_batch_io(self.model, self.rt)
        return self.model

    def _param_on_stage(self, fqn: str) -> bool:
        """Whether this rank's stage holds ``fqn`` (its params row's ``stage``; a parameter
        the plan does not know is reported as unplaced)."""
        row = self.rt.rows.get(fqn)
        return row is None or int(row["stage"]) == self.stage


def apply(model: nn.Module, strategy: Strategy, device_mesh: DeviceMesh | None = None,
          layer_kinds: dict[str, list[int]] | None = None,
          params: list[dict] | None = None) -> nn.Module:
    """Shard ``model`` in place per ``strategy`` on ``device_mesh`` (created from the
    strategy's logical mesh when None); returns the model to call (a pipeline wrapper when
    pp > 1, whose forward returns logits on the last stage and None elsewhere). ``params``:
    plan.json's ``params`` rows (None: derived from the model, :func:`params_from_module`)."""
    sh = ModelSharder(model, strategy, device_mesh, layer_kinds, params)
    sh.embedding()
    for kind in sorted(set(sh.kind_of_layer.values())):
        for i in sh.layers_of(kind):
            sh.attention(i)
            sh.mlp(i)
    sh.lm_head()
    return sh.finish()
