"""``generate`` on the fast runtime (torch only): prefill a left-padded prompt batch into
the runtime's own KV cache, then decode one token per step, greedy or sampled.

Every rank calls :func:`generate` with the same global batch; each serves its dp x ep rows
(tp ranks of a group see the same rows and pick the same tokens: identical logits, the
same seeded sampler), pipeline stages pass the hidden states on and the last stage's
tokens are broadcast back over ``pp``; the new tokens are all-gathered once at the end.

On a GPU (``torch.cuda.is_available()``) the decode step is captured as a CUDA graph per
(batch rows, attention bucket): attention reads the first ``bucket`` cache slots (the
filled steps rounded up to ``graph_block``), so one graph serves ``graph_block`` steps.
Plans whose step reads split sizes on the host (ep > 1, MoE dispatch) or sends between
pipeline stages run the step eagerly. On CPU every step runs eagerly over exactly the
filled slots.

Prefill on a GPU is compiled (``torch.compile``, static shapes) once per prompt bucket: the
left-padded prompts are padded further on the left to the smallest of
:data:`PREFILL_BUCKETS` that holds them (:func:`prefill_bucket`; more padding changes no
token: positions count from each row's first real token and padding is masked), so a few
compiled graphs serve every prompt length. On CPU prefill runs eagerly at the prompt's own
length (``prefill_buckets=...`` pads to buckets there too, eagerly).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from shardc.runtime.fast import FastModel
from shardc.runtime.kv_cache import KVCache


def left_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's first real step (``[batch]`` int64) of a left-padded 2-D ``attention_mask``
    (1 = token, 0 = padding); ValueError when a row has padding after a token."""
    mask = attention_mask.to(torch.long)
    start = mask.shape[1] - mask.sum(1)
    want = torch.arange(mask.shape[1], device=mask.device)[None] >= start[:, None]
    if not torch.equal(want, mask.bool()):
        raise ValueError("generate takes left-padded prompts (padding before the tokens)")
    return start


def pick(logits: torch.Tensor, temperature: float, top_k: int | None,
         generator: torch.Generator | None) -> torch.Tensor:
    """Next tokens ``[rows, 1]`` from last-position logits ``[rows, 1, vocab]``: argmax
    when ``temperature`` is 0, else a sample of softmax(logits / temperature) restricted to
    the ``top_k`` largest (exponential race: argmax of p / Exp(1), no host sync)."""
    logits = logits[:, -1].float()
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k:
        kth = logits.topk(min(int(top_k), logits.shape[-1]), -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / race).argmax(-1, keepdim=True)


class DecodeGraphs:
    """CUDA graphs of the decode step (GPU only), one per (rows, attention bucket)."""

    def __init__(self, fast: FastModel, cache: KVCache, block: int):
        self.fast, self.cache, self.block = fast, cache, int(block)
        self.ids = torch.zeros(cache.rows, 1, dtype=torch.long, device=fast.device)
        self.graphs: dict[int, tuple] = {}

    def bucket(self, filled: int) -> int:
        return min(-(-(filled + 1) // self.block) * self.block, self.cache.context)

    def _step(self, upto: int):
        return self.fast.forward(self.ids, self.cache, self.cache.step.reshape(1), upto, False)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        upto = self.bucket(self.cache.filled)
        self.ids.copy_(ids)
        if upto not in self.graphs:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: rewrites the same slot with the same step
                    self._step(upto)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self._step(upto)
            self.graphs[upto] = (graph, out)
        graph, out = self.graphs[upto]
        graph.replay()
        return out


# prompt lengths a compiled prefill runs at (tokens per sequence)
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def prefill_bucket(prompt: int, limit: int | None = None, buckets=PREFILL_BUCKETS) -> int:
    """The prompt length prefill runs at: the smallest bucket ``>= prompt`` (and ``<=
    limit``, the cache steps the prompt may fill), else ``prompt`` itself (no bucket fits)."""
    for b in sorted(buckets):
        if prompt <= b and (limit is None or b <= limit):
            return int(b)
    return int(prompt)


def pad_left(ids: torch.Tensor, start: torch.Tensor, length: int):
    """``ids [rows, P]`` left-padded (id 0) to ``length`` steps; each row's first real step
    ``start`` moved by the padding added."""
    extra = int(length) - ids.shape[1]
    if extra <= 0:
        return ids, start
    return torch.cat([ids.new_zeros(ids.shape[0], extra), ids], 1), start + extra


class Prefill:
    """The prefill pass of one :class:`FastModel`: on a GPU (``torch.cuda.is_available()``
    and the model on it) ``FastModel.forward`` compiled with static shapes, one graph per
    prompt bucket; elsewhere eager. ``buckets``: the prompt lengths it pads to (default
    :data:`PREFILL_BUCKETS` when compiled, none when eager)."""

    def __init__(self, fast: FastModel, buckets=None, compile: bool | None = None):
        gpu = torch.cuda.is_available() and fast.device.type == "cuda"
        self.compiled = gpu if compile is None else bool(compile) and gpu
        self.buckets = tuple(buckets) if buckets is not None else (
            PREFILL_BUCKETS if self.compiled else ())
        self.fast = fast
        self.forward = torch.compile(fast.forward, dynamic=False) if self.compiled \
            else fast.forward

    def length(self, prompt: int, limit: int | None = None) -> int:
        """The steps a prompt of ``prompt`` tokens fills (its bucket, or itself)."""
        return prefill_bucket(prompt, limit, self.buckets) if self.buckets else int(prompt)

    def __call__(self, cache: KVCache, ids: torch.Tensor, start: torch.Tensor,
                 limit: int | None = None):
        """Write the prompts ``ids [rows, P]`` (rows starting at ``start``), padded on the
        left to their bucket (at most ``limit`` steps, default the cache's), into an emptied
        cache; the last stage's logits of the last position."""
        limit = cache.context if limit is None else limit
        ids, start = pad_left(ids, start, self.length(ids.shape[1], limit))
        cache.reset(start)
        steps = torch.arange(ids.shape[1], device=ids.device)
        out = self.forward(ids, cache, steps, ids.shape[1], True)
        cache.advance(ids.shape[1])
        return out


def decode_step(fast: FastModel, cache: KVCache, ids: torch.Tensor, graphs=None):
    """One decode step: ``ids [rows, 1]`` written at the next step; last-stage logits."""
    if graphs is not None:
        out = graphs(ids)
    else:
        out = fast.forward(ids, cache, cache.step.reshape(1), cache.filled + 1, False)
    cache.advance(1)
    return out


def _share_tokens(fast: FastModel, tok: torch.Tensor | None, rows: int, device):
    """The last stage's tokens, on every stage (broadcast over pp)."""
    if not fast.pp:
        return tok
    buf = tok if tok is not None else torch.empty(rows, 1, dtype=torch.long, device=device)
    dist.broadcast(buf, src=fast.last_rank, group=fast.pp.pg)
    return buf


def fast_generate(fast: FastModel, input_ids: torch.Tensor, max_new_tokens: int, *,
             attention_mask: torch.Tensor | None = None, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0, context: int | None = None,
             cuda_graph: bool | None = None, graph_block: int = 256,
             prefill_buckets=None) -> torch.Tensor:
    """``input_ids [batch, P]`` (left padded per ``attention_mask``) followed by
    ``max_new_tokens`` generated tokens, ``[batch, P + max_new_tokens]``, on every rank.
    ``context``: the cache's steps (default: the prompt's bucket + ``max_new_tokens``);
    ``cuda_graph``: capture the decode step (default: on a GPU when the plan allows it);
    ``prefill_buckets``: prompt lengths prefill pads to (default: :class:`Prefill`'s)."""
    batch, prompt = input_ids.shape
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    start = left_padding(mask)
    g = fast.batch
    if batch % g.size:
        raise ValueError(f"batch {batch} does not split over dp x ep = {g.size} ranks")
    ids = input_ids.chunk(g.size, 0)[g.rank]
    start = start.chunk(g.size, 0)[g.rank]
    rows = ids.shape[0]
    if context is not None and int(context) < prompt + max_new_tokens:
        raise ValueError(f"context {context} < prompt {prompt} + {max_new_tokens} new tokens")
    run_prefill = Prefill(fast, prefill_buckets)
    context = int(context or run_prefill.length(prompt) + max_new_tokens)
    cache = fast.new_cache(rows, context)
    gen = None
    if temperature > 0:
        gen = torch.Generator(device=ids.device)
        gen.manual_seed(int(seed) * 1_000_003 + g.rank)
    use_graph = torch.cuda.is_available() and ids.is_cuda and fast.graphable
    if cuda_graph is not None:
        use_graph = use_graph and cuda_graph
    graphs = DecodeGraphs(fast, cache, graph_block) if use_graph else None
    with torch.no_grad():
        logits = run_prefill(cache, ids, start, context - max_new_tokens)
        tok = _share_tokens(fast, None if logits is None else pick(logits, temperature, top_k,
                                                                   gen), rows, ids.device)
        out = [tok]
        for _ in range(max_new_tokens - 1):
            logits = decode_step(fast, cache, tok, graphs)
            tok = _share_tokens(fast, None if logits is None else
                                pick(logits, temperature, top_k, gen), rows, ids.device)
            out.append(tok)
        new = torch.cat(out, 1)
        if g:
            new = funcol.all_gather_single(new.contiguous(), 0, g.pg) + 0  # waits
    return torch.cat([input_ids, new.to(input_ids.device)], 1)
