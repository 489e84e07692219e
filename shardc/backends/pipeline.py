"""Model boundary: batch split over dp/ep, and pipeline stages (``torch.distributed.pipelining``).

Over ``dp`` and ``ep`` every rank serves its own slice of the batch (attention is data
parallel over ep; the experts exchange tokens by all-to-all). The sharded model still takes
the *global* batch and returns global logits, so it is a drop-in replacement: its input is
sliced to this rank's rows and its logits are all-gathered back over dp and ep (these two
boundary collectives are serving I/O, not part of a decode step, and are not charged).

With pp > 1 each rank keeps the layers of its stage (contiguous, balanced:
:func:`shardc.ir.strategy.pipeline_stages`) and runs a ``ScheduleGPipe`` forward-only
(``eval``) with one micro-batch; activations cross stages between ranks with the same
dp/ep/tp coordinates. The wrapper returns logits on the last stage and None elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe


def _batch_split(rt) -> tuple[int, int]:
    """(number of batch slices over dp x ep, this rank's slice)."""
    n, idx = 1, 0
    for d in rt.dims:
        if d in ("dp", "ep"):
            size = getattr(rt.degrees, d)
            idx = idx * size + rt.mesh.get_local_rank(d)
            n *= size
    return n, idx


def local_batch(x: torch.Tensor, rt) -> torch.Tensor:
    n, idx = _batch_split(rt)
    if n == 1:
        return x
    if x.shape[0] % n:
        raise ValueError(f"batch {x.shape[0]} does not split over dp x ep = {n} ranks")
    return x.chunk(n, dim=0)[idx]


def gather_batch(y: torch.Tensor, rt) -> torch.Tensor:
    n, _ = _batch_split(rt)
    if n == 1:
        return y
    return rt.wrap(y.contiguous(), "R").full_tensor()


BATCHED_KWARGS = ("input_ids", "attention_mask", "position_ids")  # [batch, ...] model inputs


def install_batch_io(model: nn.Module, rt) -> None:
    """Slice the global batch on the way in (``input_ids`` and a padding ``attention_mask``
    or ``position_ids`` with it), gather the logits on the way out. The (sliced) padding
    mask is kept on ``rt.padding_mask`` for the sharded attention (None without one)."""
    split = _batch_split(rt)[0] > 1

    def pre(mod, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() != 2:
            raise ValueError("shardc's sharded attention takes a 2-D [batch, seq] padding "
                             f"attention_mask, got {mask.dim()}-D")
        if split:
            kwargs = {k: local_batch(v, rt) if k in BATCHED_KWARGS and v is not None else v
                      for k, v in kwargs.items()}
            if args:
                args = (local_batch(args[0], rt), *args[1:])
        rt.padding_mask = kwargs.get("attention_mask")
        return args, kwargs

    def post(mod, args, kwargs, out):
        if not split:
            return out
        if isinstance(out, torch.Tensor):
            return gather_batch(out, rt)
        out.logits = gather_batch(out.logits, rt)
        return out

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, with_kwargs=True)


class PipelinedModel(nn.Module):
    """This rank's pipeline stage of a sharded model; ``forward(input_ids)`` runs the whole
    pipeline (every rank calls it) and returns the logits on the last stage, else None."""

    def __init__(self, sharder):
        super().__init__()
        self.rt = sharder.rt
        deg = sharder.strategy.degrees
        self.num_stages, self.stage_index = deg.pp, sharder.stage
        layers = [i for i, s in enumerate(sharder.stage_of_layer) if s == self.stage_index]
        self.stage_module = sharder.adapter.stage(layers, self.stage_index == 0,
                                                  self.stage_index == deg.pp - 1)
        self.group = sharder.world_mesh.get_group("pp")
        self.hidden = int(getattr(sharder.adapter.config, "hidden_size", 0))
        self.vocab = int(getattr(sharder.adapter.config, "vocab_size", 0))
        self.dtype = next(p for p in self.stage_module.parameters()).dtype
        self._schedules: dict[tuple, ScheduleGPipe] = {}

    def _schedule(self, b: int, s: int, device) -> ScheduleGPipe:
        key = (b, s)
        if key not in self._schedules:
            rows = b // self.rt.tp if self.rt.residual == "S(0)" else b
            hidden = torch.zeros(rows, s, self.hidden, dtype=self.dtype, device=device)
            first, last = self.stage_index == 0, self.stage_index == self.num_stages - 1
            inp = torch.zeros(b, s, dtype=torch.long, device=device) if first else hidden
            out = torch.zeros(b, s, self.vocab, dtype=self.dtype, device=device) if last \
                else hidden
            stage = PipelineStage(self.stage_module, self.stage_index, self.num_stages, device,
                                  input_args=(inp,), output_args=(out,), group=self.group)
            self._schedules[key] = ScheduleGPipe(stage, n_microbatches=1)
        return self._schedules[key]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor | None:
        """Logits [batch, seq, vocab] on the last stage (None elsewhere) of whole sequences;
        ``attention_mask``: an optional 2-D [batch, seq] padding mask. No KV cache."""
        given = sorted(k for k, v in kwargs.items() if v is not None and v is not False)
        if given:
            raise ValueError(f"a pipelined model (pp={self.num_stages}) runs whole sequences: "
                             f"it takes no {', '.join(given)}")
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("shardc's sharded attention takes a 2-D [batch, seq] padding "
                             f"attention_mask, got {attention_mask.dim()}-D")
        self.rt.padding_mask = None if attention_mask is None \
            else local_batch(attention_mask, self.rt)  # every stage's attention reads it
        ids = local_batch(input_ids, self.rt)
        sched = self._schedule(ids.shape[0], ids.shape[1], ids.device)
        if self.stage_index == 0:
            out = sched.eval(ids)
        else:
            out = sched.eval()
        if self.stage_index != self.num_stages - 1:
            return None
        return gather_batch(out, self.rt)
