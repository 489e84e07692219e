"""Pipeline stages on ``torch.distributed.pipelining`` for the emitted ``parallelize.py``
(torch only; inlined by ``shardc compile --standalone``).

A pipeline-parallel plan runs each rank as one stage, torchtitan-style:

* :func:`keep_stage` drops from the HF causal LM what other stages run: the decoder layers of
  other stages become parameterless pass-throughs (:class:`OtherStageLayer`, so the model's
  own loop and its per-layer-index lookups -- Gemma-2's ``layer_types[i]``, the attention's
  ``layer_idx`` -- keep the original indices and parameter FQNs), the embedding is kept on
  the first stage only, the final norm and ``lm_head`` on the last only;
* the per-kind ``parallelize_module`` plans then run on the stage's own (non-pp) submesh;
* :func:`pipeline` wraps the stage in a :class:`PipelinedModel`: calling it with the global
  batch runs a ``ScheduleGPipe`` forward-only schedule over the ``pp`` mesh dim (every rank
  calls it; activations go to the next stage's rank with the same dp / ep / tp coordinates)
  and returns the logits on the last stage, None on the others.

Each stage runs the model's own forward (masks, rotary tables, Gemma-2's final logit
softcapping): the first stage from ``input_ids``, a later one from the hidden states it
received, passed as ``inputs_embeds`` (HF decoders feed them to the first layer as they are;
an embedding scale such as Gemma-2's lives in the embedding module, on the first stage;
Granite's, applied by the model's forward to ``inputs_embeds``, is set to 1 on later stages), a
stage before the last returning the hidden states after its last layer.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe


class OtherStageLayer(nn.Module):
    """Stands for a decoder layer another pipeline stage runs: no parameters; the hidden
    states pass through unchanged."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def keep_stage(model: nn.Module, layers, first: bool, last: bool) -> nn.Module:
    """Keep in ``model`` (an HF ``*ForCausalLM``) only what its pipeline stage runs: the
    decoder layers ``layers`` (original indices), the embedding when ``first``, the final
    norm and ``lm_head`` when ``last``. Returns ``model``."""
    inner = model.model
    keep = set(layers)
    for i in range(len(inner.layers)):
        if i not in keep:
            inner.layers[i] = OtherStageLayer()
    if not first:
        inner.embed_tokens = None
        if isinstance(getattr(inner, "embedding_multiplier", None), (int, float)):
            # Granite scales inputs_embeds in the model's forward, not in its embedding
            # module: a later stage's received hidden states are already scaled
            inner.embedding_multiplier = 1.0
    if not last:
        inner.norm = nn.Identity()
        model.lm_head = None
    return model


class StageModule(nn.Module):
    """One stage's forward: ``x`` = token ids [rows, seq] on the first stage, else the
    hidden states [rows, seq, hidden] the previous stage sent; returns the logits
    [rows, seq, vocab] on the last stage, else the hidden states after the stage's last
    layer."""

    def __init__(self, model: nn.Module, first: bool, last: bool):
        super().__init__()
        self.model, self.first, self.last = model, first, last

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None):
        kw = {"attention_mask": attention_mask, "use_cache": False,
              "input_ids" if self.first else "inputs_embeds": x}
        if self.last:
            out = self.model(**kw)
            return out if isinstance(out, torch.Tensor) else out.logits
        return self.model.model(**kw).last_hidden_state


def _text_config(model: nn.Module):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


class PipelinedModel(nn.Module):
    """This rank's pipeline stage; ``forward(input_ids, attention_mask=None)`` runs the
    whole pipeline on this rank's batch rows (every rank of the pp group calls it) and
    returns the logits [batch, seq, vocab] on the last stage, None elsewhere.

    ``microbatches``: the most micro-batches a forward is cut into (the largest count up to
    it that divides the batch rows into multiples of ``row_unit`` is used);
    ``residual_rows_split``: the residual stream between layers holds 1/n of a micro-batch's
    rows per rank (sequence parallelism over tp: n = tp; else 1)."""

    def __init__(self, stage: StageModule, pp_mesh, microbatches: int, row_unit: int = 1,
                 residual_rows_split: int = 1):
        super().__init__()
        self.stage = stage
        self.stage_index, self.num_stages = pp_mesh.get_local_rank(), pp_mesh.size()
        self.group = pp_mesh.get_group()
        self.microbatches, self.row_unit = int(microbatches), int(row_unit)
        self.residual_rows_split = int(residual_rows_split)
        cfg = _text_config(stage.model)
        self.hidden, self.vocab = int(cfg.hidden_size), int(cfg.vocab_size)
        self.dtype = next(stage.parameters()).dtype
        self._schedules: dict[tuple, ScheduleGPipe] = {}

    def micro_batches(self, rows: int) -> int:
        """Micro-batches for ``rows`` batch rows: the largest m <= :attr:`microbatches`
        with ``rows / m`` a multiple of ``row_unit`` (1 when none is)."""
        for m in range(min(self.microbatches, rows), 0, -1):
            if rows % m == 0 and (rows // m) % self.row_unit == 0:
                return m
        return 1

    def _schedule(self, rows: int, seq: int, device) -> ScheduleGPipe:
        m = self.micro_batches(rows)
        key = (rows, seq, m)
        if key not in self._schedules:
            mb = rows // m
            hidden = torch.empty(mb // self.residual_rows_split, seq, self.hidden,
                                 dtype=self.dtype, device=device)
            first, last = self.stage_index == 0, self.stage_index == self.num_stages - 1
            inp = torch.empty(mb, seq, dtype=torch.long, device=device) if first else hidden
            out = torch.empty(mb, seq, self.vocab, dtype=self.dtype, device=device) if last \
                else hidden
            stage = PipelineStage(self.stage, self.stage_index, self.num_stages, device,
                                  input_args=(inp,), output_args=(out,), group=self.group)
            self._schedules[key] = ScheduleGPipe(stage, n_microbatches=m)
        return self._schedules[key]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor | None:
        """Logits of whole sequences on the last stage (None elsewhere); ``attention_mask``:
        an optional 2-D [batch, seq] padding mask. No KV cache."""
        given = sorted(k for k, v in kwargs.items() if v is not None and v is not False)
        if given:
            raise ValueError(f"a pipelined model (pp={self.num_stages}) runs whole sequences: "
                             f"it takes no {', '.join(given)}")
        sched = self._schedule(input_ids.shape[0], input_ids.shape[1], input_ids.device)
        extra = {} if attention_mask is None else {"attention_mask": attention_mask}
        with torch.no_grad():
            out = sched.eval(input_ids, **extra) if self.stage_index == 0 else sched.eval(**extra)
        return out if self.stage_index == self.num_stages - 1 else None


def pipeline(model: nn.Module, world_mesh, microbatches: int, row_unit: int = 1,
             residual_rows_split: int = 1) -> PipelinedModel:
    """The :class:`PipelinedModel` of this rank's stage of ``model`` (already cut by
    :func:`keep_stage` and parallelized on its submesh), the stage being this rank's
    coordinate on ``world_mesh``'s ``pp`` dim."""
    pp_mesh = world_mesh["pp"]
    s, n = pp_mesh.get_local_rank(), pp_mesh.size()
    stage = StageModule(model, s == 0, s == n - 1)
    return PipelinedModel(stage, pp_mesh, microbatches, row_unit, residual_rows_split)
