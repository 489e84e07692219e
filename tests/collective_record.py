"""Record the collectives a forward issues as (kind, mesh dim, bytes), in the cost model's
accounting (torch only; a helper of the fake-PG tests, not a test file).

:class:`CollectiveRecorder` is a ``TorchDispatchMode`` that sees every c10d functional
collective DTensor (and shardc's runtime styles) issue and records, per call:

* ``kind``: ``all_gather`` / ``reduce_scatter`` / ``all_reduce`` / ``all_to_all``
  (the names of :data:`shardc.cost.collectives.COLLECTIVE_KINDS`); any other collective op
  (broadcast, coalesced variants, non-functional c10d ops) is recorded under its own op name,
  so a comparison with the cost model fails on it instead of skipping it;
* ``mesh_dim``: the logical mesh dim whose process group the call ran on (from
  :func:`group_names`; an unknown group is recorded as ``"group:<name>"``);
* ``bytes``: full-tensor bytes as :mod:`shardc.passes.annotate` and
  :meth:`CostModel.simulate` count them -- all-gather: the output (input x group size);
  reduce-scatter and all-reduce: the input; all-to-all: this rank's send buffer (input);
  ``send`` / ``recv`` (pipeline stages, eager c10d): the tensor sent / received.

Both the functional collectives (``torch.ops._c10d_functional``: DTensor, ``funcol``) and the
eager c10d ops (``torch.distributed.all_to_all_single`` & co: ``torch.ops.c10d``) are seen.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_NATIVE = torch.ops._c10d_functional
_LEGACY = torch.ops.c10d_functional
_AUTOGRAD = torch.ops._c10d_functional_autograd

# op packet -> (kind, index of the group-name argument)
_FUNCTIONAL = {}
for _ns in (_NATIVE, _LEGACY, _AUTOGRAD):
    for _name, _kind, _group_arg in (("all_gather_into_tensor", "all_gather", 2),
                                     ("reduce_scatter_tensor", "reduce_scatter", 3),
                                     ("all_reduce", "all_reduce", 2),
                                     ("all_reduce_", "all_reduce", 2),
                                     ("all_to_all_single", "all_to_all", 3)):
        if hasattr(_ns, _name):
            _FUNCTIONAL[getattr(_ns, _name)] = (_kind, _group_arg)
# eager c10d ops (``torch.distributed.all_to_all_single`` & co, as shardc's runtime styles
# call them): op name -> (kind, index of the tensor whose bytes count, index of the group)
_EAGER = {"alltoall_base_": ("all_to_all", 1, 2), "allreduce_": ("all_reduce", 0, 1),
          "_allgather_base_": ("all_gather", 0, 2),  # the output
          "_reduce_scatter_base_": ("reduce_scatter", 1, 2),
          "send": ("send", 0, 1), "recv_": ("recv", 0, 1)}  # pipeline stages: the tensor
_OTHER_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d")
_IGNORED = {"wait_tensor", "wait_tensor_", "_wrap_tensor_autograd", "barrier"}  # no data moved


def group_names(meshes) -> dict[str, str]:
    """process-group name -> logical mesh dim name, for every named dim of ``meshes``
    (``DeviceMesh`` objects; a submesh shares its parent's groups)."""
    out: dict[str, str] = {}
    for mesh in meshes:
        for dim in mesh.mesh_dim_names or ():
            out[mesh.get_group(dim).group_name] = dim
    return out


def model_meshes(model: torch.nn.Module) -> list:
    """The distinct device meshes of ``model``'s DTensor parameters."""
    from torch.distributed.tensor import DTensor

    seen = {}
    for p in model.parameters():
        if isinstance(p, DTensor):
            seen.setdefault(id(p.device_mesh), p.device_mesh)
    return list(seen.values())


def _pg_name(pg) -> str:
    """The group name of a c10d op's process-group argument (a boxed ``ProcessGroup``)."""
    from torch.distributed.distributed_c10d import ProcessGroup

    if not isinstance(pg, ProcessGroup):
        pg = ProcessGroup.unbox(pg)
    return pg.group_name


class CollectiveRecorder(TorchDispatchMode):
    """``with CollectiveRecorder(group_to_dim) as rec: ...``; then ``rec.records`` is the
    list of ``(kind, mesh_dim, bytes)`` in issue order, ``rec.counter()`` its multiset."""

    def __init__(self, group_to_dim: dict[str, str]):
        super().__init__()
        self.group_to_dim = dict(group_to_dim)
        self.records: list[tuple[str, str, int]] = []

    def _dim(self, group_name) -> str:
        return self.group_to_dim.get(str(group_name), f"group:{group_name}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func._overloadpacket
        if packet in _FUNCTIONAL:
            kind, group_arg = _FUNCTIONAL[packet]
            inp = args[0]
            group = args[group_arg] if len(args) > group_arg else kwargs.get("group_name")
            nbytes = inp.numel() * inp.element_size()
            if kind == "all_gather":
                nbytes *= int(args[1])  # group_size
            self.records.append((kind, self._dim(group), int(nbytes)))
        elif func.namespace == "c10d" and packet.__name__ in _EAGER:
            kind, tensor_arg, group_arg = _EAGER[packet.__name__]
            t = args[tensor_arg]
            tensors = t if isinstance(t, (list, tuple)) else [t]
            nbytes = sum(x.numel() * x.element_size() for x in tensors)
            self.records.append((kind, self._dim(_pg_name(args[group_arg])), int(nbytes)))
        elif func.namespace in _OTHER_NAMESPACES and packet.__name__ not in _IGNORED:
            self.records.append((f"{func.namespace}.{packet.__name__}", "?", -1))
        return func(*args, **kwargs)

    def counter(self) -> Counter:
        return Counter(self.records)
