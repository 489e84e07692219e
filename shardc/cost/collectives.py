"""Collective communication times: alpha-beta closed forms, hierarchical across nodes.

Notation: ``S`` bytes of the full (unsharded over the group) tensor; a group of ``n`` ranks,
``g`` per node over ``N`` nodes (n = g * N); ``B_nv`` / ``B_nic`` the achieved NVLink / NIC
bandwidth per GPU per direction (bytes/s); ``a_nv`` / ``a_net`` per-step latencies, ``a0``
the per-collective base latency (all from :class:`shardc.cost.hardware_presets.Hardware`).
All functions return seconds, are numpy-vectorised over any array shape, and give 0 for
``n == 1``.

* all-reduce (ring in node; hierarchical RS in node -> AR across nodes on S/g -> AG in node)::

      a0 + 2(g-1) a_nv + 2(N-1) a_net + 2(g-1)/g * S/B_nv + 2(N-1)/N * (S/g)/B_nic

  With N = 1 this is the ring ``2(n-1)a + 2(n-1)/n * S/B``; with g = 1 the same ring on NICs.
* all-gather, reduce-scatter (inter-node step on S/g, intra-node step on S)::

      a0 + (g-1) a_nv + (N-1) a_net + (g-1)/g * S/B_nv + (N-1)/N * (S/g)/B_nic

* all-to-all, ``S`` = bytes one rank sends in total (its own share included; MoE dispatch:
  tokens x top_k x hidden x bytes). (g-1)/n of it goes over NVLink, (n-g)/n over the NIC,
  concurrently::

      a0 + (n-1) a_peer + (a_net if N > 1 else a_nv)
         + max((g-1)/n * S/B_nv, (n-g)/n * S/B_nic)

  Inside one node this is ``(n-1)/n * S/B_nv``; one rank per node ``(n-1)/n * S/B_nic``.
* send/recv of S bytes between neighbouring pipeline stages:
  ``a0 + a_link + S/B_link`` (NIC if the pp group crosses nodes, else NVLink).

A redistribution from :func:`shardc.ir.contract.redistribution` charges the collective with S
= the full tensor; its all-to-all (S(0) <-> S(1)) moves each rank's shard S/n, so
:func:`redistribution_time` passes ``S / n`` to :func:`all_to_all`.
"""

from __future__ import annotations

import numpy as np

from shardc.cost.hardware_presets import Hardware
from shardc.cost.topology import CommGroup

COLLECTIVE_KINDS = ("none", "all_gather", "reduce_scatter", "all_reduce", "all_to_all")
NO_COLLECTIVE, ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL = range(len(COLLECTIVE_KINDS))


def _parts(group: CommGroup):
    n = group.size.astype(np.float64)
    g = group.per_node.astype(np.float64)
    N = group.nodes.astype(np.float64)
    return n, g, N


def all_reduce(S, group: CommGroup, hw: Hardware):
    n, g, N = _parts(group)
    S = np.asarray(S, dtype=np.float64)
    t = (hw.collective_base_us * 1e-6 + 2 * (g - 1) * hw.nvlink_hop_us * 1e-6
         + 2 * (N - 1) * hw.net_hop_us * 1e-6
         + 2 * (g - 1) / g * S / hw.nvlink_bytes_s
         + 2 * (N - 1) / N * (S / g) / hw.nic_bytes_s)
    return np.where(n > 1, t, 0.0)


def all_gather(S, group: CommGroup, hw: Hardware):
    n, g, N = _parts(group)
    S = np.asarray(S, dtype=np.float64)
    t = (hw.collective_base_us * 1e-6 + (g - 1) * hw.nvlink_hop_us * 1e-6
         + (N - 1) * hw.net_hop_us * 1e-6
         + (g - 1) / g * S / hw.nvlink_bytes_s
         + (N - 1) / N * (S / g) / hw.nic_bytes_s)
    return np.where(n > 1, t, 0.0)


reduce_scatter = all_gather  # same volume and steps, opposite direction


def all_to_all(S_per_rank, group: CommGroup, hw: Hardware):
    n, g, N = _parts(group)
    S = np.asarray(S_per_rank, dtype=np.float64)
    hop = np.where(N > 1, hw.net_hop_us, hw.nvlink_hop_us) * 1e-6
    t = (hw.collective_base_us * 1e-6 + (n - 1) * hw.a2a_peer_us * 1e-6 + hop
         + np.maximum((g - 1) / n * S / hw.nvlink_bytes_s, (n - g) / n * S / hw.nic_bytes_s))
    return np.where(n > 1, t, 0.0)


def send_recv(S, group: CommGroup, hw: Hardware):
    n, g, N = _parts(group)
    S = np.asarray(S, dtype=np.float64)
    cross = N > 1
    t = (hw.collective_base_us * 1e-6
         + np.where(cross, hw.net_hop_us, hw.nvlink_hop_us) * 1e-6
         + S / np.where(cross, hw.nic_bytes_s, hw.nvlink_bytes_s))
    return np.where(n > 1, t, 0.0)


def redistribution_time(kind: str, S_full, group: CommGroup, hw: Hardware):
    """Seconds for the collective ``kind`` (a name from :data:`COLLECTIVE_KINDS`) repairing
    a tensor of ``S_full`` bytes over ``group``."""
    if kind == "none":
        return np.zeros(np.broadcast(S_full, group.size).shape)
    if kind == "all_reduce":
        return all_reduce(S_full, group, hw)
    if kind in ("all_gather", "reduce_scatter"):
        return all_gather(S_full, group, hw)
    if kind == "all_to_all":
        return all_to_all(np.asarray(S_full, dtype=np.float64) / group.size, group, hw)
    raise ValueError(f"unknown collective {kind!r}")
