"""The agent's observation (the elite history) and its policy network.

Observation: the ``T`` best feasible strategies seen so far, sorted best first, one row
each. A row is the action's one-hot encoding (every component one-hot over its candidate
values, concatenated: ``sum(nvec)`` features), plus two features: the row's throughput
divided by the best throughput seen (``value / best``, in [0, 1]) and a presence flag
(0 for an empty row while fewer than ``T`` feasible strategies are known). One-hot rather
than normalised integers because every component is categorical (a tp index 3 is not "more"
than 2 in any way the network should assume).

Network (paper section "Agent"): linear embedding -> one Transformer encoder block
(d = 256, 4 heads, feed-forward 512, dropout 0 so sampling and training see the same
function) -> mean pool over the T rows -> MLP (256, tanh) -> one categorical head per action
component (a single linear layer whose output is split into the per-component logit
slices). Illegal values are masked with the conditional masks of
:class:`~shardc.search.legal.LegalSampler` (ep given tp, pp given tp and ep, op choices
given tp).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from shardc.search.legal import LegalSampler

D_MODEL = 256
NEG = -1e9  # logit of a masked value


class EliteHistory:
    """The ``T`` best distinct feasible actions (and their tok/s/GPU), best first."""

    def __init__(self, n_components: int, size: int = 3):
        self.size = size
        self.actions = np.zeros((0, n_components), dtype=np.int64)
        self.values = np.zeros(0, dtype=np.float64)

    def add(self, actions: np.ndarray, values: np.ndarray, feasible: np.ndarray) -> None:
        """Insert the feasible rows that beat the worst member (or fill an empty slot)."""
        a = np.atleast_2d(actions)[feasible]
        v = np.asarray(values)[feasible]
        if a.shape[0] == 0:
            return
        allv = np.concatenate([self.values, v])
        alla = np.concatenate([self.actions, a])
        order = np.argsort(-allv, kind="stable")
        keep_a, keep_v = [], []
        for i in order:
            if any(np.array_equal(alla[i], k) for k in keep_a):
                continue
            keep_a.append(alla[i])
            keep_v.append(allv[i])
            if len(keep_a) == self.size:
                break
        self.actions = np.array(keep_a, dtype=np.int64)
        self.values = np.array(keep_v, dtype=np.float64)

    def observation(self, sampler: LegalSampler) -> np.ndarray:
        """[T, sum(nvec) + 2] float32 (see the module docstring)."""
        width = int(sampler.offsets[-1])
        obs = np.zeros((self.size, width + 2), dtype=np.float32)
        best = float(self.values[0]) if self.values.size else 1.0
        for r, (a, v) in enumerate(zip(self.actions, self.values)):
            obs[r, sampler.offsets[:-1] + a] = 1.0
            obs[r, width] = v / best if best > 0 else 0.0
            obs[r, width + 1] = 1.0
        return obs


class ElitePolicy(nn.Module):
    """Elite history [N, T, F] -> concatenated logits [N, sum(nvec)]. No value head: the
    advantage baseline is the batch mean (see :mod:`shardc.search.rl`)."""

    def __init__(self, in_features: int, n_logits: int, d_model: int = D_MODEL,
                 n_heads: int = 4, d_ff: int = 512):
        super().__init__()
        self.embed = nn.Linear(in_features, d_model)
        self.encoder = nn.TransformerEncoderLayer(d_model, n_heads, d_ff, dropout=0.0,
                                                  batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_model), nn.Tanh())
        self.logits = nn.Linear(d_model, n_logits)
        nn.init.normal_(self.logits.weight, std=0.01)  # start near uniform over legal values
        nn.init.zeros_(self.logits.bias)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(obs)).mean(dim=1)
        return self.logits(self.mlp(h))


def masked_log_probs(logits: torch.Tensor, masks: torch.Tensor, actions: torch.Tensor,
                     offsets: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample log-probability of ``actions`` [B, A] under the per-component masked
    categoricals; also the mean per-sample entropy (nats) and each head's largest
    probability averaged over the batch [A].

    ``logits`` [sum(nvec)] (one shared observation) or [B, sum(nvec)]; ``masks`` [B, sum]."""
    b = actions.shape[0]
    lg = logits.expand(b, -1).masked_fill(~masks, NEG)
    logp = torch.zeros(b, dtype=lg.dtype)
    ent = torch.zeros(b, dtype=lg.dtype)
    maxp = []
    for j in range(actions.shape[1]):
        sl = lg[:, offsets[j]:offsets[j + 1]]
        lsm = torch.log_softmax(sl, dim=1)
        p = lsm.exp()
        logp = logp + lsm.gather(1, actions[:, j:j + 1]).squeeze(1)
        ent = ent - (p * lsm.clamp_min(NEG / 1e6)).sum(dim=1)
        maxp.append(p.max(dim=1).values.mean())
    return logp, ent.mean(), torch.stack(maxp)


def sample_masked(logits: np.ndarray, sampler: LegalSampler, n: int, rng: np.random.Generator
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Draw ``n`` legal actions from the masked heads (components in order, each mask
    conditioned on the values already drawn). Returns (actions [n, A], masks [n, sum])."""
    a = np.zeros((n, sampler.n_comp), dtype=np.int64)
    masks = []
    for j in range(sampler.n_comp):
        m = sampler.component_mask(a, j)
        lg = np.where(m, logits[sampler.offsets[j]:sampler.offsets[j + 1]][None, :], -np.inf)
        lg = lg - lg.max(axis=1, keepdims=True)
        p = np.exp(lg)
        cum = np.cumsum(p, axis=1)
        u = rng.random(n) * cum[:, -1]
        idx = (cum <= u[:, None]).sum(axis=1)
        # guard against landing on a masked value through rounding at the top end
        idx = np.minimum(idx, m.shape[1] - 1)
        bad = ~m[np.arange(n), idx]
        if bad.any():
            idx[bad] = np.argmax(np.where(m[bad], p[bad], -1.0), axis=1)
        a[:, j] = idx
        masks.append(m)
    return a, np.concatenate(masks, axis=1)
