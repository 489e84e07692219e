"""The small driver under the emitted ``parallelize.py`` (torch only; inlined by
``shardc compile --standalone``): meshes, the decoder layers of an HF causal LM, the
dp x ep batch split at the model boundary, and :func:`apply_plan`.

A plan here is plain data of ParallelStyles (built by ``parallelize.py`` from the
strategy)::

    {"layer_kinds": {kind: [layer indices]}, "layers_path": "model.layers",
     "layers": {kind: {"self_attn.q_proj": ColwiseParallel(), ...}},   # tp mesh
     "experts": {kind: {"mlp.experts": ExpertParallel(...)}},          # ep x tp mesh
     "model": {"model.embed_tokens": RowwiseParallel(...), "lm_head": ...}}  # tp mesh
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module


def make_mesh(shape, dim_names):
    """``init_device_mesh`` on cuda when available, else cpu (gloo)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device, tuple(shape), mesh_dim_names=tuple(dim_names))


def submesh(world_mesh, dims):
    """The sub-mesh of ``world_mesh`` over those of ``dims`` it has (None: none of them)."""
    have = tuple(d for d in dims if d in (world_mesh.mesh_dim_names or ()))
    if not have:
        return None
    return world_mesh[have if len(have) > 1 else have[0]]


def decoder_layers(model: nn.Module, path: str = "model.layers"):
    """The decoder-layer list of ``model`` at module ``path`` (``model.layers`` of an HF
    ``*ForCausalLM``, ``transformer.h`` of GPT-2, ``layers`` of a plain model)."""
    return model.get_submodule(path)


def batch_mesh(world_mesh):
    """The dp x ep dims flattened into one 1-D mesh (None when both are 1): every rank of it
    serves its own slice of the batch."""
    mesh = submesh(world_mesh, ("dp", "ep"))
    if mesh is None or mesh.ndim == 1:
        return mesh
    return mesh._flatten("dp_ep")


def install_batch_split(model: nn.Module, world_mesh, padding_ok: bool = True,
                        tp_rows: bool = False) -> nn.Module:
    """Slice the global batch (``input_ids`` and a 2-D ``attention_mask`` / ``position_ids``)
    to this rank's rows over dp x ep on the way in, all-gather the logits on the way out:
    the model still maps the global batch to global logits. ``tp_rows`` (sequence
    parallelism: the residual stream holds 1/tp of the rows, the embedding's output rows of
    this tp rank) slices ``attention_mask`` / ``position_ids`` once more to this tp rank's
    rows, so the model builds its masks and rotary tables for the rows its layers hold
    (attention over whole rows all-gathers them, :func:`~shardc.runtime.styles.whole_rows`).
    ``padding_ok=False`` (a pipelined model under sequence parallelism) refuses an
    ``attention_mask`` that hides any token."""
    if not padding_ok:
        def refuse(mod, args, kwargs):
            mask = kwargs.get("attention_mask")
            if mask is not None and not bool(mask.all()):
                raise ValueError("a padding attention_mask through pipeline stages under "
                                 "sequence parallelism is not supported")

        model.register_forward_pre_hook(refuse, with_kwargs=True)
    mesh = batch_mesh(world_mesh)
    if mesh is None:
        _install_tp_rows(model, world_mesh, tp_rows)
        return model
    n, i = mesh.size(), mesh.get_local_rank()

    def rows(x):
        if x.shape[0] % n:
            raise ValueError(f"batch {x.shape[0]} does not split over dp x ep = {n} ranks")
        return x.chunk(n, dim=0)[i]

    def pre(mod, args, kwargs):
        kwargs = {k: rows(v) if k in ("input_ids", "attention_mask", "position_ids")
                  and isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        if args:
            args = (rows(args[0]), *args[1:])
        return args, kwargs

    def gather(y):
        return DTensor.from_local(y.contiguous(), mesh, (Shard(0),), run_check=False).full_tensor()

    def post(mod, args, kwargs, out):
        if out is None:  # a pipeline stage before the last: no logits here
            return out
        if isinstance(out, torch.Tensor):
            return gather(out)
        out.logits = gather(out.logits)
        return out

    model.register_forward_pre_hook(pre, with_kwargs=True)
    _install_tp_rows(model, world_mesh, tp_rows)  # after the dp x ep slice
    model.register_forward_hook(post, with_kwargs=True)
    return model


def _install_tp_rows(model: nn.Module, world_mesh, tp_rows: bool) -> None:
    """The ``tp_rows`` slice of :func:`install_batch_split`."""
    tp_mesh = submesh(world_mesh, ("tp",))
    if tp_rows and tp_mesh is not None and tp_mesh.size() > 1:
        n_tp, i_tp = tp_mesh.size(), tp_mesh.get_local_rank()

        def tp_slice(mod, args, kwargs):
            kwargs = {k: v.chunk(n_tp, dim=0)[i_tp] if k in ("attention_mask", "position_ids")
                      and isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[0] > 1
                      else v for k, v in kwargs.items()}
            return args, kwargs

        model.register_forward_pre_hook(tp_slice, with_kwargs=True)


def apply_plan(model: nn.Module, plan: dict, world_mesh) -> nn.Module:
    """Apply ``plan`` (see the module docstring) to ``model`` on ``world_mesh`` (logical mesh
    dims ``dp`` / ``ep`` / ``tp``); parameters are cut from the full tensor every rank holds
    (``src_data_rank=None``: no broadcast). Returns the model to call."""
    tp_mesh = submesh(world_mesh, ("tp",))
    expert_mesh = submesh(world_mesh, ("ep", "tp"))
    layers = decoder_layers(model, plan.get("layers_path", "model.layers"))
    for kind, indices in plan.get("layer_kinds", {}).items():
        for i in indices:
            if tp_mesh is not None and plan.get("layers", {}).get(kind):
                parallelize_module(layers[i], tp_mesh, plan["layers"][kind], src_data_rank=None)
            experts = plan.get("experts", {}).get(kind)
            if expert_mesh is not None and experts is not None:
                if not isinstance(experts, dict):
                    experts = {"mlp.experts": experts}
                for suffix, style in experts.items():
                    parallelize_module(layers[i].get_submodule(suffix), expert_mesh, style,
                                       src_data_rank=None)
    if tp_mesh is not None and plan.get("model"):
        parallelize_module(model, tp_mesh, plan["model"], src_data_rank=None)
    return install_batch_split(model, world_mesh)
