"""MatrixShard and ShardingPlan: the metadata contract between sharding and optimizer.

The sharding runtime reads a :class:`MatrixShard` to know where a parameter lives (its owner,
or which rank holds which rows) and which unit gathers it (the unit lays out its segments from
these records: ``sharding/collectives.py``'s ``SegmentLayout``); the optimizer reads the same
record to know whether this rank updates it and its role (the role decides which optimizer
steps it). Nothing here touches a process group, so plans can be built and inspected for any
world size in one process.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import torch

from ..tensors import is_dtensor, itemsize
from .catalog import DEFAULT_COST

__all__ = [
    "chunk_row_range",
    "chunk_row_sizes",
    "Role",
    "MatrixShard",
    "RankLoad",
    "ShardingPlan",
    "parse_role",
    "record_unit_prefixes",
    "recorded_unit_prefixes",
]


class Role(str, enum.Enum):
    """What kind of optimizer update a parameter receives.

    ``matrix``: a whole 2D matrix on one owner, updated by the matrix optimizer.
    ``tail``: small tensors (biases, norms, scalars), packed on an owner, updated by AdamW.
    ``rows``: large coordinate-wise tensors (embeddings, LM heads), split evenly by rows
    across ranks as FSDP2 does; every rank updates its own rows with AdamW.
    """

    MATRIX = "matrix"
    TAIL = "tail"
    ROWS = "rows"

    def __str__(self) -> str:  # so f-strings and JSON show "matrix", not "Role.MATRIX"
        return self.value


def parse_role(value: str | Role, *, where: str) -> Role:
    """Turn a user-given role name into a :class:`Role`, naming ``where`` it came from on error."""
    if isinstance(value, Role):
        return value
    try:
        return Role(str(value).lower())
    except ValueError:
        valid = ", ".join(repr(r.value) for r in Role)
        raise ValueError(f"unknown role {value!r} for {where}; use one of {valid}") from None


def chunk_row_range(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of ``rank`` when ``rows`` are split as ``torch.chunk`` splits them
    (FSDP2's ``Shard(0)``): ``ceil(rows / W)`` per rank, trailing ranks short or empty."""
    per = -(-rows // world_size) if rows else 0
    start = min(rows, per * rank)
    return start, min(rows, start + per)


def chunk_row_sizes(rows: int, world_size: int) -> list[int]:
    """Rows of every rank under :func:`chunk_row_range`."""
    return [stop - start for start, stop in (chunk_row_range(rows, world_size, r) for r in range(world_size))]


@dataclass(frozen=True)
class MatrixShard:
    """Where one parameter lives under an owner-shaped plan.

    Attributes:
        fqn: the parameter's fully qualified name (the first name when tied).
        shape: global (unsharded) shape.
        dtype: parameter dtype.
        role: :class:`Role`.
        owner: the rank that holds the tensor whole and updates it; ``None`` for ``rows``.
        unit: index of the ``fully_shard`` unit (0 when the model has one unit).
        aliases: other fqns that name the same tensor (tied parameters).
        requires_grad: frozen parameters are placed but carry no optimizer state.
        world_size: the data-parallel size the plan was made for (the shard dim under HSDP).
        step_replica: under HSDP, the replica whose holder of this matrix keeps its optimizer
            state and steps it (its *global owner* is that replica's ``owner``); the other
            replicas' holders receive the updated matrix. None: every holder steps (1D meshes,
            tail and ``rows`` tensors, frozen matrices).
        group_role: the role the model gives the tensor where the layout holds it as another
            (a tensor-parallel ``rows`` tensor: its TP slice held whole by one dp owner, so
            ``role`` is ``tail``); the optimizer groups it by this role, so its param groups,
            and the state dicts they key, are the same on every layout. None: ``role``.
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    role: Role
    owner: int | None
    unit: int = 0
    aliases: tuple[str, ...] = ()
    requires_grad: bool = True
    world_size: int = 1
    row_owners: tuple[tuple[int, int, int], ...] = ()  # a split stack: (start, stop, rank) per rank
    step_replica: int | None = None  # HSDP: the replica that steps it (see the docstring)
    group_role: Role | None = None  # the model's role where the layout holds it as another

    @property
    def routed_role(self) -> Role:
        """The role the optimizer groups it by (``group_role`` where set, else ``role``)."""
        return self.group_role or self.role

    @property
    def is_split(self) -> bool:
        """A stack of matrices held as whole experts by several owners (rows per rank)."""
        return bool(self.row_owners)

    @property
    def holds_rows(self) -> bool:
        """Whether every rank holds rows of it (``rows`` row blocks, or a split stack)."""
        return self.role is Role.ROWS or self.is_split

    @property
    def numel(self) -> int:
        return math.prod(int(s) for s in self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    def is_owned_by(self, rank: int) -> bool:
        """True if ``rank`` holds this tensor whole (always False for ``rows``)."""
        return self.owner is not None and self.owner == rank

    def row_range(self, rank: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` of a ``rows`` tensor held by ``rank``.

        Rows are split as ``torch.chunk`` splits them (FSDP2's ``Shard(0)`` convention):
        ``ceil(rows / W)`` per rank, the last ranks possibly short or empty.
        """
        if self.is_split:
            # the planner lists one range per rank in rank order: read it at its index (O(1));
            # any other order is searched once into a table kept on the record
            if rank < len(self.row_owners) and self.row_owners[rank][2] == rank:
                start, stop, _ = self.row_owners[rank]
                return start, stop
            start, stop = self._ranges_by_rank[rank]
            return start, stop
        if self.role is not Role.ROWS:
            raise ValueError(f"{self.fqn}: row_range is only defined for role 'rows' and split stacks")
        return chunk_row_range(self.shape[0] if self.shape else 1, self.world_size, rank)

    def row_ranges(self) -> list[tuple[int, int]]:
        """Rows ``[start, stop)`` of every rank, in rank order (a split stack's or a ``rows``
        tensor's), read off ``row_owners`` in one pass where they are listed in rank order."""
        owners = self.row_owners
        if owners and list(map(itemgetter(2), owners)) == list(range(self.world_size)):  # C loops
            return list(zip(map(itemgetter(0), owners), map(itemgetter(1), owners), strict=True))
        return [self.row_range(r) for r in range(self.world_size)]

    @functools.cached_property
    def _ranges_by_rank(self) -> dict[int, tuple[int, int]]:
        return {q: (a, b) for a, b, q in self.row_owners}

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of the tensor this rank keeps resident when sharded."""
        if self.holds_rows:
            start, stop = self.row_range(rank)
            return (stop - start, *self.shape[1:])
        if self.is_owned_by(rank):
            return self.shape
        return (0, *self.shape[1:]) if self.shape else ()  # no rows (a placeholder for a scalar)

    def local_numel(self, rank: int) -> int:
        if not self.holds_rows and not self.is_owned_by(rank):
            return 0
        return math.prod(int(s) for s in self.local_shape(rank))

    def to_json(self) -> dict[str, Any]:
        return self._json(lists=True)

    def _json(self, *, lists: bool) -> dict[str, Any]:
        row_owners: Any = [list(r) for r in self.row_owners] if lists else self.row_owners
        return {
            "fqn": self.fqn,
            "shape": list(self.shape),
            "dtype": str(self.dtype).replace("torch.", ""),
            "role": self.role.value,
            "owner": self.owner,
            "unit": self.unit,
            "aliases": list(self.aliases),
            "requires_grad": self.requires_grad,
            **({"row_owners": row_owners} if self.row_owners else {}),
            **({"step_replica": self.step_replica} if self.step_replica is not None else {}),
        }


@dataclass(frozen=True)
class RankLoad:
    """What one rank carries under a plan."""

    rank: int
    resident_bytes: int  # parameter + gradient + optimizer state, at rest between steps
    optimizer_flops: float
    owned_matrices: int
    owned_tensors: int  # matrices + tail tensors owned whole


@dataclass
class ShardingPlan:
    """All :class:`MatrixShard` records of a model for one data-parallel world size.

    ``shards`` is keyed by fqn in model order. ``loads`` holds the per-rank figures the
    planner balanced. The plan is deterministic: equal inputs give an equal :meth:`digest`.
    """

    world_size: int
    shards: dict[str, MatrixShard]
    loads: list[RankLoad] = field(default_factory=list)
    preconditioner: str = DEFAULT_COST.name  # the name of the cost model that priced it
    replicate_size: int = 1  # HSDP: the replicas the matrices' steps are spread over
    replica_loads: list[RankLoad] = field(default_factory=list)  # HSDP: per global rank r * W + s

    # -- lookups --------------------------------------------------------------------
    def __getitem__(self, fqn: str) -> MatrixShard:
        try:
            return self.shards[fqn]
        except KeyError:
            for shard in self.shards.values():
                if fqn in shard.aliases:
                    return shard
            raise KeyError(f"no parameter named {fqn!r} in this ShardingPlan") from None

    def __contains__(self, fqn: object) -> bool:
        if fqn in self.shards:
            return True
        return any(fqn in s.aliases for s in self.shards.values())

    def __iter__(self) -> Iterator[MatrixShard]:
        return iter(self.shards.values())

    def __len__(self) -> int:
        return len(self.shards)

    def owned_by(self, rank: int) -> list[MatrixShard]:
        """Shards ``rank`` holds whole (matrices and tail tensors)."""
        return [s for s in self.shards.values() if s.is_owned_by(rank)]

    def units(self) -> list[int]:
        return sorted({s.unit for s in self.shards.values()})

    # -- identity ---------------------------------------------------------------------
    def canonical(self) -> list[dict[str, Any]]:
        """The plan as plain data: what the digest hashes and what ranks compare."""
        return [s.to_json() for s in self.shards.values()]

    def digest(self) -> str:
        """A hex SHA-256 over the canonical plan; stable across processes and runs."""
        head: dict[str, Any] = {"world_size": self.world_size}
        if self.replicate_size > 1:
            head["replicate_size"] = self.replicate_size
        # the same JSON as canonical()'s, with row_owners kept as tuples (JSON arrays alike):
        # no per-rank list per split stack
        payload = json.dumps(
            {**head, "shards": [s._json(lists=False) for s in self.shards.values()]},
            sort_keys=True,
            separators=(",", ":"),
        )
        return hashlib.sha256(payload.encode()).hexdigest()

    def first_difference(self, other: ShardingPlan) -> str | None:
        """A sentence naming the first parameter where two plans differ, or None."""
        if self.world_size != other.world_size:
            return f"world size {self.world_size} vs {other.world_size}"
        if self.replicate_size != other.replicate_size:
            return f"replicate size {self.replicate_size} vs {other.replicate_size}"
        mine, theirs = self.canonical(), other.canonical()
        for a, b in zip(mine, theirs, strict=True):
            if a != b:
                keys = [k for k in a if a[k] != b.get(k)]
                detail = ", ".join(f"{k}: {a[k]!r} vs {b.get(k)!r}" for k in keys)
                return f"parameter {a['fqn']!r} differs ({detail})"
        if len(mine) != len(theirs):
            longer = mine if len(mine) > len(theirs) else theirs
            extra = longer[min(len(mine), len(theirs))]["fqn"]
            return f"parameter {extra!r} is present in only one plan"
        return None

    # -- reporting ---------------------------------------------------------------------
    def imbalance(self) -> dict[str, float]:
        """max/mean of per-rank resident bytes and optimizer FLOPs (1.0 is perfect)."""

        def ratio(values: list[float]) -> float:
            mean = sum(values) / len(values) if values else 0.0
            return max(values) / mean if mean > 0 else 1.0

        return {
            "bytes_max_over_mean": ratio([float(x.resident_bytes) for x in self.loads]),
            "flops_max_over_mean": ratio([x.optimizer_flops for x in self.loads]),
        }

    def summary(self) -> dict[str, Any]:
        """JSON-ready report: per-rank loads, imbalance and role counts."""
        roles = {r.value: 0 for r in Role}
        for s in self.shards.values():
            roles[s.role.value] += 1
        idle = [x.rank for x in self.loads if x.owned_matrices == 0]
        return {
            "world_size": self.world_size,
            "preconditioner": self.preconditioner,
            "digest": self.digest(),
            "num_tensors": len(self.shards),
            "roles": roles,
            "ranks_without_matrices": len(idle),
            "imbalance": self.imbalance(),
            "ranks": [dataclasses.asdict(x) for x in self.loads],  # RankLoad's fields, in order
        }

    def to_json(self) -> dict[str, Any]:
        return {**self.summary(), "shards": self.canonical()}


# --- the link from a live parameter to its record -------------------------------------------
_SHARD_ATTR = "_moo_matrix_shard"
_RANK_ATTR = "_moo_shard_rank"  # a plain tensor's only (simulation): a DTensor's spec says it


def attach_matrix_shard(param: torch.Tensor, shard: MatrixShard, rank: int) -> None:
    """Record on ``param`` (the sharded parameter the optimizer sees) its placement.

    ``rank`` is this process's index in the process group the plan shards over (the shard dim
    of the mesh), which is what ``shard.owner`` is compared against. A DTensor's own spec holds
    it (its mesh's dim 0, read by :func:`get_shard_rank`), so it is recorded only on a plain
    tensor (``optim/simulation.py``'s stand-ins for another rank's parameters).
    """
    if not 0 <= rank < shard.world_size:
        raise ValueError(f"{shard.fqn}: rank {rank} outside the plan's world size {shard.world_size}")
    setattr(param, _SHARD_ATTR, shard)
    if not is_dtensor(param):
        setattr(param, _RANK_ATTR, int(rank))


def get_shard_group(param: torch.Tensor) -> Any:
    """The process group ``param`` is sharded over, read from its DTensor spec (the mesh's dim
    0; None if unsharded or a plain tensor)."""
    if getattr(param, _SHARD_ATTR, None) is None or not is_dtensor(param):
        return None
    return param.device_mesh.get_group(0)  # type: ignore[attr-defined]


def get_matrix_shard(param: torch.Tensor) -> MatrixShard | None:
    """The :class:`MatrixShard` recorded on ``param``, or None: a parameter no plan covers, or
    one whose lazy plan is not fixed yet (reading metadata never fixes it: the first forward,
    ``unshard()``, ``fix_plan()`` or the optimizer's construction does)."""
    return getattr(param, _SHARD_ATTR, None)


def get_shard_rank(param: torch.Tensor) -> int | None:
    """This process's rank in the group ``param`` is sharded over (None if unsharded): a
    DTensor's spec says it (the mesh's dim 0), a plain tensor's is recorded."""
    if getattr(param, _SHARD_ATTR, None) is None:
        return None
    if is_dtensor(param):
        return int(param.device_mesh.get_local_rank(0))  # type: ignore[attr-defined]
    return getattr(param, _RANK_ATTR, None)


# The units of a sharded model, recorded on the module that holds them all (the planning root),
# next to the module's own fully_shard state: the runtime records, the planner reads, neither
# imports the other, and the record lives and dies with the model.
_UNIT_PREFIXES_ATTR = "_moo_unit_prefixes"


def record_unit_prefixes(model: torch.nn.Module, prefixes: list[str] | tuple[str, ...]) -> None:
    """Record the module fqns of ``model``'s ``fully_shard`` units in call order (``""`` for
    ``model`` itself), so that :func:`~.planner.plan_model` on ``model`` plans the same units."""
    model.__dict__[_UNIT_PREFIXES_ATTR] = tuple(prefixes)


def recorded_unit_prefixes(model: torch.nn.Module) -> tuple[str, ...] | None:
    """The unit fqns recorded for ``model`` by ``fully_shard``, or None."""
    return model.__dict__.get(_UNIT_PREFIXES_ATTR)
