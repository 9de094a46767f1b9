"""Which (replicate, shard) mesh keeps every rank of a W-rank job balanced: :func:`plan_mesh`.

Once the ranks of the shard group outnumber what whole matrices can fill evenly, owners fan out
and ranks sit idle (the 32-layer d=1024 GPT: resident bytes max/mean 1.14 at W=64, 9.2 at
W=1024); HSDP's 2D mesh keeps the owner layout inside the shard dim. The advice is the fewest
replicas (the largest shard size dividing W: every replica holds a whole copy of the state)
whose plan keeps bytes and FLOPs within ``max_imbalance`` and fits ``memory_per_rank``. Pure:
plans and arithmetic; projected times live in the toolbox (``toolbox.simulate.project_mesh``,
``matrix-owner-optim plan --advise``), which the library never imports. DESIGN.md, "Mesh advice".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .catalog import CostSpec, resolve_cost
from .metadata import ShardingPlan, recorded_unit_prefixes
from .planner import plan_tensors
from .replicas import assign_step_replicas
from .roles import TensorSpec, specs_from_module

__all__ = ["MESH_DIM_NAMES", "MeshAdvice", "MeshCandidate", "plan_mesh", "divisors_descending"]

MESH_DIM_NAMES = ("replicate", "shard")


@dataclass(frozen=True)
class MeshCandidate:
    """One shard size the search evaluated, and why it was taken or not."""

    shard: int
    replicate: int
    bytes_max_over_mean: float
    flops_max_over_mean: float
    max_resident_bytes: int
    balanced: bool  # both ratios <= max_imbalance
    fits_memory: bool  # max_resident_bytes <= memory_per_rank (True when no budget was given)

    @property
    def accepted(self) -> bool:
        return self.balanced and self.fits_memory

    def to_json(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "replicate": self.replicate,
            "bytes_max_over_mean": self.bytes_max_over_mean,
            "flops_max_over_mean": self.flops_max_over_mean,
            "max_resident_bytes": self.max_resident_bytes,
            "balanced": self.balanced,
            "fits_memory": self.fits_memory,
        }


@dataclass(frozen=True)
class MeshAdvice:
    """The mesh :func:`plan_mesh` advises for ``world_size`` ranks.

    Attributes:
        world_size: ranks of the job; ``replicate * shard == world_size``.
        replicate: size of mesh dim 0 (model replicas, gradients all-reduced across them).
        shard: size of mesh dim 1 (the owner layout: every matrix whole on one of these ranks).
        preconditioner: the cost model the plan balanced.
        bytes_max_over_mean, flops_max_over_mean: the plan's imbalance at ``shard`` ranks
            (resident bytes, optimizer FLOPs; 1.0 is perfect).
        resident_bytes_per_rank: parameter + gradient + optimizer state of each rank between
            steps, as the planner counts them: per global rank ``r * shard + s`` (the plan's
            ``replica_loads``: a matrix's state on its one global owner, not on every replica's
            holder), or per shard rank when ``replicate == 1``. Activations and the transiently
            gathered unit buffers are not included.
        max_resident_bytes, mean_resident_bytes: their maximum and mean.
        max_imbalance, memory_per_rank: the limits the advice was asked to meet.
        candidates: every shard size evaluated, largest first; the last one is the advice.
        plan: the :class:`ShardingPlan` at ``shard`` ranks with every matrix's step replica
            (what ``fully_shard`` on the advised mesh computes); its ``replica_loads`` are the
            loads of all W ranks once each matrix steps on its one global owner.
    """

    world_size: int
    replicate: int
    shard: int
    preconditioner: str
    bytes_max_over_mean: float
    flops_max_over_mean: float
    resident_bytes_per_rank: tuple[int, ...]
    max_imbalance: float
    memory_per_rank: int | None
    candidates: tuple[MeshCandidate, ...]
    plan: ShardingPlan = field(compare=False, repr=False)

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """``(replicate, shard)``, the shape to hand ``init_device_mesh``."""
        return (self.replicate, self.shard)

    @property
    def mesh_dim_names(self) -> tuple[str, str]:
        return MESH_DIM_NAMES

    @property
    def max_resident_bytes(self) -> int:
        return max(self.resident_bytes_per_rank)

    @property
    def mean_resident_bytes(self) -> float:
        return sum(self.resident_bytes_per_rank) / len(self.resident_bytes_per_rank)

    def init_device_mesh(self, device_type: str) -> Any:
        """The advised 2D ``DeviceMesh``: ``init_device_mesh(device_type, (replicate, shard),
        mesh_dim_names=("replicate", "shard"))``; pass it as ``fully_shard(module, mesh=...)``.

        Needs an initialized default process group of ``world_size`` ranks (torchrun, or
        ``init_process_group``). Ranks are laid out row-major: rank ``r * shard + s`` is shard
        rank ``s`` of replica ``r``, so a shard dim of at most a node's GPUs stays inside the node.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() != self.world_size:
            raise ValueError(
                f"this advice is for {self.world_size} ranks but the process group has "
                f"{dist.get_world_size()}; call plan_mesh(model, {dist.get_world_size()}) instead"
            )
        return init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)

    def to_json(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "replicate": self.replicate,
            "shard": self.shard,
            "mesh_shape": list(self.mesh_shape),
            "mesh_dim_names": list(MESH_DIM_NAMES),
            "preconditioner": self.preconditioner,
            "bytes_max_over_mean": self.bytes_max_over_mean,
            "flops_max_over_mean": self.flops_max_over_mean,
            "max_resident_bytes": self.max_resident_bytes,
            "mean_resident_bytes": self.mean_resident_bytes,
            "resident_bytes_per_rank": list(self.resident_bytes_per_rank),
            "max_imbalance": self.max_imbalance,
            "memory_per_rank": self.memory_per_rank,
            "plan_digest": self.plan.digest(),
            "candidates": [c.to_json() for c in self.candidates],
        }


def divisors_descending(n: int) -> list[int]:
    """Every positive divisor of ``n``, largest first (O(sqrt n))."""
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return sorted(small + large, reverse=True)


def _check_args(world_size: Any, max_imbalance: Any, memory_per_rank: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"plan_mesh: world_size must be a positive int, got {world_size!r}")
    if (
        isinstance(max_imbalance, bool)
        or not isinstance(max_imbalance, (int, float))
        or not math.isfinite(max_imbalance)
        or max_imbalance < 1.0
    ):
        raise ValueError(
            f"plan_mesh: max_imbalance is a max/mean ratio and must be a finite number >= 1.0 "
            f"(1.1 allows the busiest rank 10% above the mean), got {max_imbalance!r}"
        )
    if memory_per_rank is not None and (
        isinstance(memory_per_rank, bool)
        or not isinstance(memory_per_rank, (int, float))
        or not math.isfinite(memory_per_rank)
        or memory_per_rank <= 0
    ):
        raise ValueError(
            f"plan_mesh: memory_per_rank is a byte count per rank and must be positive "
            f"(or None for no limit), got {memory_per_rank!r}"
        )


def _specs(model: Any, roles: Mapping[str, str] | None, unit_prefixes: Sequence[str] | None) -> list[TensorSpec]:
    if isinstance(model, nn.Module):
        if unit_prefixes is None:
            unit_prefixes = recorded_unit_prefixes(model)
        return specs_from_module(model, roles=roles, unit_prefixes=unit_prefixes)
    if isinstance(model, (str, bytes)) or not isinstance(model, Sequence):
        raise TypeError(f"plan_mesh: model must be an nn.Module or a list of TensorSpec, got {type(model).__name__}")
    specs = list(model)
    bad = next((s for s in specs if not isinstance(s, TensorSpec)), None)
    if bad is not None:
        raise TypeError(
            f"plan_mesh: model is a list but holds a {type(bad).__name__}; a list must hold only "
            "TensorSpec (planning.specs_from_module builds them from a module)"
        )
    for name, value in (("roles", roles), ("unit_prefixes", unit_prefixes)):
        if value is not None:
            raise ValueError(
                f"plan_mesh: {name} applies to a module; TensorSpecs already carry their role and "
                f"unit, so pass {name}=None (or pass the module instead)"
            )
    return specs


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


def _nothing_fits(
    world_size: int, cands: list[MeshCandidate], max_imbalance: float, memory_per_rank: float
) -> ValueError:
    """The error when every shard size fails: what to change, with the numbers to change it to."""
    balanced = [c for c in cands if c.balanced]
    smallest = min(cands, key=lambda c: (c.max_resident_bytes, -c.shard))
    need_imb = max(smallest.bytes_max_over_mean, smallest.flops_max_over_mean)
    parts = [
        f"plan_mesh: no (replicate, shard) mesh of {world_size} ranks keeps max/mean <= "
        f"{max_imbalance:g} within memory_per_rank={int(memory_per_rank)} ({_gib(memory_per_rank)})."
    ]
    if balanced:
        best = min(balanced, key=lambda c: c.max_resident_bytes)
        parts.append(
            f" The balanced shard sizes need at least {best.max_resident_bytes} bytes "
            f"({_gib(best.max_resident_bytes)}) per rank (shard={best.shard}): raise memory_per_rank "
            f"to that,"
        )
    parts.append(
        f" or raise max_imbalance to {need_imb:.4g} to take shard={smallest.shard} "
        f"({smallest.max_resident_bytes} bytes, {_gib(smallest.max_resident_bytes)} per rank)"
    )
    if smallest.max_resident_bytes > memory_per_rank:
        parts.append(" -- which does not fit either")
    parts.append(
        ", or run on more ranks, or shrink what each rank holds (a lighter preconditioner, "
        "frozen parameters, smaller dtypes)."
    )
    return ValueError("".join(parts))


def plan_mesh(
    model: nn.Module | Sequence[TensorSpec],
    world_size: int,
    *,
    unit_prefixes: Sequence[str] | None = None,
    roles: Mapping[str, str] | None = None,
    preconditioner: CostSpec | None = None,
    max_imbalance: float = 1.1,
    memory_per_rank: int | float | None = None,
) -> MeshAdvice:
    """The ``(replicate, shard)`` mesh for ``world_size`` ranks with the fewest replicas whose plan
    keeps resident bytes and optimizer FLOPs max/mean <= ``max_imbalance`` and, when
    ``memory_per_rank`` is given, every rank's resident bytes within it.

    Shard sizes are the divisors of ``world_size``, tried largest first; the first that meets
    both limits is the advice (so twice the advised shard size, when it divides W, does not).
    Each try is one :func:`~.planner.plan_tensors` call on specs read once; at W=4096 the
    32-layer GPT needs a handful of plans and well under a second.

    Args:
        model: a module (meta tensors are fine) or the list of :class:`TensorSpec` that
            ``plan_tensors`` takes.
        world_size: ranks of the job (any positive int; a prime W has only shard W or 1).
        unit_prefixes, roles, preconditioner: as :func:`~.planner.plan_model` (module only for
            the first two).
        max_imbalance: the largest max/mean allowed for both resources, >= 1.0.
        memory_per_rank: bytes each rank may spend on parameters, gradients and optimizer
            state (activations and gathered buffers excluded), or None for no limit.

    Raises:
        ValueError: bad arguments, or no shard size meets both limits (the message says what to
            raise, and to what).
        TypeError: ``model`` is neither a module nor a list of TensorSpec.
    """
    _check_args(world_size, max_imbalance, memory_per_rank)
    cost = resolve_cost(preconditioner)  # the one resolution, at this edge
    specs = _specs(model, roles, unit_prefixes)
    cands: list[MeshCandidate] = []
    for shard in divisors_descending(world_size):
        plan = plan_tensors(specs, shard, cost=cost)
        imb = plan.imbalance()
        # memory per global rank with one global owner per matrix (planning/replicas.py): a
        # matrix's optimizer state on one replica's holder only, not on every replica's
        replicate = world_size // shard
        if replicate > 1:
            plan = assign_step_replicas(plan, specs, replicate, cost=cost)
            resident = tuple(int(x.resident_bytes) for x in plan.replica_loads)
        else:
            resident = tuple(int(x.resident_bytes) for x in plan.loads)
        cand = MeshCandidate(
            shard=shard,
            replicate=world_size // shard,
            bytes_max_over_mean=imb["bytes_max_over_mean"],
            flops_max_over_mean=imb["flops_max_over_mean"],
            max_resident_bytes=max(resident),
            balanced=imb["bytes_max_over_mean"] <= max_imbalance and imb["flops_max_over_mean"] <= max_imbalance,
            fits_memory=memory_per_rank is None or max(resident) <= memory_per_rank,
        )
        cands.append(cand)
        if cand.accepted:
            return MeshAdvice(
                world_size=world_size,
                replicate=cand.replicate,
                shard=shard,
                preconditioner=plan.preconditioner,
                bytes_max_over_mean=cand.bytes_max_over_mean,
                flops_max_over_mean=cand.flops_max_over_mean,
                resident_bytes_per_rank=resident,
                max_imbalance=float(max_imbalance),
                memory_per_rank=None if memory_per_rank is None else int(memory_per_rank),
                candidates=tuple(cands),
                plan=plan,
            )
    # shard=1 is always balanced (one rank holds everything), so only memory can fail everywhere
    assert memory_per_rank is not None
    raise _nothing_fits(world_size, cands, float(max_imbalance), memory_per_rank)
