"""``OwnerRoutedOptimizer``'s state dicts: torch's layout, in pieces of global tensors.

``state`` is keyed by parameter index in param-group order, as any torch optimizer's, and
``param_groups`` are the parent groups. Each value is its :mod:`.state_place` entry (the one
rule, read off each layout's :meth:`~.layouts.UpdateLayout.state_place`); every rank lists every
parameter, with empty pieces for state another rank holds, so ``get_optimizer_state_dict`` and
DCP reshard it. Loading takes those forms, full tensors and fqn-keyed state, and keeps on each
rank what it updates. The optimizer's methods call the functions here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from copy import deepcopy
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from .. import comm
from ..agreement import agree_verdict, optimizer_groups
from ..owner_dtensor import is_owner_dtensor
from ..replica_sync import hold_on_step_replica, replicas_of, steps_here
from .layouts import is_multi_rank
from .routing import RoutedParam
from .state_place import NOT_HELD, StatePlace, empty_entry, entry, local, spec

__all__ = [
    "agreed_local_state",
    "as_pieces",
    "check_saved_groups",
    "gather_owner_state",
    "local_state",
    "merge_consolidated",
    "restore_groups",
    "upgrade_saved_groups",
]

PlaceOf = dict[int, StatePlace | None]  # id(RoutedParam) -> where its state lies (its layout's word)


def _what(rp: RoutedParam, key: str) -> str:
    return f"optimizer state {key!r} of {rp.label!r}"


def as_pieces(sd: dict[str, Any], ordered: list[RoutedParam], places: PlaceOf, group: Any = None) -> dict[str, Any]:
    """torch's state dict ``sd`` of the routed parameters ``ordered`` with each state value as its
    entry (:func:`.state_place.entry`), an entry (of empty pieces) for state held on another
    rank, an empty entry for stateless parameters, sorted by index: the same keys on every rank.
    Collective over ``group`` (the optimizer's ranks) where some state is held by one rank (see
    :func:`_list_held_elsewhere`)."""
    for idx, st in list(sd["state"].items()):
        rp = ordered[idx]
        sd["state"][idx] = {k: entry(places[id(rp)], k, v, _what(rp, k)) for k, v in st.items()}
    _list_held_elsewhere(sd["state"], ordered, places, group)
    for idx, st in sd["state"].items():  # HSDP: a matrix's state lives on one replica
        for v in st.values():
            if is_owner_dtensor(v) and v.dim():
                hold_on_step_replica(v, ordered[idx].param)
    for idx in range(len(ordered)):  # stateless: an empty entry, so every rank's keys cover
        sd["state"].setdefault(idx, {})  # every parameter (DSD needs that)
    sd["state"] = dict(sorted(sd["state"].items()))  # one order on every rank, whoever holds what
    return sd


def _held_elsewhere(place: StatePlace | None) -> bool:
    return place is not None and place.held_elsewhere


def _list_held_elsewhere(state: dict[int, Any], ordered: list[RoutedParam], places: PlaceOf, group: Any = None) -> None:
    """Give this rank an entry, of empty pieces, for every state another rank alone holds, so
    that every rank's state dict has the same keys and shapes (torch's full_state_dict and
    DCP go through them in the same order on every rank). Under HSDP a matrix's state is held by
    its global owner alone: the other replicas list it as held by no rank of their shard group
    (an ``OwnerShard`` of empty ranges: no DCP chunk). Collective when any state is
    held by one rank: one all-gather of the (key, shape, dtype) lists."""
    held = [idx for idx, rp in enumerate(ordered) if _held_elsewhere(places[id(rp)])]
    if not is_multi_rank() or not held:
        return
    mine = {idx: {k: spec(v) for k, v in state[idx].items()} for idx in held if state.get(idx)}
    for theirs in comm.all_gather_object(mine, group=group, name="optimizer_state_keys"):
        for idx, keys in theirs.items():
            rp = ordered[idx]
            place = places[id(rp)]
            shard = rp.shard
            # a matrix cut into bands: each owner holds its blocks' keys, so every rank lists all
            banded = shard is not None and shard.is_split and len(shard.shape) == 2
            if (state.get(idx) and not banded) or place is None:
                continue
            here = steps_here(shard, replicas_of(rp.param))
            got: dict[str, Any] = dict(state.get(idx) or {})
            for k, s in keys.items():
                if k not in got:
                    got[k] = empty_entry(place, s, stepped_here=here, banded=banded)
            state[idx] = dict(sorted(got.items())) if banded else got


def gather_owner_state(
    ordered: list[RoutedParam], state: Mapping[torch.Tensor, Any], to: int | None
) -> dict[int, Any] | int:
    """Collective: every rank's owner-held state of ``ordered`` (plain CPU tensors, by index),
    merged on rank ``to`` (every rank with ``None``); ``to`` itself on the other ranks."""
    mine = {
        i: {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in state[rp.param].items()}
        for i, rp in enumerate(ordered)
        if rp.owner is not None and rp.proxy is not None and state.get(rp.param)
    }
    gathered = (
        comm.all_gather_object(mine, name="consolidate_state_dict")
        if to is None
        else comm.gather_object(mine, to, name="consolidate_state_dict")
    )
    if gathered is None:
        assert to is not None
        return to
    merged: dict[int, Any] = {}
    for part in gathered:
        merged.update(part)
    return merged


def merge_consolidated(sd: dict[str, Any], consolidated: dict[int, Any] | int | None) -> dict[str, Any]:
    """torch's state dict ``sd`` completed with the owners' state gathered by
    :func:`gather_owner_state`; raises where there is none on this rank."""
    if consolidated is None:
        raise RuntimeError(
            "OwnerRoutedOptimizer.state_dict(): under DDP with replicated='owner' each rank keeps "
            "the matrix state of the matrices it owns only; call optimizer.consolidate_state_dict() "
            "on every rank first (to=0 for a rank-0 torch.save, to=None for every rank, e.g. "
            "before get_optimizer_state_dict), as with ZeroRedundancyOptimizer"
        )
    if isinstance(consolidated, int):
        raise RuntimeError(
            f"OwnerRoutedOptimizer.state_dict(): the state was consolidated on rank "
            f"{consolidated}, not on this rank; call it there, or consolidate_state_dict(to=None)"
        )
    for idx, st in consolidated.items():
        if not sd["state"].get(idx):
            sd["state"][idx] = st
    return sd


def upgrade_saved_groups(
    saved_groups: list[dict[str, Any]],
    groups: list[dict[str, Any]],
    routed: list[list[RoutedParam]],
    user_group: list[int],
) -> list[dict[str, Any]]:
    """Saved param groups in this version's form: one group per tensor role of each user group,
    the optimizer kind under ``"optimizer"``.

    Version 0.1.0 wrote one group per *optimizer* of each user group (``"role": "tail"`` held the
    tail and the ``rows`` tensors together, in the user's order) and no ``"optimizer"`` key. Such
    a save is split here by the live groups: ``routed[i]`` are the routed parameters of live group
    ``i`` and ``user_group[i]`` the user group it came from, so the saved keys of an old group
    are matched to the live parameters in the user's order (``RoutedParam.index``). Saves that
    carry ``"optimizer"`` are returned as they are; a save that does not split this way is
    returned as it is too, for :func:`check_saved_groups` to refuse with its counts."""
    if any("optimizer" in sg for sg in saved_groups):
        return saved_groups
    upgraded: list[dict[str, Any]] = []
    old = iter(saved_groups)
    for u in dict.fromkeys(user_group):  # user groups in order
        mine = [i for i, ug in enumerate(user_group) if ug == u]
        for kind in dict.fromkeys(groups[i]["optimizer"] for i in mine):  # matrix first, as 0.1.0 wrote
            sg = next(old, None)
            members = [i for i in mine if groups[i]["optimizer"] == kind]
            merged = sorted((rp.index, i, j) for i in members for j, rp in enumerate(routed[i]))
            if sg is None or len(sg["params"]) != len(merged):
                return saved_groups
            where = {(i, j): n for n, (_, i, j) in enumerate(merged)}
            options = {k: v for k, v in sg.items() if k not in ("params", "param_names", "role")}
            for i in members:
                picks = [where[(i, j)] for j in range(len(routed[i]))]
                new = {**options, "params": [sg["params"][n] for n in picks]}
                if "param_names" in sg:
                    new["param_names"] = [sg["param_names"][n] for n in picks]
                new["role"], new["optimizer"] = groups[i]["role"], groups[i]["optimizer"]
                upgraded.append(new)
    return saved_groups if next(old, None) is not None else upgraded


def check_saved_groups(groups: list[dict[str, Any]], saved_groups: list[dict[str, Any]]) -> None:
    """Refuse saved param groups that do not match the optimizer's (count, sizes, roles)."""
    if len(groups) != len(saved_groups):
        raise ValueError(
            f"loaded state dict has {len(saved_groups)} parameter groups, the optimizer "
            f"{len(groups)}; build OwnerRoutedOptimizer with the same param groups and roles"
        )
    for i, (g, sg) in enumerate(zip(groups, saved_groups, strict=True)):
        if len(g["params"]) != len(sg["params"]):
            raise ValueError(
                f"loaded state dict's parameter group {i} has {len(sg['params'])} "
                f"parameters, the optimizer's {len(g['params'])}"
            )
        if "role" in sg and sg["role"] != g.get("role"):
            raise ValueError(
                f"loaded state dict's parameter group {i} has role {sg['role']!r}, the optimizer's {g.get('role')!r}"
            )


def local_state(
    saved_state: dict[Any, Any],
    groups: list[dict[str, Any]],
    saved_groups: list[dict[str, Any]],
    routed: list[RoutedParam],
    places: PlaceOf,
    current: Mapping[torch.Tensor, Any],
    label: Callable[[RoutedParam], str],
) -> dict[int, dict[str, Any]]:
    """This rank's state of each parameter it updates, by ``id(RoutedParam)``, from a saved
    state dict (``current`` the optimizer's state now, read in place when DCP wrote into it;
    ``label(rp)`` names a parameter). Raises ``KeyError`` naming the trainable parameters this
    rank updates whose state is missing while others of their param group have state."""
    by_param = {id(rp.param): rp for rp in routed}
    pairs = [
        (key, param, any(saved_state.get(k) for k in sg["params"]))
        for sg, g in zip(saved_groups, groups, strict=True)
        for key, param in zip(sg["params"], g["params"], strict=True)
    ]
    saved_state = _whole_where_cut_elsewhere(saved_state, [(k, by_param[id(p)]) for k, p, _ in pairs], places)
    loaded: dict[int, dict[str, Any]] = {}
    missing: list[str] = []
    for key, param, group_has_state in pairs:
        rp = by_param[id(param)]
        if rp.proxy is None:
            continue
        st = saved_state.get(key)
        if not st:
            if param.requires_grad and group_has_state:
                missing.append(key if isinstance(key, str) else label(rp))
            continue
        now = current.get(param, {})
        here = {k: _load_value(rp, places[id(rp)], k, v, now.get(k)) for k, v in st.items()}
        loaded[id(rp)] = {k: v for k, v in here.items() if v is not NOT_HELD}  # another owner's block
    if missing:
        raise KeyError(
            f"optimizer state dict has no state for {', '.join(repr(m) for m in missing)} "
            f"(which this rank updates) but has state for others of its param group; load a state dict "
            "saved from the whole optimizer (under DDP, after consolidate_state_dict())"
        )
    return loaded


def _whole_where_cut_elsewhere(
    saved: dict[Any, Any], keyed: list[tuple[Any, RoutedParam]], places: PlaceOf
) -> dict[Any, Any]:
    """State of owner-held tensors that arrives cut as ``torch.chunk`` rows (torch's
    ``set_optimizer_state_dict(full_state_dict=True)`` re-distributes full tensors with
    ``distribute_tensor``, which splits every ``Shard`` placement that way) made whole again:
    every rank gathers each such piece, in the state dict's order (collective, symmetric:
    every rank holds the same keys), and keeps its own part later as from a full tensor."""
    out = dict(saved)
    for key, rp in keyed:
        entry = saved.get(key)
        if not entry or not _held_elsewhere(places[id(rp)]):
            continue
        fixed = dict(entry)
        for k, v in entry.items():
            if isinstance(v, DTensor) and not is_owner_dtensor(v) and any(type(p) is Shard for p in v.placements):
                fixed[k] = v.full_tensor()
        out[key] = fixed
    return out


def _load_value(rp: RoutedParam, place: StatePlace | None, key: str, value: Any, current: Any) -> Any:
    """This rank's copy of one saved state value (no copy when DCP already wrote it in place)."""
    mine = local(place, key, value, _what(rp, key))
    if not isinstance(mine, torch.Tensor):
        return deepcopy(mine)
    mine = mine.detach()
    if (
        isinstance(current, torch.Tensor)
        and current.dtype == mine.dtype
        and current.shape == mine.shape
        and current.device == mine.device
        and (current.numel() == 0 or current.data_ptr() == mine.data_ptr())
    ):
        return current  # read in place through a piece of this optimizer's own state_dict()
    assert rp.proxy is not None
    device = mine.device if key == "step" else rp.proxy.device
    return mine.to(device=device, copy=True)


def restore_groups(groups: list[dict[str, Any]], saved_groups: list[dict[str, Any]], needed: list[set[str]]) -> None:
    """Set every param group's values to the saved ones, in place (the child groups read them
    there), keeping the live ``params`` and, where the save has none, the live ``param_names``,
    ``role``, ``optimizer`` and values of the keys in ``needed[i]`` (the hyperparameters group ``i``'s child
    optimizer reads: a state dict saved by an older version may lack one, as torch's
    ``__setstate__`` fills defaults in for)."""
    for g, sg, keys in zip(groups, saved_groups, needed, strict=True):
        live = {k: v for k, v in g.items() if k not in sg and (k in keys or k in ("param_names", "role", "optimizer"))}
        params_ = g["params"]
        g.clear()
        g.update(sg)
        g["params"] = params_
        g.update(live)  # saved names win, as in torch


def agreed_local_state(
    state_dict: Mapping[str, Any],
    groups: list[dict[str, Any]],
    routed: list[RoutedParam],
    user_group: list[int],
    places: PlaceOf,
    current: Mapping[torch.Tensor, Any],
    label: Callable[[RoutedParam], str],
    process_group: Any,
) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]]]:
    """``load_state_dict``'s checks, agreed by every rank before any of them changes anything:
    the saved groups in this version's form (:func:`upgrade_saved_groups`), checked
    (:func:`check_saved_groups`), and this rank's state (:func:`local_state`). A refusal on any
    rank (a param group that does not match, state missing for a parameter one rank updates)
    is raised on every rank of the optimizer's groups (``agreement.optimizer_groups``), so no
    rank loads while another refuses; returns (saved groups, this rank's state)."""
    by_param = {id(rp.param): rp for rp in routed}
    error: Exception | None = None
    saved_groups: list[dict[str, Any]] = []
    loaded: dict[int, dict[str, Any]] = {}
    try:
        saved_groups = upgrade_saved_groups(
            deepcopy(state_dict["param_groups"]),
            groups,
            [[by_param[id(p)] for p in g["params"]] for g in groups],
            user_group,
        )
        check_saved_groups(groups, saved_groups)
        loaded = local_state(state_dict["state"], groups, saved_groups, routed, places, current, label)
    except (KeyError, ValueError, TypeError) as exc:
        error = exc
    agree_verdict(error, optimizer_groups([rp.param for rp in routed], process_group), who="load_state_dict")
    return saved_groups, loaded
