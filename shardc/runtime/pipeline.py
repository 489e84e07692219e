"""Pipeline stages on ``torch.distributed.pipelining`` for the emitted ``parallelize.py``
(torch only; inlined by ``shardc compile --standalone``).

A pipeline-parallel plan runs each rank as one stage, torchtitan-style:

* :func:`keep_stage` drops from the model what other stages run: the decoder layers of
  other stages become parameterless pass-throughs (:class:`OtherStageLayer`, so the model's
  own loop and its per-layer-index lookups -- Gemma-2's ``layer_types[i]``, the attention's
  ``layer_idx`` -- keep the original indices and parameter FQNs), the embedding (and learned
  position tables) is kept on the first stage only, the final norm and ``lm_head`` on the
  last only -- an HF causal LM (``model.layers``, GPT-2's ``transformer.h``) or a plain
  model (GPT-MoE's ``layers``, whose forward takes token ids only);
* the per-kind ``parallelize_module`` plans then run on the stage's own (non-pp) submesh;
* :func:`pipeline` wraps the stage in a :class:`PipelinedModel`: calling it with the global
  batch runs a ``ScheduleGPipe`` forward-only schedule over the ``pp`` mesh dim (every rank
  calls it; activations go to the next stage's rank with the same dp / ep / tp coordinates)
  and returns the logits on the last stage, None on the others.

Each stage runs the model's own forward (masks, rotary tables, Gemma-2's final logit
softcapping): the first stage from ``input_ids``, a later one from the hidden states it
received, passed as ``inputs_embeds`` (HF decoders feed them to the first layer as they are;
an embedding scale such as Gemma-2's lives in the embedding module, on the first stage; a
learned position table added by the first stage adds zeros later; Granite's, applied by
the model's forward to ``inputs_embeds``, is set to 1 on later stages) or, for a plain model,
in place of the token ids (its embedding a pass-through there); a stage before the last
returns the hidden states after its last layer.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe


class OtherStageLayer(nn.Module):
    """Stands for a decoder layer another pipeline stage runs: no parameters; the hidden
    states pass through unchanged. ``block_type`` (Nemotron-H's model loop picks each
    block's mask by it): the replaced layer's, when it had one."""

    def __init__(self, block_type=None):
        super().__init__()
        if isinstance(block_type, str):
            self.block_type = block_type

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class PassThrough(nn.Module):
    """Stands for the token embedding of a plain model (one whose forward takes no
    ``inputs_embeds``) on a later stage: the hidden states the stage received come in where
    the token ids would, and pass through."""

    def forward(self, x, *args, **kwargs):
        return x


class ZeroFeatures(nn.Module):
    """Stands for a learned position table (GPT-2's ``wpe``) on a later stage: the first
    stage added the positions already, so it contributes zeros ``[..., width]``."""

    def __init__(self, width: int, dtype: torch.dtype):
        super().__init__()
        self.width, self.dtype = int(width), dtype

    def forward(self, ids, *args, **kwargs):
        return torch.zeros(*ids.shape, self.width, dtype=self.dtype, device=ids.device)


def takes_inputs_embeds(model: nn.Module) -> bool:
    """Whether ``model`` is an HF model (a ``PreTrainedModel``: it names its base model, and
    its forward takes ``inputs_embeds``, where a later stage feeds its hidden states) rather
    than a plain model whose forward takes token ids only."""
    return isinstance(getattr(model, "base_model_prefix", None), str)


def _replace(model: nn.Module, path: str, module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def keep_stage(model: nn.Module, layers, first: bool, last: bool,
               layers_path: str = "model.layers", embedding: str = "model.embed_tokens",
               positions=(), final=("model.norm",), lm_head: str = "lm_head") -> nn.Module:
    """Keep in ``model`` only what its pipeline stage runs: the decoder layers ``layers``
    (original indices) of the list at ``layers_path``, the token ``embedding`` and learned
    ``positions`` tables when ``first``, the ``final`` norm(s) and ``lm_head`` when ``last``
    (module paths; the defaults are an HF ``*ForCausalLM``'s, GPT-2's are
    ``transformer.h`` / ``transformer.wte`` / ``transformer.wpe`` / ``transformer.ln_f``).
    Dropped: a layer becomes an :class:`OtherStageLayer`, a final norm an identity, the
    embedding and ``lm_head`` None (HF: the stage calls the base model with
    ``inputs_embeds``) or pass-throughs (a plain model, called with the hidden states), a
    position table :class:`ZeroFeatures`. Returns ``model``."""
    stack = model.get_submodule(layers_path)
    keep = set(layers)
    for i in range(len(stack)):
        if i not in keep:
            stack[i] = OtherStageLayer(getattr(stack[i], "block_type", None))
    hf = takes_inputs_embeds(model)
    if not first:
        _replace(model, embedding, None if hf else PassThrough())
        for path in positions:
            table = model.get_submodule(path).weight
            _replace(model, path, ZeroFeatures(table.shape[-1], table.dtype))
        inner = getattr(model, "model", None)
        if isinstance(getattr(inner, "embedding_multiplier", None), (int, float)):
            # Granite scales inputs_embeds in the model's forward, not in its embedding
            # module: a later stage's received hidden states are already scaled
            inner.embedding_multiplier = 1.0
    if not last:
        for path in final:
            _replace(model, path, nn.Identity())
        _replace(model, lm_head, None if hf else nn.Identity())
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
        if not takes_inputs_embeds(self.model):  # a plain model: ids or hidden states in
            out = self.model(x) if attention_mask is None else self.model(x, attention_mask)
            return out if isinstance(out, torch.Tensor) else out.logits
        kw = {"attention_mask": attention_mask, "use_cache": False,
              "input_ids" if self.first else "inputs_embeds": x}
        if self.last:
            out = self.model(**kw)
            return out if isinstance(out, torch.Tensor) else out.logits
        return self.model.base_model(**kw).last_hidden_state


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
