"""Trace-time leaves for the kernels of layers whose state does not grow with context.

transformers' linear-attention (Gated DeltaNet: Qwen3-Next) and state-space (Mamba: Jamba;
Mamba-2: Nemotron-H) layers call module-level kernel functions -- ``causal_conv1d_fn``,
``torch_chunk_gated_delta_rule``, ``mamba_selective_scan``, ``mamba2_chunk_scan`` -- whose torch fallbacks loop over chunks or tokens (the pattern a
serving engine replaces with one CUDA kernel each). While a model is traced
(:func:`recurrent_kernels`), those module globals are swapped for four ``torch.library``
custom ops, so each kernel is ONE node of the exported graph, whatever the sequence length:

* ``shardc::causal_conv1d(x [B, C, S], weight [C, K], bias?, activation)`` -> ``[B, C, S]``
  (op kind ``causal_conv``: the depthwise causal convolution; it keeps the last ``K - 1``
  inputs per channel as its state);
* ``shardc::gated_delta_rule(q [B, S, Hk, Dk], k, v [B, S, Hv, Dv], g, beta, l2norm)`` ->
  ``[B, S, Hv, Dv]`` (op kind ``recurrent_scan``; state ``Hv x Dk x Dv`` per sequence);
* ``shardc::selective_scan(u [B, D, S], delta, A [D, N], B, C, D?, z?, delta_bias?,
  softplus)`` -> ``[B, D, S]`` (op kind ``recurrent_scan``; state ``D x N`` per sequence);
* ``shardc::ssd_scan(x [B, S, H, P], dt [B, S, H], A [H], B [B, S, G, N], C, D?, dt_bias?,
  chunk_size, softplus, dt_limit)`` -> ``[B, S, H, P]`` (Mamba-2's chunked state-space
  duality scan, ``mamba2_chunk_scan``: Nemotron-H; op kind ``recurrent_scan``; state
  ``H x P x N`` per sequence).

The projections around them (in/out projections, Mamba's ``x_proj`` / ``dt_proj``, norms,
gates) stay the model's own ops. The parameters the kernels read (conv weight, ``D``,
``dt_proj.bias``) are their inputs, so the frontend attaches them to these nodes. Their eager
implementations are transformers' own torch fallbacks (kept when the globals are swapped);
a trace only runs the shape functions. The module globals are restored on exit.
"""

from __future__ import annotations

import contextlib
import sys

import torch

# transformers' function name -> which leaf replaces it
_PATCHED = {
    "causal_conv1d_fn": "conv",
    "torch_chunk_gated_delta_rule": "delta",
    "mamba_selective_scan": "scan",
    "mamba2_chunk_scan": "ssd",
}
TRACED_SCANS = tuple(fn for fn, leaf in _PATCHED.items() if leaf != "conv")
_ORIGINAL: dict[str, object] = {}  # leaf -> transformers' torch function (eager path)


@torch.library.custom_op("shardc::causal_conv1d", mutates_args=())
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  activation: str) -> torch.Tensor:
    return _ORIGINAL["conv"](x, weight, bias, activation=activation or None)


@causal_conv1d.register_fake
def _(x, weight, bias, activation):
    return torch.empty_like(x)


@torch.library.custom_op("shardc::gated_delta_rule", mutates_args=())
def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, qk_l2norm: bool) -> torch.Tensor:
    return _ORIGINAL["delta"](q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=qk_l2norm)[0]


@gated_delta_rule.register_fake
def _(q, k, v, g, beta, qk_l2norm):
    return torch.empty_like(v)


@torch.library.custom_op("shardc::selective_scan", mutates_args=())
def selective_scan(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None,
                   delta_bias: torch.Tensor | None, delta_softplus: bool) -> torch.Tensor:
    return _ORIGINAL["scan"](u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias,
                             delta_softplus=delta_softplus)


@selective_scan.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, delta_softplus):
    return torch.empty_like(u)


@torch.library.custom_op("shardc::ssd_scan", mutates_args=())
def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: torch.Tensor | None, dt_bias: torch.Tensor | None,
             chunk_size: int, dt_softplus: bool, dt_limit: list[float]) -> torch.Tensor:
    return _ORIGINAL["ssd"](x, dt, A, B, C, chunk_size=chunk_size, D=D, dt_bias=dt_bias,
                            dt_softplus=dt_softplus, dt_limit=tuple(dt_limit))


@ssd_scan.register_fake
def _(x, dt, A, B, C, D, dt_bias, chunk_size, dt_softplus, dt_limit):
    return torch.empty_like(x)


def _conv(hidden_states, weight, bias=None, activation=None, **_):
    return causal_conv1d(hidden_states, weight, bias, activation or "")


def _delta(query, key, value, g, beta, chunk_size=64, initial_state=None,
           output_final_state=False, use_qk_l2norm_in_kernel=False, **_):
    if initial_state is not None or output_final_state:
        raise NotImplementedError("shardc traces without a cache")
    return gated_delta_rule(query, key, value, g, beta, bool(use_qk_l2norm_in_kernel)), None


def _scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
          return_last_state=False, **_):
    if return_last_state:
        raise NotImplementedError("shardc traces without a cache")
    return selective_scan(hidden_states, dt, A, B, C, D, z, delta_bias, bool(delta_softplus))


def _ssd(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
         dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, z=None,
         **_):
    if initial_states is not None or return_final_states or z is not None:
        raise NotImplementedError("shardc traces without a cache (and Mamba-2 gates outside)")
    return ssd_scan(hidden_states, dt, A, B, C, D, dt_bias, int(chunk_size), bool(dt_softplus),
                    [float(v) for v in dt_limit])


_WRAPPERS = {"conv": _conv, "delta": _delta, "scan": _scan, "ssd": _ssd}


@contextlib.contextmanager
def recurrent_kernels(model: torch.nn.Module):
    """While tracing ``model``: the recurrent kernel functions of the transformers modules
    its layers come from are the custom ops above (module docstring); restored on exit."""
    saved = []
    before = dict(_ORIGINAL)
    modules = {type(m).__module__ for m in model.modules()}
    for name in sorted(modules):
        mod = sys.modules.get(name)
        if mod is None or not name.startswith("transformers."):
            continue
        for fn, leaf in _PATCHED.items():
            original = getattr(mod, fn, None)
            if original is None:
                continue
            _ORIGINAL[leaf] = original  # this model's own torch function (eager path)
            saved.append((mod, fn, original))
            setattr(mod, fn, _WRAPPERS[leaf])
    try:
        yield
    finally:
        for mod, fn, original in saved:
            setattr(mod, fn, original)
        _ORIGINAL.clear()
        _ORIGINAL.update(before)
