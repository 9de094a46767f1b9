"""What a sharding plan implies for the optimizer step, hardware-free.

Part of :mod:`matrix_owner_optim.toolbox.simulate`; see its docstring for the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...planning import ADAMW_COST, Role, ShardingPlan, resolve_cost
from ...planning.cost import as_matrix_shape, itemsize


@dataclass(frozen=True)
class MatrixInfo:
    """One matrix as NS sees it: ``(m, n)`` after the ``(out, rest)`` view; FLOPs of one step."""

    fqn: str
    m: int
    n: int
    flops: float
    owner: int

    @property
    def numel(self) -> int:
        return self.m * self.n


@dataclass
class PlanStats:
    """Everything the timing and memory formulas need from one plan (no hardware in here)."""

    world_size: int
    nodes: int
    gpus_per_node: int
    matrices: list[MatrixInfo]
    total_matrix_flops: float
    rank_matrix_flops: list[float]
    rank_matrices: list[int]
    rank_owned_matrix_elems: list[int]
    rank_elementwise_elems_owner: list[float]  # AdamW elements per rank in the owner layout
    elementwise_elems_even: float  # AdamW elements per rank in the stock (even Shard(0)) layout
    # owner routing, in elements (x grad bytes later); phase 1 = slices to owners
    nvlink_send: list[float]
    nvlink_recv: list[float]
    nic_in: list[float]
    nic_out: list[float]
    # memory, bytes
    rank_resident_bytes: list[int]
    total_resident_bytes: int
    total_param_bytes: int
    total_grad_bytes: int
    rank_owned_state_bytes: list[float]
    planner_flops_max: float
    planner_flops_mean: float
    planner_imbalance: dict[str, float] = field(default_factory=dict)

    @property
    def max_rank_matrix_flops(self) -> float:
        return max(self.rank_matrix_flops) if self.rank_matrix_flops else 0.0

    @property
    def flops_imbalance(self) -> float:
        """max/mean of per-rank NS FLOPs under the plan (1.0 = perfect)."""
        mean = self.total_matrix_flops / self.world_size
        return self.max_rank_matrix_flops / mean if mean > 0 else 1.0


def plan_stats(plan: ShardingPlan, nodes: int, gpus_per_node: int) -> PlanStats:
    """Reduce a :class:`ShardingPlan` on ``nodes x gpus_per_node`` ranks to :class:`PlanStats`.

    Rank ``r`` sits on node ``r // gpus_per_node`` (the usual contiguous rank order).
    """
    W = nodes * gpus_per_node
    if plan.world_size != W:
        raise ValueError(f"plan is for world size {plan.world_size}, but {nodes} nodes x {gpus_per_node} GPUs = {W}")
    G = gpus_per_node
    cost = resolve_cost(plan.preconditioner)
    node_of = [r // G for r in range(W)]

    matrices: list[MatrixInfo] = []
    rank_flops = [0.0] * W
    rank_count = [0] * W
    rank_elems = [0] * W
    elementwise_owner = [0.0] * W
    nonmatrix_elems = 0
    rank_resident = [int(x.resident_bytes) for x in plan.loads] or [0] * W
    param_bytes = grad_bytes = 0
    rank_state = [0.0] * W
    for s in plan:
        size = s.numel * itemsize(s.dtype)
        param_bytes += size
        if s.requires_grad:
            grad_bytes += size
        if s.role is Role.MATRIX:
            m, n = as_matrix_shape(s.shape)
            flops = cost.flops(s.shape) if s.requires_grad else 0.0
            owner = int(s.owner)  # type: ignore[arg-type]
            matrices.append(MatrixInfo(s.fqn, m, n, flops, owner))
            if s.requires_grad:
                rank_flops[owner] += flops
                rank_count[owner] += 1
                rank_elems[owner] += s.numel
                rank_state[owner] += cost.state_bytes(s.shape, s.dtype)
            continue
        if not s.requires_grad:
            continue
        nonmatrix_elems += s.numel
        state = ADAMW_COST.state_bytes(s.shape, s.dtype)
        if s.role is Role.TAIL:
            elementwise_owner[int(s.owner)] += s.numel  # type: ignore[arg-type]
            rank_state[int(s.owner)] += state  # type: ignore[arg-type]
        else:  # SHARDED: rows split evenly, every rank updates its rows
            for r in range(W):
                frac = s.local_numel(r) / s.numel if s.numel else 0.0
                elementwise_owner[r] += s.numel * frac
                rank_state[r] += state * frac

    # Owner routing of the stock Shard(0) layout: every rank holds numel/W of each matrix.
    nv_send = [0.0] * W
    nv_recv = [0.0] * W
    nic_in = [0.0] * nodes
    nic_out = [0.0] * nodes
    for mat in matrices:
        o = mat.owner
        slice_elems = mat.numel / W
        same_node_peers = G - 1
        other_node_ranks = W - G
        nv_recv[o] += slice_elems * same_node_peers
        for r in range(node_of[o] * G, node_of[o] * G + G):
            if r != o:
                nv_send[r] += slice_elems
        nic_in[node_of[o]] += slice_elems * other_node_ranks
        for nd in range(nodes):
            if nd != node_of[o]:
                nic_out[nd] += slice_elems * G

    flops_all = [float(x.optimizer_flops) for x in plan.loads]
    return PlanStats(
        world_size=W,
        nodes=nodes,
        gpus_per_node=G,
        matrices=matrices,
        total_matrix_flops=sum(m.flops for m in matrices),
        rank_matrix_flops=rank_flops,
        rank_matrices=rank_count,
        rank_owned_matrix_elems=rank_elems,
        rank_elementwise_elems_owner=elementwise_owner,
        elementwise_elems_even=nonmatrix_elems / W,
        nvlink_send=nv_send,
        nvlink_recv=nv_recv,
        nic_in=nic_in,
        nic_out=nic_out,
        rank_resident_bytes=rank_resident,
        total_resident_bytes=sum(rank_resident),
        total_param_bytes=param_bytes,
        total_grad_bytes=grad_bytes,
        rank_owned_state_bytes=rank_state,
        planner_flops_max=max(flops_all) if flops_all else 0.0,
        planner_flops_mean=sum(flops_all) / len(flops_all) if flops_all else 0.0,
        planner_imbalance=plan.imbalance(),
    )
