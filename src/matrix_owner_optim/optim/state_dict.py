"""``OwnerRoutedOptimizer``'s state dicts: torch's layout, each value its :mod:`.state_place`
entry, every parameter listed on every rank (empty pieces for state held elsewhere) so DCP
reshards it (DESIGN.md, "State dicts and checkpoints").
"""

from __future__ import annotations

from collections.abc import Mapping
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
    """torch's state dict ``sd`` with each value as its entry (:func:`.state_place.entry`) and the
    same keys on every rank (collective over ``group`` where some state is held by one rank)."""
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
    """Give this rank an entry of empty pieces for every state another rank alone holds, so every
    rank's state dict has the same keys (one all-gather of the key specs)."""
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
    """``sd`` completed with :func:`gather_owner_state`'s result; raises where there is none here."""
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
    """Saved param groups in this version's form (one group per tensor role, ``"optimizer"``).

    Version 0.1.0 wrote one group per optimizer of each user group; such a save is split by the
    live groups (``routed[i]``, from user group ``user_group[i]``) in the user's order. A save
    that does not split is returned as it is, for :func:`check_saved_groups` to refuse."""
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
) -> dict[int, dict[str, Any]]:
    """This rank's state of each parameter it updates, by ``id(RoutedParam)`` (``current``: read in
    place when DCP wrote into it); ``KeyError`` names state missing while its group has some."""
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
                missing.append(key if isinstance(key, str) else rp.fqn)
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
    """Owner-held state that arrives as ``Shard`` rows (``set_optimizer_state_dict(full_state_dict=
    True)`` redistributes that way) made whole again (collective, in the state dict's order)."""
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
    """Set every param group's values to the saved ones in place, keeping the live ``params`` and,
    where the save lacks them, ``param_names``, ``role``, ``optimizer`` and the keys ``needed[i]``."""
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
    process_group: Any,
) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]]]:
    """``load_state_dict``'s checks, agreed by every rank before any changes anything."""
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
        loaded = local_state(state_dict["state"], groups, saved_groups, routed, places, current)
    except (KeyError, ValueError, TypeError) as exc:
        error = exc
    agree_verdict(error, optimizer_groups([rp.param for rp in routed], process_group), who="load_state_dict")
    return saved_groups, loaded
