"""FSDP2's ``ignored_params``: parameters ``fully_shard`` leaves exactly as they are, marked on
the parameter itself so every step can skip it without knowing the call.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..owner_dtensor import OwnerDTensor

__all__ = ["is_ignored", "mark_ignored"]

_IGNORED_ATTR = "_moo_fsdp_ignored"


def mark_ignored(modules: list[nn.Module], ignored_params: Iterable[Any] | None) -> None:
    """Mark ``ignored_params``, each a parameter of one of ``modules``, to be left alone."""
    if ignored_params is None:
        return
    if isinstance(ignored_params, torch.Tensor):
        raise TypeError("fully_shard(ignored_params=...) takes a set of parameters, not one tensor; wrap it in a set")
    mine = {id(p) for m in modules for p in m.parameters()}
    params = list(ignored_params)
    for p in params:  # all checked before any is marked
        if not isinstance(p, nn.Parameter):
            raise TypeError(f"fully_shard(ignored_params=...) holds a {type(p).__name__}; give nn.Parameters")
        if id(p) not in mine:
            raise ValueError(
                f"fully_shard(ignored_params=...): a parameter of shape {tuple(p.shape)} is not a parameter "
                "of the module(s) passed to this call; list only their parameters"
            )
        if isinstance(p, OwnerDTensor):
            raise ValueError(
                f"fully_shard(ignored_params=...): a parameter of shape {tuple(p.shape)} was already "
                "converted by an earlier fully_shard call on a module inside this one; pass it in "
                "ignored_params of that call (the innermost module holding it)"
            )
    for p in params:
        setattr(p, _IGNORED_ATTR, True)


def is_ignored(p: Any) -> bool:
    """True for a parameter passed in ``fully_shard(ignored_params=...)``."""
    return bool(getattr(p, _IGNORED_ATTR, False))
