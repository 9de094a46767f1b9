"""Collective time formulas (ring, hierarchical, all-to-all, owner routing).

Part of :mod:`matrix_owner_optim.toolbox.simulate`; see its docstring for the model.
"""

from __future__ import annotations

from collections.abc import Sequence

from .hardware import Hardware

FORMULAS: dict[str, str] = {
    "ring_all_gather": "T(n, p) = (p-1) * (alpha + n / (p * beta)); n = gathered bytes; p=1 -> 0",
    "ring_all_reduce": "T(n, p) = 2 (p-1) * (alpha + n / (p * beta)); reduce-scatter + all-gather",
    "hierarchical_all_gather": (
        "T(n; N, G) = (N-1) * (alpha_inter + n / (N * beta_inter_node))  [per-rail ring across "
        "nodes, G rails share the node's NICs] + (G-1) * (alpha_intra + n / (G * beta_intra))  "
        "[ring inside the node]"
    ),
    "hierarchical_all_reduce": "2 x hierarchical_all_gather (reduce-scatter and all-gather phases)",
    "group_all_gather": (
        "a sub-group of p ranks at rank stride s (rank order node-major, G GPUs per node): g = "
        "min(p, G // s) members per node (1 when s >= G) on n = ceil(p / g) nodes, c = G // g such "
        "groups sharing each node's NICs: T = (n-1) (alpha_inter + c bytes / (n beta_inter_node)) "
        "+ (g-1) (alpha_intra + bytes / (g beta_intra)); stride 1 and p = W is "
        "hierarchical_all_gather; reduce-scatter costs the same, all-reduce twice"
    ),
    "replica_all_reduce": (
        "HSDP (replicate R, shard S): the shard ranks' segments n_s all-reduced across R replicas, "
        "all replicate groups at once: T = 2 [(n-1) (alpha_inter + max_node sum_{s on node} n_s / "
        "(n beta_inter_node)) + (g-1) (alpha_intra + max_s n_s / (g beta_intra))], g and n as "
        "group_all_gather with stride S; the shard ranks on one node are blocks of min(S, G)"
    ),
    "all_to_all": (
        "uniform: T = (p-1) * alpha + bytes_per_rank / beta. Owner routing (non-uniform, from the "
        "plan): T_phase = max(max_rank max(nvlink_send, nvlink_recv) / beta_intra, "
        "max_node max(nic_in, nic_out) / beta_inter_node) + (G-1) alpha_intra + (W-G) alpha_inter; "
        "two phases (slices to owners, updates back)"
    ),
    "compute": ("T = NS FLOPs / (peak * efficiency) + kernels * launch + AdamW bytes / HBM bandwidth"),
    "step": ("serial: T_step = max over ranks of (communication + compute); collectives do not overlap NS"),
}


def ring_all_gather_time(n_bytes: float, p: int, bandwidth: float, latency: float) -> float:
    """Ring all-gather of ``n_bytes`` in total (each rank holds ``n/p``) over ``p`` ranks.

    ``(p-1)`` steps, each moving one ``n/p`` chunk per rank over a link of ``bandwidth``
    bytes/s and paying ``latency`` seconds. One rank moves nothing and costs nothing.
    """
    if p < 1:
        raise ValueError(f"ring_all_gather_time: p must be >= 1, got {p}")
    if p == 1 or n_bytes <= 0 and latency <= 0:
        return 0.0
    return (p - 1) * (latency + n_bytes / (p * bandwidth))


def ring_all_reduce_time(n_bytes: float, p: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of an ``n_bytes`` buffer: a reduce-scatter then an all-gather."""
    return 2.0 * ring_all_gather_time(n_bytes, p, bandwidth, latency)


def hierarchical_all_gather_time(n_bytes: float, nodes: int, gpus_per_node: int, hw: Hardware) -> float:
    """All-gather of ``n_bytes`` over ``nodes x gpus_per_node`` ranks, two levels.

    Inter-node phase: each of the G rails runs a ring across the N nodes; the rails share the
    node's NICs, so the phase costs ``(N-1)(alpha_inter + n/(N beta_inter_node))``: the node
    receives ``n (N-1)/N`` bytes, the lower bound for any all-gather. Intra-node phase: a ring
    over the G GPUs of a node with ``n/G`` chunks. With one node this is the flat NVLink ring.
    """
    inter = ring_all_gather_time(n_bytes, nodes, hw.beta_inter, hw.alpha_inter)
    intra = ring_all_gather_time(n_bytes, gpus_per_node, hw.beta_intra, hw.alpha_intra)
    return inter + intra


def hierarchical_all_reduce_time(n_bytes: float, nodes: int, gpus_per_node: int, hw: Hardware) -> float:
    """Two-level all-reduce: twice the two-level all-gather (reduce-scatter + all-gather)."""
    return 2.0 * hierarchical_all_gather_time(n_bytes, nodes, gpus_per_node, hw)


def all_to_all_time(bytes_per_rank: float, p: int, bandwidth: float, latency: float) -> float:
    """Uniform all-to-all where each rank sends ``bytes_per_rank`` in total to the others.

    ``(p-1) alpha + bytes / beta``: one message per peer, bandwidth limited by the rank's
    share of the bisection (``bandwidth``). One rank costs nothing.
    """
    if p < 1:
        raise ValueError(f"all_to_all_time: p must be >= 1, got {p}")
    if p == 1:
        return 0.0
    return (p - 1) * latency + bytes_per_rank / bandwidth


def owner_routing_phase_time(
    nvlink_send: Sequence[float],
    nvlink_recv: Sequence[float],
    nic_in: Sequence[float],
    nic_out: Sequence[float],
    gpus_per_node: int,
    hw: Hardware,
) -> float:
    """One non-uniform all-to-all phase of owner routing (bytes already per rank / per node).

    NVLink and the NICs are different links and run concurrently, so the phase lasts as long
    as the busiest of them, plus one message latency per peer.
    """
    W = len(nvlink_send)
    if W <= 1:
        return 0.0
    G = gpus_per_node
    t_intra = max(max(s, r) for s, r in zip(nvlink_send, nvlink_recv, strict=True)) / hw.beta_intra
    t_inter = max((max(i, o) for i, o in zip(nic_in, nic_out, strict=True)), default=0.0) / hw.beta_inter
    latency = (min(G, W) - 1) * hw.alpha_intra + (W - min(G, W)) * hw.alpha_inter
    return max(t_intra, t_inter) + latency


def group_all_gather_time(n_bytes: float, size: int, stride: int, gpus_per_node: int, hw: Hardware) -> float:
    """All-gather of ``n_bytes`` over a sub-group of ``size`` ranks ``stride`` apart.

    A ``(replicate, shard)`` mesh laid out row-major has shard groups of ``shard`` consecutive
    ranks (stride 1) and replicate groups of ``replicate`` ranks ``shard`` apart; every group of
    a dim runs its collective at the same time. ``g`` members of the group share a node
    (``min(size, G // stride)``, or 1 when ``stride >= G``); they ring over NVLink, and the
    group's ``n`` nodes ring per rail over the NICs, which ``G // g`` concurrent groups share.
    With ``stride = 1`` and ``size = W`` this is :func:`hierarchical_all_gather_time`.
    """
    if size < 1 or stride < 1 or gpus_per_node < 1:
        raise ValueError(
            f"group_all_gather_time: size, stride and gpus_per_node must be >= 1, got {size}, {stride}, {gpus_per_node}"
        )
    G = gpus_per_node
    local = 1 if stride >= G else max(1, min(size, G // stride))
    nodes = -(-size // local)
    sharing = max(1, G // local)
    inter = ring_all_gather_time(sharing * n_bytes, nodes, hw.beta_inter, hw.alpha_inter)
    intra = ring_all_gather_time(n_bytes, local, hw.beta_intra, hw.alpha_intra)
    return inter + intra


def replica_all_reduce_time(segment_bytes: Sequence[float], replicate: int, gpus_per_node: int, hw: Hardware) -> float:
    """The HSDP all-reduce across ``replicate`` replicas of every shard rank's segment at once.

    ``segment_bytes[s]`` is what shard rank ``s`` all-reduces (the owner layout: the gradients of
    the tensors it owns in this unit, often zero; stock FSDP2: ``1/S`` of the unit). The node's
    NICs carry the segments of all the shard ranks it hosts (blocks of ``min(S, G)``
    consecutive ones), so the busiest block, not ``G x`` the largest segment, sets the
    inter-node time. Uniform segments give ``2 x group_all_gather_time(n, R, S, G)``.
    """
    S, G = len(segment_bytes), gpus_per_node
    if replicate <= 1 or S == 0:
        return 0.0
    local = 1 if S >= G else max(1, min(replicate, G // S))
    nodes = -(-replicate // local)
    block = min(S, G)
    node_bytes = max(sum(segment_bytes[i : i + block]) for i in range(0, S, block))
    # the ring formula divides by the ranks per ring; here the node's aggregate crosses its NICs
    inter = ring_all_gather_time(node_bytes, nodes, hw.beta_inter, hw.alpha_inter)
    intra = ring_all_gather_time(max(segment_bytes), local, hw.beta_intra, hw.alpha_intra)
    return 2.0 * (inter + intra)
