"""Agreement: every rank acts on the same configuration and at the same step, or all fail by name.

Ranks that disagree fail fast, on every rank, naming the first rank pair and the field that
differ, instead of training apart or waiting in a collective the others never issue (every rank
computes the same error from the same gathered records). One small all-gather per check:
:func:`check_sharding_agreement` (``fully_shard`` fixing a plan: mesh, pending optimizer
configuration, plan digest, over the mesh's whole group), :func:`agree_before_planning`
(``OwnerRoutedOptimizer``: its configuration rides in those plan agreements, or is agreed
alone), :func:`check_plan_agreement` (DDP owner plans) and :func:`agree_verdict` (a refused
load is every rank's). Steps whose collective one rank could enter alone carry the step count
(:func:`check_same_step`). What is guaranteed, test by test: docs/reliability.md.
"""

from __future__ import annotations

import bisect
import contextvars
import dataclasses
import enum
import itertools
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from . import comm
from .planning.metadata import ShardingPlan, get_shard_group
from .tensors import tree_link

__all__ = [
    "MeshView",
    "agree_before_planning",
    "check_plan_agreement",
    "check_sharding_agreement",
    "describe",
    "agree_nonfinite",
    "agree_steps",
    "check_header_steps",
    "check_same_step",
    "step_digits",
    "agree_verdict",
    "mesh_view",
    "optimizer_fields",
    "optimizer_groups",
]

# The optimizer configuration a constructor has pending while it fixes plans (agreed with them).
_PENDING: contextvars.ContextVar[_Pending | None] = contextvars.ContextVar("moo_pending_config", default=None)

MESH_REMEDY = "Pass the same mesh (shape, dim names and ranks) to fully_shard on every rank."
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_MESH_FIELDS = ("mesh shape", "mesh dim names", "shard group ranks", "replicate group ranks")


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
    peers: dict[str, _RankRuns]


@dataclasses.dataclass(frozen=True)
class _RankRuns:
    """A set of ranks as sorted ``[start, stop)`` runs: a mesh's ranks are a few runs, so every
    rank's record stays small at W=2048 (W frozensets of W ranks each took seconds to unpickle)."""

    runs: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, ranks: Iterable[int]) -> _RankRuns:
        runs: list[list[int]] = []
        for r in sorted(ranks):
            if runs and runs[-1][1] == r:
                runs[-1][1] = r + 1
            else:
                runs.append([r, r + 1])
        return cls(tuple((a, b) for a, b in runs))

    def __contains__(self, rank: object) -> bool:
        i = bisect.bisect_right(self.runs, (rank, float("inf"))) - 1
        return i >= 0 and self.runs[i][0] <= rank < self.runs[i][1]  # type: ignore[operator]


@dataclasses.dataclass(frozen=True)
class MeshView:
    """The mesh a ``fully_shard`` tree shards over as one rank sees it: shape, dim names and the
    global ranks of this rank's shard and replicate groups."""

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    shard_ranks: tuple[int, ...]
    replicate_ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def known_ranks(self) -> frozenset[int]:
        return frozenset(self.shard_ranks) | frozenset(self.replicate_ranks)

    def fields(self) -> dict[str, str]:
        values = (self.shape, self.dim_names, self.shard_ranks, self.replicate_ranks)
        return dict(zip(_MESH_FIELDS, map(str, values), strict=True))

    def peers(self) -> dict[str, frozenset[int]]:
        everyone, shard, rep = self.known_ranks, frozenset(self.shard_ranks), frozenset(self.replicate_ranks)
        return dict(zip(_MESH_FIELDS, (everyone, everyone, shard, rep), strict=True))


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
    spans the world (ranks given different meshes still meet there), else the mesh's own groups."""
    if view.size == dist.get_world_size():
        return [dist.group.WORLD]
    return [group] if replicate_group is None else [group, replicate_group]


def describe(value: Any) -> str:
    """Text equal on two ranks exactly when the values are (classes and functions by qualified
    name, tensors by dtype, shape and values, no memory addresses)."""
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
    """The first (field, record a, record b) that differ between two ranks that must agree on it
    (fields in order, then pairs in rank order: the same on every rank)."""
    ordered = sorted(records, key=lambda r: r.rank)
    for name in dict.fromkeys(f for r in records for f in r.fields):
        if len({r.fields.get(name, "<absent>") for r in records}) == 1:
            continue  # one value on every rank: no pair can differ (linear in ranks; the pair scan is the error path's)
        for a, b in itertools.combinations(ordered, 2):
            must = b.rank in a.peers.get(name, ()) or a.rank in b.peers.get(name, ())
            if must and a.fields.get(name, "<absent>") != b.fields.get(name, "<absent>"):
                return name, a, b
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
    """What :func:`optimizer_fields` reads of an ``OwnerRoutedOptimizer`` being built."""

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
    """An optimizer's configuration as agreement fields (docs/reliability.md lists them)."""
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


def _agree(
    groups: Sequence[Any],
    fields: dict[str, str],
    peers: dict[str, frozenset[int]],
    remedies: Mapping[str, str],
    who: Callable[[str], str],
    name: str,
    plan: tuple[str, ShardingPlan] | None = None,
) -> None:
    """One all-gather of this rank's fields over each of ``groups``; at the first conflict every
    rank raises ``ValueError`` (a plan's first gathers the plans, to name the parameter)."""
    for g in groups:
        if dist.get_world_size(g) == 1:
            continue
        runs = {f: _RankRuns.of(r) for f, r in peers.items()}
        records = comm.all_gather_object(_Record(dist.get_rank(), fields, runs), group=g, name=name)
        conflict = _first_conflict(records)
        if conflict is None:
            continue
        detail = ""
        if plan is not None and conflict[0] == plan[0]:
            plans = comm.all_gather_object(plan[1], group=g, name="plan_all_gather")
            index = {r.rank: i for i, r in enumerate(records)}
            found = plans[index[conflict[1].rank]].first_difference(plans[index[conflict[2].rank]])
            detail = found or "the digests differ"
        _raise_conflict(conflict, who(conflict[0]), remedies, detail)


def check_sharding_agreement(plan: ShardingPlan, group: Any, replicate_group: Any, *, remedy: str) -> None:
    """Raise ``ValueError`` on every rank of the mesh unless all agree on the mesh, the pending
    optimizer configuration and ``plan`` (``remedy``: what to do about a plan that differs)."""
    if not _distributed() or dist.get_world_size() == 1:
        return
    view = mesh_view(group, replicate_group)
    pending = _PENDING.get()
    fields, peers = view.fields(), view.peers()
    remedies = {f: MESH_REMEDY for f in fields}
    if pending is not None:
        pending.agreed = True
        fields.update(pending.fields)
        peers.update({f: view.known_ranks for f in pending.fields})
        remedies.update({f: pending.remedy for f in pending.fields})
    fields["sharding plan"], peers["sharding plan"] = plan.digest()[:16], view.known_ranks
    remedies["sharding plan"] = remedy
    _agree(
        _whole_groups(view, group, replicate_group),
        fields,
        peers,
        remedies,
        lambda f: pending.who if pending is not None and f in pending.fields else "fully_shard",
        "plan_digest",
        ("sharding plan", plan),
    )


def optimizer_groups(params: Iterable[torch.Tensor], process_group: Any) -> list[Any]:
    """Where an optimizer's configuration is agreed when no plan carried it: ``process_group``,
    else the whole group of its parameters' mesh, else (plain tensors, DDP) the world."""
    if process_group is not None:
        return [process_group]
    for p in params:
        group = get_shard_group(p)
        if group is not None:
            link = tree_link(p)  # the tree's HSDP replica record, if any (replica_sync.replicas_of)
            place = None if link is None or link.tree is None else link.tree.replicas
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
    """Run ``fix_plans`` (collective: it fixes pending ``fully_shard`` plans) with ``fields``
    pending, so each plan fixed then is agreed with them; if it fixed none, agree ``fields`` over
    :func:`optimizer_groups`. Raises ``ValueError`` on every rank at the first difference."""
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
    peers = {f: everyone for f in fields}
    _agree(
        optimizer_groups(params, process_group), dict(fields), peers, {"*": remedy}, lambda _: who, "config_agreement"
    )


def check_plan_agreement(plan: ShardingPlan, group: Any = None, *, who: str, what: str, remedy: str) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless all hold the same ``plan``
    (``who`` names the caller, ``what`` the plan, ``remedy`` what to do)."""
    if _distributed():
        ranks = frozenset(_group_ranks(group))
        _agree([group], {what: plan.digest()}, {what: ranks}, {"*": remedy}, lambda _: who, "plan_digest", (what, plan))


_REBUILT = {"KeyError": KeyError, "ValueError": ValueError, "TypeError": TypeError}


def agree_verdict(error: BaseException | None, groups: Sequence[Any], *, who: str) -> None:
    """Make a refusal every rank's: one all-gather of this rank's ``error`` (None: go ahead) over
    each of ``groups``; if any rank refused, every rank raises, its own error or the first
    refusing rank's, named (the same type for ``KeyError``, ``ValueError``, ``TypeError``, else
    ``RuntimeError``)."""
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


STEP_DIGITS = 4  # a step number in a float header: base-256 digits, exact in bf16 (counts mod 2**32)


def step_digits(step: int) -> list[float]:
    """``step`` as :data:`STEP_DIGITS` header values (appended to a collective's float header)."""
    return [float((step >> (8 * i)) & 255) for i in range(STEP_DIGITS)]


def check_same_step(step: int, seen: Iterable[int], *, who: str, among: str, counted: str) -> None:
    """The shared "steps agree" check: raise ``RuntimeError`` naming this rank's ``step`` and the
    range of the other ranks' ``seen`` ones (as their collective carried them) unless all equal
    (``among``: the ranks compared; ``counted``: what the number counts)."""
    numbers = [step, *seen]
    lowest, highest = min(numbers), max(numbers)
    if lowest != highest:
        raise RuntimeError(
            f"{who}: the ranks of {among} are at different steps: rank {dist.get_rank()} is at step {step}, "
            f"the group's range from {lowest} to {highest} ({counted}). A rank called step() more or fewer "
            "times than the others, or checked a step the others did not; every rank must step, and check, "
            "together"
        )


def check_header_steps(step: int, headers: Sequence[Sequence[float]], *, who: str, among: str) -> None:
    """:func:`check_same_step` on the :func:`step_digits` that end each gathered header."""
    seen = [sum(int(d) << (8 * i) for i, d in enumerate(h[-STEP_DIGITS:])) for h in headers]
    check_same_step(step % (1 << 8 * STEP_DIGITS), seen, who=who, among=among, counted="optimizer steps")


def agree_nonfinite(
    step: int,
    flag: torch.Tensor,
    group: Any,
    *,
    who: str = "OwnerRoutedOptimizer.step()",
    among: str = "process_group",
    op: str = "nonfinite_check",
) -> bool:
    """Whether any rank of ``group`` found a non-finite gradient (``flag`` 1.0 here): one
    all-reduce (max) of the flag, ``step`` and ``-step``, so every rank also learns the group's
    step range (:func:`check_same_step`)."""
    if not _distributed() or dist.get_world_size(group) == 1:
        return bool(flag.item())
    payload = torch.stack([(flag > 0).long().reshape(()), torch.tensor(step), torch.tensor(-step)]).to(flag.device)
    comm.all_reduce(payload, op=dist.ReduceOp.MAX, group=group, name=op)
    found, highest, lowest = (int(v) for v in payload.tolist())
    check_same_step(step, (highest, -lowest), who=who, among=among, counted="step() calls since the first checked one")
    return bool(found)


def agree_steps(
    step: int, among: str, group: Any, device: torch.device, *, who: str = "OwnerRoutedOptimizer.step()"
) -> None:
    """:func:`agree_nonfinite` with no flag: the step check over ``group`` (named ``among`` in
    the error), whose step collective or forward this rank is about to enter."""
    agree_nonfinite(step, torch.zeros((), device=device), group, who=who, among=among, op="step_check")


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
