"""Agreement: every rank acts on the same configuration, checked once before anything moves.

Ranks that disagree fail fast, on every rank, naming the first rank and the field that differ,
instead of training apart silently or waiting in a collective the others never issue. Three
checks, each one small all-gather of a few strings per rank:

* :func:`check_sharding_agreement` (``fully_shard``, when a tree's plan is fixed): the mesh as
  this rank sees it (shape, dim names, the global ranks of its shard and replicate groups), the
  optimizer configuration pending while the optimizer fixes the plan (below), and the plan
  digest. It runs over the whole group of the mesh (the world group when the mesh spans the
  world, which is how ranks whose meshes disagree still meet in one collective), before the
  first byte of data moves.
* :func:`agree_before_planning` (``OwnerRoutedOptimizer``'s constructor): the optimizer classes
  and options, roles and views overrides, layout switches and param groups. They ride in the
  plan agreement of every tree the constructor fixes; where it fixes none (the plan was fixed
  already, or no ``fully_shard``), one agreement over the optimizer's ranks carries them.
* :func:`check_plan_agreement` (DDP owners, ``ReplicatedLayout``): the owner plan's digest.

On a mismatch every rank computes the same error from the same gathered records, so all raise
``ValueError`` together (a plan mismatch first gathers the plans, to name the parameter).
"""

from __future__ import annotations

import contextvars
import dataclasses
import enum
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from . import comm
from .planning.metadata import ShardingPlan, get_shard_group
from .replica_sync import replicas_of

__all__ = [
    "MeshView",
    "agree_before_planning",
    "check_plan_agreement",
    "check_sharding_agreement",
    "describe",
    "agree_nonfinite",
    "agree_verdict",
    "mesh_view",
    "optimizer_fields",
    "optimizer_groups",
]

# The optimizer configuration a constructor has pending while it fixes plans (agreed with them).
_PENDING: contextvars.ContextVar[_Pending | None] = contextvars.ContextVar("moo_pending_config", default=None)

MESH_REMEDY = "Pass the same mesh (shape, dim names and ranks) to fully_shard on every rank."
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


@dataclasses.dataclass
class _Pending:
    fields: dict[str, str]
    who: str
    remedy: str
    agreed: bool = False


@dataclasses.dataclass(frozen=True)
class _Record:
    """One rank's side of an agreement: its global rank, field -> value text, and for each
    field the ranks it must agree with (a pair is compared when either names the other)."""

    rank: int
    fields: dict[str, str]
    peers: dict[str, frozenset[int]]


@dataclasses.dataclass(frozen=True)
class MeshView:
    """The mesh a ``fully_shard`` tree shards over, as one rank sees it: its shape
    (``(replicate, shard)`` or ``(shard,)``), dim names (from the groups DeviceMesh made, where
    it named them) and the global ranks of this rank's shard and replicate groups."""

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    shard_ranks: tuple[int, ...]
    replicate_ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def known_ranks(self) -> frozenset[int]:
        return frozenset(self.shard_ranks) | frozenset(self.replicate_ranks)

    def fields(self) -> dict[str, str]:
        return {
            "mesh shape": str(self.shape),
            "mesh dim names": str(self.dim_names),
            "shard group ranks": str(self.shard_ranks),
            "replicate group ranks": str(self.replicate_ranks),
        }

    def peers(self) -> dict[str, frozenset[int]]:
        everyone = self.known_ranks
        return {
            "mesh shape": everyone,
            "mesh dim names": everyone,
            "shard group ranks": frozenset(self.shard_ranks),
            "replicate group ranks": frozenset(self.replicate_ranks),
        }


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _group_ranks(group: Any) -> tuple[int, ...]:
    return tuple(int(r) for r in dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _dim_name(group: Any) -> str:
    desc = str(getattr(group if group is not None else dist.group.WORLD, "group_desc", "") or "")
    return desc[len("mesh_") :] if desc.startswith("mesh_") else "-"


def mesh_view(group: Any, replicate_group: Any = None) -> MeshView:
    """This rank's :class:`MeshView` of the shard ``group`` and HSDP ``replicate_group``."""
    shard = _group_ranks(group)
    if replicate_group is None:
        return MeshView((len(shard),), (_dim_name(group),), shard, ())
    rep = _group_ranks(replicate_group)
    return MeshView((len(rep), len(shard)), (_dim_name(replicate_group), _dim_name(group)), shard, rep)


def _whole_groups(view: MeshView, group: Any, replicate_group: Any) -> list[Any]:
    """The groups an agreement over ``view``'s mesh runs over: the world group when the mesh
    spans the world (every rank of the job then meets in it, whatever mesh it was given), the
    shard group of a 1D mesh over part of the world (a pipeline stage), and both groups of a 2D
    mesh over part of the world (no group holds all of its ranks)."""
    if view.size == dist.get_world_size():
        return [dist.group.WORLD]
    return [group] if replicate_group is None else [group, replicate_group]


def describe(value: Any) -> str:
    """Text for a configuration value that is equal on two ranks exactly when the values are
    (classes and functions by qualified name, tensors by dtype, shape and values, no memory
    addresses), for comparing and for error messages."""
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().flatten()[:8].tolist() if value.device.type != "meta" else "meta"
        return f"tensor({tuple(value.shape)}, {value.dtype}, {data})"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{describe(k)}: {describe(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, enum.Enum):
        return repr(value.value)
    if isinstance(value, (str, int, float, bool, type(None), torch.dtype, torch.device)):
        return repr(value)
    return f"{type(value).__qualname__}:{_ADDRESS.sub('', repr(value))}"


def _first_conflict(records: Sequence[_Record]) -> tuple[str, _Record, _Record] | None:
    """The first (field, rank a, rank b) whose values differ between two ranks that must agree
    on it, fields in the first record's order, then pairs in rank order: the same on every rank."""
    by_rank = {r.rank: r for r in records}
    fields = list(dict.fromkeys(f for r in records for f in r.fields))
    for name in fields:
        for a in records:
            for b in records:
                if b.rank <= a.rank:
                    continue
                if b.rank not in a.peers.get(name, ()) and a.rank not in b.peers.get(name, ()):
                    continue
                if a.fields.get(name, "<absent>") != b.fields.get(name, "<absent>"):
                    return name, by_rank[a.rank], by_rank[b.rank]
    return None


def _raise_conflict(
    conflict: tuple[str, _Record, _Record], who: str, remedies: Mapping[str, str], detail: str = ""
) -> None:
    field, a, b = conflict
    remedy = remedies.get(field, remedies.get("*", ""))
    va, vb = a.fields.get(field, "<absent>"), b.fields.get(field, "<absent>")
    what = detail or f"{va} on rank {a.rank}, {vb} on rank {b.rank}"
    raise ValueError(f"{who}: rank {a.rank} and rank {b.rank} disagree on the {field}: {what}. {remedy}".rstrip())


class _Configured(Protocol):
    """What :func:`optimizer_fields` reads of an ``OwnerRoutedOptimizer`` being built: its two
    role optimizers, roles and views overrides, layout configuration and non-finite switch."""

    @property
    def _kinds(self) -> Mapping[Any, Any]: ...
    @property
    def _overrides(self) -> Any: ...
    @property
    def _views(self) -> Any: ...
    @property
    def _config(self) -> Any: ...
    @property
    def skip_nonfinite_grads(self) -> bool: ...


def optimizer_fields(optimizer: _Configured, user_groups: Sequence[Any]) -> dict[str, str]:
    """An optimizer's configuration as agreement fields: each role's optimizer class and
    options, the roles and matrix_views overrides (in order: the last match wins), the layout
    switches, and each user param group's size and options; values as :func:`describe` words
    them."""
    fields: dict[str, str] = {}
    for kind, role in optimizer._kinds.items():  # the kind is the role optimizer's key
        fields[f"{kind.value} optimizer"] = describe(role.factory)
        fields[f"{kind.value}_options"] = describe(dict(sorted(role.options.items())))
    fields["roles"] = describe(list(optimizer._overrides.rules))
    fields["matrix_views"] = describe(list(optimizer._views.rules))
    fields["replicated"] = describe(optimizer._config.replicated)
    fields["replica_broadcast"] = describe(optimizer._config.replica_broadcast)
    fields["skip_nonfinite_grads"] = describe(optimizer.skip_nonfinite_grads)
    fields["param groups"] = describe([(len(g.params), dict(sorted(g.options.items()))) for g in user_groups])
    return fields


def check_sharding_agreement(plan: ShardingPlan, group: Any, replicate_group: Any, *, remedy: str) -> None:
    """Raise ``ValueError`` on every rank of the mesh unless all agree on the mesh, the pending
    optimizer configuration (if an optimizer is fixing this plan) and ``plan``.

    ``remedy`` says what to do about a plan that differs. One all-gather over the mesh's whole
    group (:func:`_whole_groups`); a plan mismatch adds one of the plans, to name the parameter.
    A one-rank mesh in a one-rank job agrees with itself: no collective.
    """
    if not _distributed() or dist.get_world_size() == 1:
        return
    view = mesh_view(group, replicate_group)
    pending = _PENDING.get()
    fields = view.fields()
    peers = view.peers()
    remedies = {f: MESH_REMEDY for f in fields}
    if pending is not None:
        pending.agreed = True
        fields.update(pending.fields)
        peers.update({f: view.known_ranks for f in pending.fields})
        remedies.update({f: pending.remedy for f in pending.fields})
    fields["sharding plan"] = plan.digest()[:16]
    peers["sharding plan"] = view.known_ranks
    remedies["sharding plan"] = remedy
    for g in _whole_groups(view, group, replicate_group):
        if dist.get_world_size(g) == 1:
            continue
        mine = _Record(dist.get_rank(), fields, peers)
        records = comm.all_gather_object(mine, group=g, name="plan_digest")
        conflict = _first_conflict(records)
        if conflict is None:
            continue
        detail = ""
        if conflict[0] == "sharding plan":  # name the parameter: every rank gathers the plans
            plans = comm.all_gather_object(plan, group=g, name="plan_all_gather")
            index = {r.rank: i for i, r in enumerate(records)}
            found = plans[index[conflict[1].rank]].first_difference(plans[index[conflict[2].rank]])
            detail = found or "the digests differ"
        who = pending.who if pending is not None and conflict[0] in pending.fields else "fully_shard"
        _raise_conflict(conflict, who, remedies, detail)


def optimizer_groups(params: Iterable[torch.Tensor], process_group: Any) -> list[Any]:
    """The groups an optimizer's configuration is agreed over when no plan carried it: the
    given ``process_group``; else the whole group of the mesh its owner-sharded parameters were
    planned over; else (plain tensors, DDP) the world group."""
    if process_group is not None:
        return [process_group]
    for p in params:
        group = get_shard_group(p)
        if group is not None:
            place = replicas_of(p)
            replicate = place.group if place is not None and place.size > 1 else None
            return _whole_groups(mesh_view(group, replicate), group, replicate)
    return [dist.group.WORLD]


def agree_before_planning(
    fields: Mapping[str, str],
    user_groups: Sequence[Any],
    process_group: Any,
    fix_plans: Callable[[list[torch.Tensor]], None],
    *,
    who: str = "OwnerRoutedOptimizer",
    remedy: str = "Build OwnerRoutedOptimizer with the same arguments on every rank.",
) -> None:
    """Run ``fix_plans`` on the parameters of ``user_groups`` (it fixes the plans of pending
    ``fully_shard`` trees, collective) with ``fields`` pending, so each plan fixed then is agreed
    together with them; if it fixed none, agree ``fields`` over the optimizer's ranks
    (:func:`optimizer_groups`). Raises ``ValueError`` on every rank, ``who`` and ``remedy``
    wording it, at the first difference."""
    params = [rp.param for g in user_groups for rp in g.params]
    pending = _Pending(dict(fields), who, remedy)
    token = _PENDING.set(pending)
    try:
        fix_plans(params)
    finally:
        _PENDING.reset(token)
    if pending.agreed or not _distributed() or dist.get_world_size() == 1:
        return
    everyone = frozenset(range(dist.get_world_size()))
    for g in optimizer_groups(params, process_group):
        if dist.get_world_size(g) == 1:
            continue
        mine = _Record(dist.get_rank(), dict(fields), {f: everyone for f in fields})
        conflict = _first_conflict(comm.all_gather_object(mine, group=g, name="config_agreement"))
        if conflict is not None:
            _raise_conflict(conflict, who, {"*": remedy})


def check_plan_agreement(plan: ShardingPlan, group: Any = None, *, who: str, what: str, remedy: str) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless all hold the same ``plan``.

    ``who`` names the caller and ``what`` the plan in the message; ``remedy`` says what to do.
    A group of one rank (or no process group) agrees with itself: no collective.
    """
    if not _distributed() or dist.get_world_size(group) == 1:
        return
    digests = comm.all_gather_object(plan.digest(), group=group, name="plan_digest")
    if all(d == digests[0] for d in digests):
        return
    plans = comm.all_gather_object(plan, group=group, name="plan_all_gather")
    for other in range(1, len(plans)):  # every rank names the same pair
        if digests[other] != digests[0]:
            detail = plans[0].first_difference(plans[other]) or "digests differ"
            raise ValueError(f"{who}: ranks disagree on the {what} (rank 0 vs rank {other}): {detail}. {remedy}")


_REBUILT = {"KeyError": KeyError, "ValueError": ValueError, "TypeError": TypeError}


def agree_verdict(error: BaseException | None, groups: Sequence[Any], *, who: str) -> None:
    """Make a refusal every rank's: one all-gather of this rank's ``error`` (None: it would go
    ahead) over each of ``groups``; if any rank refused, every rank raises before it changes
    anything, its own error where it has one, else the first refusing rank's, named (as the
    same exception type for ``KeyError``, ``ValueError`` and ``TypeError``, else
    ``RuntimeError``). In one process, and over a one-rank group, ``error`` is simply raised."""
    verdicts: list[tuple[int, str, str] | None] = []
    mine = None
    if error is not None:  # a KeyError's str() is its message quoted: send the message
        text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
        mine = (dist.get_rank() if _distributed() else 0, type(error).__name__, str(text))
    if _distributed():
        for g in groups:
            if dist.get_world_size(g) > 1:
                verdicts.extend(comm.all_gather_object(mine, group=g, name="verdict_agreement"))
    if error is not None:
        raise error
    refused = next((v for v in verdicts if v is not None), None)
    if refused is not None:
        rank, kind, text = refused
        raise _REBUILT.get(kind, RuntimeError)(
            f"{who}: refused on rank {rank} ({kind}: {text}); nothing was changed on any rank"
        )


def agree_nonfinite(step: int, flag: torch.Tensor, group: Any, *, who: str = "OwnerRoutedOptimizer.step()") -> bool:
    """Whether any rank of ``group`` found a non-finite gradient (``flag`` 1.0 here), from one
    all-reduce (max) of three integers: the flag, this step's number and its negation, so every
    rank also learns the group's highest and lowest step number at no extra round trip.

    ``step`` is the optimizer's ``step()`` calls counted from its first checked step on (checked
    or not since: a rank that turned the check off for a step is a step ahead when it checks
    again; ``OwnerRoutedOptimizer`` counts them).
    Ranks at different steps raise ``RuntimeError`` on every rank, naming the numbers, instead
    of pairing one step's check with another's."""
    if not _distributed() or dist.get_world_size(group) == 1:
        return bool(flag.item())
    payload = torch.stack([(flag > 0).long().reshape(()), torch.tensor(step), torch.tensor(-step)]).to(flag.device)
    comm.all_reduce(payload, op=dist.ReduceOp.MAX, group=group, name="nonfinite_check")
    found, highest, lowest = (int(v) for v in payload.tolist())
    lowest = -lowest
    if highest != lowest:
        raise RuntimeError(
            f"{who}: the ranks of process_group are at different steps: rank {dist.get_rank()} is at step {step}, "
            f"the group's range from {lowest} to {highest} (step() calls since the first checked one). A rank "
            "called step() more or fewer times than the others, or checked a step the others did not "
            "(skip_nonfinite_grads set on some ranks only); every rank must step, and check, together"
        )
    return bool(found)


def watch_steps(params: Iterable[torch.Tensor], optimizer: Any) -> None:
    """Link every ``fully_shard`` tree ``params`` belong to (weakly) to ``optimizer``, whose
    step now all-reduces (:func:`agree_nonfinite`, from its first checked step on): each such
    tree then opens its forward passes with the same all-reduce, carrying the optimizer's step
    count (``sharding/context.py: ShardingContext.check_steps``), so a rank that called
    ``step()`` more or fewer times than the others meets their forward (or their step) in one
    collective and every rank fails by name, instead of pairing the check with an all-gather
    until the process group's timeout."""
    from .tensors import tree_link

    trees = {id(t): t for p in params if (link := tree_link(p)) is not None and (t := link.tree) is not None}
    for tree in trees.values():
        tree.watch_steps(optimizer)
