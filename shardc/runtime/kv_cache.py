"""The KV cache the fast runtime owns (torch only; no transformers cache object).

One :class:`KVCache` per rank, preallocated once for the rows this rank serves and the
plan's context, holding only what this rank attends over:

* a heads-split attention (``attn_core heads``): its KV heads; a batch-split one
  (``attn_core batch``): its rows; a replicated one: everything; only the layers of this
  rank's pipeline stage;
* MLA (DeepSeek-V2/V3): the latent cache, ``[rows, slots, kv_lora_rank]`` plus the shared
  rope key ``[rows, slots, qk_rope_head_dim]`` (no per-head keys / values); after a ``row``
  qkv (or a ``col`` one before a batch split) per-head ``k_nope | k_rope`` keys and values
  (:mod:`shardc.runtime.mla_local`);
* a sliding-window layer: ``min(context, window)`` slots used as a ring;
* a Mamba-2 layer (:mod:`shardc.runtime.mamba2_local`): no slots, a constant state per row
  (:class:`RecurrentState`: the conv window ``[rows, conv channels, kernel - 1]`` and the SSM
  state ``[rows, heads, head_dim, state]`` of this rank's heads, in the dtype the cost model
  charges: :func:`shardc.runtime.mamba2_local.ssm_state_dtype`), zeroed by :meth:`KVCache.reset`.

Time is counted in *steps*: the prompt (left padded to one length ``P``) fills steps
``0 .. P-1`` and decode step ``t`` writes step ``t`` of every row. Row ``b``'s first real
token is step ``start[b]`` (its left padding is steps ``0 .. start[b]-1``), its position
``t - start[b]``. Each layer keeps the step each slot holds (``slot_step``, -1 = empty):
a key is visible to the query of step ``t`` of row ``b`` when ``start[b] <= step <= t`` and,
for a window ``W``, ``step > t - W`` (the HF sliding-window rule on positions, which differ
by the same amount as steps). Attention reads only the slots filled so far (``filled``, or
the bucket of it a captured graph was built for), never the unfilled rest of the cache.
"""

from __future__ import annotations

import torch


class LayerCache:
    """One layer's slots: ``k`` / ``v`` ``[rows, kv_heads, slots, head_dim]`` (or, for MLA,
    ``k`` = latent ``[rows, slots, kv_lora_rank]`` and ``v`` = rope key
    ``[rows, slots, rope_dim]``), ``slot_step [slots]`` (int64, -1 = empty), ``window``
    (tokens, or None), ``rows`` (which of the cache's rows it holds)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, slot_dim: int, window: int | None,
                 rows: slice = slice(None)):
        self.k, self.v, self.slot_dim, self.window, self.rows = k, v, slot_dim, window, rows
        self.slot_step = torch.full((k.shape[slot_dim],), -1, dtype=torch.long, device=k.device)

    @property
    def slots(self) -> int:
        return self.k.shape[self.slot_dim]

    @property
    def ring(self) -> bool:
        """Whether steps wrap around (a sliding window shorter than the context)."""
        return self.window is not None and self.slots <= self.window

    def write(self, steps: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the keys / values of ``steps`` (int64 ``[n]``, increasing; ``k`` / ``v`` with
        ``n`` entries along the slot dim). A ring keeps the last ``slots`` of them."""
        if steps.numel() > self.slots:
            keep = steps.numel() - self.slots
            steps = steps[keep:]
            k, v = k.narrow(self.slot_dim, keep, self.slots), v.narrow(self.slot_dim, keep,
                                                                       self.slots)
        idx = steps % self.slots
        self.k.index_copy_(self.slot_dim, idx, k.to(self.k.dtype))
        self.v.index_copy_(self.slot_dim, idx, v.to(self.v.dtype))
        self.slot_step.index_copy_(0, idx, steps)

    def view(self, upto: int):
        """(k, v, slot_step) over the slots attention reads: the first ``upto`` (the steps
        filled so far, or a graph's bucket of them), all of a ring."""
        n = self.slots if self.ring else min(int(upto), self.slots)
        return (self.k.narrow(self.slot_dim, 0, n), self.v.narrow(self.slot_dim, 0, n),
                self.slot_step[:n])


class RecurrentState:
    """One recurrent layer's per-row state (no sequence length): ``conv [rows, channels,
    kernel - 1]`` (the last inputs of the causal convolution) and ``ssm [rows, heads,
    head_dim, state]`` (the conv window in the model's dtype, the SSM state in the one the
    cost model charges: :mod:`shardc.ir.recurrent`; the scan computes in fp32); ``rows``
    (which of the cache's rows it holds)."""

    def __init__(self, conv: torch.Tensor, ssm: torch.Tensor, rows: slice = slice(None)):
        self.conv, self.ssm, self.rows = conv, ssm, rows

    def zero(self) -> None:
        self.conv.zero_()
        self.ssm.zero_()


class KVCache:
    """This rank's cache: ``layers`` (layer index -> :class:`LayerCache`), ``states`` (layer
    index -> :class:`RecurrentState`), ``start``
    (``[rows]`` int64, each row's first real step), ``step`` (the next step to write, a
    device scalar a captured graph reads) and ``filled`` (the same, as a Python int)."""

    def __init__(self, rows: int, context: int, device, dtype=torch.float32):
        self.rows, self.context, self.device, self.dtype = rows, int(context), device, dtype
        self.layers: dict[int, LayerCache] = {}
        self.states: dict[int, RecurrentState] = {}
        self.start = torch.zeros(rows, dtype=torch.long, device=device)
        self.step = torch.zeros((), dtype=torch.long, device=device)
        self.filled = 0

    def add_heads(self, layer: int, rows: slice, kv_heads: int, head_dim: int,
                  value_dim: int | None = None, window: int | None = None) -> LayerCache:
        """Preallocate a layer of ``kv_heads`` local heads (keys ``head_dim`` wide, values
        ``value_dim``, default the same) for the cache's ``rows`` (a slice: a batch-split
        attention caches its tp rank's share)."""
        slots = min(self.context, window) if window else self.context
        shape = (len(range(self.rows)[rows]), kv_heads, slots)
        k = torch.zeros(*shape, head_dim, device=self.device, dtype=self.dtype)
        v = torch.zeros(*shape, value_dim or head_dim, device=self.device, dtype=self.dtype)
        self.layers[layer] = LayerCache(k, v, 2, window, rows)
        return self.layers[layer]

    def add_latent(self, layer: int, rows: slice, latent_dim: int, rope_dim: int,
                   window: int | None = None) -> LayerCache:
        """Preallocate an MLA layer for ``rows``: the normed latent and the rotated shared
        rope key."""
        slots = min(self.context, window) if window else self.context
        n = len(range(self.rows)[rows])
        k = torch.zeros(n, slots, latent_dim, device=self.device, dtype=self.dtype)
        v = torch.zeros(n, slots, rope_dim, device=self.device, dtype=self.dtype)
        self.layers[layer] = LayerCache(k, v, 1, window, rows)
        return self.layers[layer]

    def add_state(self, layer: int, rows: slice, channels: int, kernel: int, heads: int,
                  head_dim: int, state: int, ssm_dtype=None) -> RecurrentState:
        """Preallocate a recurrent layer's state for ``rows``: a conv window of ``channels``
        x ``kernel - 1`` (the model's dtype) and an SSM state of ``heads`` x ``head_dim`` x
        ``state`` per row (``ssm_dtype``, default the model's)."""
        n = len(range(self.rows)[rows])
        conv = torch.zeros(n, channels, kernel - 1, device=self.device, dtype=self.dtype)
        ssm = torch.zeros(n, heads, head_dim, state, device=self.device,
                          dtype=ssm_dtype or self.dtype)
        self.states[layer] = RecurrentState(conv, ssm, rows)
        return self.states[layer]

    def nbytes(self) -> int:
        """Bytes this rank's cache holds (keys, values, latents and recurrent states)."""
        return sum(c.k.numel() * c.k.element_size() + c.v.numel() * c.v.element_size()
                   for c in self.layers.values()) + sum(
            s.conv.numel() * s.conv.element_size() + s.ssm.numel() * s.ssm.element_size()
            for s in self.states.values())

    def reset(self, start: torch.Tensor) -> None:
        """Empty every layer and set the rows' first real steps (``start``, ``[rows]``)."""
        for c in self.layers.values():
            c.slot_step.fill_(-1)
        for st in self.states.values():
            st.zero()
        self.start.copy_(start)
        self.step.zero_()
        self.filled = 0

    def advance(self, n: int) -> None:
        """``n`` more steps were written to every layer."""
        self.step += n
        self.filled += n
        if self.filled > self.context:
            raise ValueError(f"the KV cache holds {self.context} steps; {self.filled} written")


def visible(cache_steps: torch.Tensor, query_steps: torch.Tensor, start: torch.Tensor,
            window: int | None) -> torch.Tensor:
    """Boolean attention mask ``[rows, 1, queries, keys]``: key slot ``j`` (holding step
    ``cache_steps[j]``, -1 = empty) is visible to query step ``query_steps[i]`` of row ``b``
    when ``start[b] <= step <= query`` (and ``step > query - window``). A query inside the
    left padding sees itself only (its output is never used; SDPA needs one key)."""
    ks = cache_steps[None, None, :]
    qs = query_steps[None, :, None]
    ok = (ks >= start[:, None, None]) & (ks <= qs)
    if window is not None:
        ok &= ks > qs - window
    pad_query = qs < start[:, None, None]
    ok |= pad_query & (ks == qs)
    return ok[:, None]


def positions(query_steps: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Token positions ``[rows, queries]`` (int64): ``step - start``, 0 inside the padding."""
    return (query_steps[None, :] - start[:, None]).clamp_min(0)
