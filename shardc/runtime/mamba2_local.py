"""Mamba-2 layers on the fast runtime (torch only): Nemotron-H's hybrid blocks (one norm and
one mixer per layer: a Mamba-2 mixer, attention without rotary embeddings, or an ungated
``up_proj`` / ``down_proj`` MLP), run on local shards with the plan's walk.

A Mamba-2 mixer is the walk's attention branch: ``in_proj`` is the ``qkv`` op (its packed
output ``z | x | B | C | dt``, widths ``H P | H P | G N | G N | H`` for ``H`` heads of
``P`` channels in ``G`` groups of state size ``N``), the causal conv, the SSD scan and
``A_log`` / ``D`` / ``dt_bias`` the ``attn_core``, ``out_proj`` the ``out_proj`` op. Under
a heads split (``attn_core heads``, tp | H and tp | G: the search's legality) a rank holds
its ``H / tp`` heads and ``G / tp`` groups of every packed part (``S(1)`` with those parts,
the placement :class:`~shardc.runtime.styles.Mamba2HeadsParallel` gives the conv, the
per-head vectors and the gated norm's weight), so the gated group RMSNorm is local; after a
batch split (``S(0)``) or a replicated core it runs whole on the rows it holds.

The state has no sequence length (:class:`~shardc.runtime.kv_cache.RecurrentState`): the
conv window and the SSM state per row. Left padding must not reach it: as HF does with
the 2-D mask, the mixer's input and the conv's output are zeroed at padded steps, so
``x = B = 0`` there and the state stays zero until the row's first token. Prefill (and
any multi-token forward) runs the chunked SSD scan (:func:`ssd_scan`, chunks of the
model's ``chunk_size``) from the cached state; a decode step is the same scan over one
token: one recurrence step. ``dt`` is clamped to the model's ``time_step_limit`` in both,
as HF's chunked form (the definition a full recompute uses).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from shardc.runtime.kv_cache import KVCache
from shardc.runtime.local_ops import Group, held_rows, linear, local_tensor, norm_of, repair
from shardc.runtime.styles import PrepareHiddenStates, interleave


class Mamba2HeadsParallel(PrepareHiddenStates):
    """A heads split of a Mamba-2 mixer (``attn_core heads``): its conv weight and bias are
    cut per packed part (``conv_parts``: the widths of ``x | B | C``, each cut tp ways, a
    rank's slices side by side), ``A_log`` / ``D`` / ``dt_bias`` and the gated norm's
    weight by heads (``Shard(0)``: tp | groups keeps each norm group on one rank). Its
    ``in_proj`` / ``out_proj`` take their own styles (the walk's qkv / out_proj). Given
    layouts, it also moves its input as :class:`PrepareHiddenStates`; given ``rows`` (a
    :class:`~shardc.runtime.styles.CoreRowsAttention`: under sequence parallelism a ``rep``
    in_proj before the heads split) it applies that style first (one style per module).
    The fast runtime (:class:`Mamba2Mixer`) runs the placed shards."""

    def __init__(self, *, conv_parts, input_layouts=None, desired_input_layouts=None,
                 rows=None):
        super().__init__(input_layouts=input_layouts, desired_input_layouts=desired_input_layouts)
        self.conv_parts = tuple(int(w) for w in conv_parts)
        self.rows = rows

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if self.rows is not None:
            self.rows._apply(module, device_mesh)
        if self.src is not None:
            super()._apply(module, device_mesh)
        n = device_mesh.size()
        if int(module.n_groups) % n or int(module.num_heads) % n:
            raise ValueError(f"{module.num_heads} Mamba-2 heads in {module.n_groups} groups "
                             f"do not split over tp={n}")
        owners = [(module.conv1d, name, self.conv_parts) for name in ("weight", "bias")]
        owners += [(module, name, ()) for name in ("A_log", "D", "dt_bias")]
        owners.append((module.norm, "weight", ()))
        for owner, name, parts in owners:
            param = getattr(owner, name, None)
            if param is None:
                continue
            full = interleave(param.detach(), 0, parts, n) if parts else param.detach()
            dt = distribute_tensor(full, device_mesh, [Shard(0)],
                                   src_data_rank=getattr(self, "src_data_rank", 0))
            owner.register_parameter(name, nn.Parameter(dt, requires_grad=False))
        for name in ("num_heads", "n_groups", "intermediate_size", "conv_dim"):
            setattr(module, name, int(getattr(module, name)) // n)  # its own forward's views
        module.heads_split = n  # the fast runtime reads the whole counts back
        _local_params_in_forward(module, [(o, name) for o, name, _ in owners])
        return module


def _local_params_in_forward(module: nn.Module, owned) -> None:
    """While ``module``'s own forward runs (the model's forward, ``shardc verify``), the
    parameters ``owned`` ((owner, name) pairs, DTensor shards) are their local shards: the
    mixer's conv, scan and norm compute on this rank's heads with plain tensors."""
    saved: list = []

    def pre(mod, args, kwargs):
        for owner, name in owned:
            param = owner._parameters.get(name)
            if param is not None and hasattr(param, "to_local"):
                saved.append((owner, name, param))
                owner._parameters[name] = nn.Parameter(param.to_local(), requires_grad=False)
        return args, kwargs

    def post(mod, args, kwargs, output):
        while saved:
            owner, name, param = saved.pop()
            owner._parameters[name] = param
        return output

    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(post, with_kwargs=True)


def is_hybrid_block(layer) -> bool:
    """Whether ``layer`` is a Nemotron-H block: one ``norm`` and one ``mixer`` of the kind
    its ``block_type`` names."""
    return hasattr(layer, "mixer") and hasattr(layer, "block_type") and hasattr(layer, "norm")


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, state: torch.Tensor, chunk: int):
    """Mamba-2's state-space scan (the SSD chunked form) of ``x [rows, seq, heads, P]``
    with discretised steps ``dt [rows, seq, heads]``, decay rates ``A [heads]`` (< 0),
    ``B`` / ``C [rows, seq, heads, N]`` (per head), from ``state [rows, heads, P, N]``:
    ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t``. Returns ``(y [rows,
    seq, heads, P], final state)``, all fp32; the skip term ``D x`` is the caller's.
    Within a chunk of ``chunk`` steps the outputs are one masked product (the decays
    between steps from the cumulative sums of ``dt A``); the chunks' states are carried one
    chunk at a time."""
    r, s, h, p = x.shape
    n = B.shape[-1]
    chunk = max(min(int(chunk), s), 1)
    pad = -s % chunk
    if pad:  # zero steps at the end: dt = 0 leaves the state as it is
        x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    c = (s + pad) // chunk
    xs = (x * dt[..., None]).view(r, c, chunk, h, p)
    acs = (dt * A).view(r, c, chunk, h).cumsum(2)  # log decay from each chunk's start
    Bc, Cc = B.view(r, c, chunk, h, n), C.view(r, c, chunk, h, n)
    later = ~torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    gaps = (acs[:, :, :, None] - acs[:, :, None]).masked_fill(later[None, None, :, :, None],
                                                              float("-inf"))
    scores = torch.einsum("rcihn,rcjhn->rcijh", Cc, Bc) * gaps.exp()
    y = torch.einsum("rcijh,rcjhp->rcihp", scores, xs)
    to_end = (acs[:, :, -1:] - acs).exp()  # decay from each step to its chunk's end
    added = torch.einsum("rclhn,rclhp->rchpn", Bc * to_end[..., None], xs)
    whole = acs[:, :, -1].exp()  # [r, c, h]: a whole chunk's decay
    starts = []
    for k in range(c):
        starts.append(state)
        state = state * whole[:, k, :, None, None] + added[:, k]
    y = y + torch.einsum("rclhn,rchpn->rclhp", Cc, torch.stack(starts, 1)) * acs.exp()[..., None]
    return y.reshape(r, c * chunk, h, p)[:, :s], state


# SSM-state dtypes by name (a config's ``mamba_ssm_cache_dtype``)
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def ssm_state_dtype(config) -> torch.dtype | None:
    """The dtype the SSM state is held in (None: the model's): vLLM's rule, which the cost
    model charges for this runtime (``shardc.ir.recurrent.SSM_STATE_DTYPE["dtensor"]``) --
    Nemotron-H: the config's ``mamba_ssm_cache_dtype``, float32 when it names none."""
    if str(getattr(config, "model_type", "")) != "nemotron_h":
        return None
    named = str(getattr(config, "mamba_ssm_cache_dtype", "") or "").lower()
    return _DTYPES.get(named, torch.float32)


def _real(cache: KVCache, rows: slice, steps: torch.Tensor) -> torch.Tensor:
    """``[rows, seq, 1]`` 1 at the rows' real steps, 0 in their left padding."""
    start = cache.start[rows]
    return (steps[None, :] >= start[:, None])[..., None]


class Mamba2Mixer:
    """A Mamba-2 mixer (HF ``NemotronHMamba2Mixer``) of one layer on local shards; its
    state in the cache's :class:`~shardc.runtime.kv_cache.RecurrentState`."""

    def __init__(self, mixer, walk: dict, tp: Group, i: int):
        (_, self.c_in, _, _), (_, core, self.core_need, _), (_, self.c_out, _, _) = \
            walk["steps"]
        if core not in ("heads", "batch", "rep"):
            raise NotImplementedError(f"Mamba-2 core {core}")
        self.walk, self.tp, self.i = walk, tp, i
        n = tp.size if core == "heads" else 1
        placed = int(getattr(mixer, "heads_split", 1))  # counts divided by the style
        H, G = int(mixer.num_heads) * placed, int(mixer.n_groups) * placed
        self.P, self.N = int(mixer.head_dim), int(mixer.ssm_state_size)
        if H % n or G % n:
            raise NotImplementedError(f"a heads split at tp {n} of {H} Mamba-2 heads in {G} "
                                      "groups")
        self.h, self.g = H // n, G // n
        self.parts = (H * self.P, H * self.P, G * self.N, G * self.N, H)  # z | x | B | C | dt
        self.w_in, self.b_in = local_tensor(mixer.in_proj.weight), local_tensor(mixer.in_proj.bias)
        self.conv_w = local_tensor(mixer.conv1d.weight)[:, 0]  # [channels, kernel]
        self.conv_b = local_tensor(mixer.conv1d.bias)
        self.kernel = int(self.conv_w.shape[-1])
        self.act = mixer.act
        self.A = -torch.exp(local_tensor(mixer.A_log).float())
        self.D = local_tensor(mixer.D).float()
        self.dt_bias = local_tensor(mixer.dt_bias)
        self.dt_limit = tuple(float(t) for t in mixer.time_step_limit)
        self.chunk = int(mixer.chunk_size)
        self.ssm_dtype = ssm_state_dtype(getattr(mixer, "config", None))
        self.norm_w = local_tensor(mixer.norm.weight)
        self.norm_eps = float(mixer.norm.variance_epsilon)
        self.group = int(mixer.norm.group_size)
        self.w_out, self.b_out = local_tensor(mixer.out_proj.weight), local_tensor(mixer.out_proj.bias)
        if self.conv_w.shape[0] != self.h * self.P + 2 * self.g * self.N or \
                self.A.shape[0] != self.h or self.norm_w.shape[0] != self.h * self.P:
            raise NotImplementedError("Mamba-2 conv / per-head weights not placed by heads "
                                      f"(conv {tuple(self.conv_w.shape)}, A {tuple(self.A.shape)})")

    def alloc(self, cache: KVCache, rows: int) -> None:
        cache.add_state(self.i, held_rows(rows, self.core_need, self.tp), self.conv_w.shape[0],
                        self.kernel, self.h, self.P, self.N, self.ssm_dtype)

    def _conv(self, xbc: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
        """The causal depthwise conv of ``xbc [rows, seq, channels]`` after the cached
        window (updated in place), activated."""
        seq = torch.cat([conv_state, xbc.transpose(1, 2).to(conv_state.dtype)], -1)
        conv_state.copy_(seq[..., seq.shape[-1] - conv_state.shape[-1]:])
        out = F.conv1d(seq.to(self.conv_w.dtype), self.conv_w[:, None], self.conv_b,
                       groups=self.conv_w.shape[0])
        return self.act(out).transpose(1, 2).to(xbc.dtype)

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor, dtype) -> torch.Tensor:
        """HF's gated group RMSNorm of the rank's heads (whole groups: local)."""
        y = y * F.silu(z.float())
        g = y.unflatten(-1, (-1, self.group))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        return (self.norm_w * g.flatten(-2)).to(dtype)

    def __call__(self, x, residual, cache: KVCache, steps, upto, rope_tables, prefill):
        tp, w = self.tp, self.walk["steps"]
        state = cache.states[self.i]
        padded = steps.numel() > 1  # a decode step's token is never padding
        x = repair(x, residual, w[0][2], tp)
        if padded:
            x = x * _real(cache, held_rows(cache.rows, w[0][2], tp), steps).to(x.dtype)
        y = linear(x, self.w_in, self.b_in, self.c_in, tp)
        y = repair(y, w[0][3], self.core_need, tp, self.parts)
        h, g, P, N = self.h, self.g, self.P, self.N
        z, xbc, dt = y.split([h * P, h * P + 2 * g * N, h], -1)
        xbc = self._conv(xbc, state.conv)
        if padded:
            xbc = xbc * _real(cache, state.rows, steps).to(xbc.dtype)
        r, s = xbc.shape[0], xbc.shape[1]
        xs, B, C = xbc.float().split([h * P, g * N, g * N], -1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)
        xs = xs.view(r, s, h, P)
        B, C = (t.view(r, s, g, N).repeat_interleave(h // g, 2) for t in (B, C))
        out, final = ssd_scan(xs, dt, self.A, B, C, state.ssm.float(), self.chunk)
        state.ssm.copy_(final)
        out = (out + self.D[:, None] * xs).reshape(r, s, h * P)
        out = self._gated_norm(out, z, y.dtype)
        (_, _, need, prod) = w[2]
        out = linear(repair(out, self.core_need, need, tp), self.w_out, self.b_out, self.c_out,
                     tp)
        return repair(out, prod, self.walk["end"], tp)


class UngatedMLP:
    """Nemotron-H's MLP (``up_proj`` = ffn1, its activation -- relu2 --, ``down_proj`` =
    ffn2; no gate) on local shards, placed as the walk says."""

    def __init__(self, module, walk: dict, tp: Group):
        self.steps, self.end, self.tp = walk["steps"], walk["end"], tp
        self.w1, self.b1 = local_tensor(module.up_proj.weight), local_tensor(module.up_proj.bias)
        self.w2, self.b2 = local_tensor(module.down_proj.weight), local_tensor(module.down_proj.bias)
        self.act = module.act_fn

    def __call__(self, x: torch.Tensor, residual: str) -> torch.Tensor:
        (_, c1, need1, prod1), (_, c2, need2, prod2) = self.steps
        y = linear(repair(x, residual, need1, self.tp), self.w1, self.b1, c1, self.tp)
        y = self.act(repair(y, prod1, need2, self.tp))
        return repair(linear(y, self.w2, self.b2, c2, self.tp), prod2, self.end, self.tp)


class HybridBlock:
    """A Nemotron-H block: its RMSNorm (replicated), then its one mixer -- Mamba-2 (the
    walk's attention branch), attention (``attention``: the fast runtime's, built by the
    caller; no rotary embedding), or the MLP (the walk's mlp branch) -- and the residual
    add. ``experts`` None: no MoE mixer (refused by name)."""

    experts = None

    def __init__(self, layer, kind_walk: dict, tp: Group, i: int, attention=None):
        self.ln = layer.norm
        kind = str(layer.block_type)
        self.attn, self.mlp = attention, None
        if kind == "linear_attention":
            self.attn = Mamba2Mixer(layer.mixer, kind_walk["attention"], tp, i)
        elif kind == "mlp":
            self.mlp = UngatedMLP(layer.mixer, kind_walk["mlp"], tp)
        elif kind != "full_attention" or attention is None:
            raise NotImplementedError(f"a Nemotron-H {kind} block")

    def alloc(self, cache: KVCache, rows: int) -> None:
        if self.attn is not None:
            self.attn.alloc(cache, rows)

    def __call__(self, h, residual, cache, steps, upto, rope_tables, prefill):
        x = norm_of(self.ln, h)
        if self.mlp is not None:
            return h + self.mlp(x, residual)
        return h + self.attn(x, residual, cache, steps, upto, rope_tables, prefill)
