"""The two optimizers (matrix and tail) and the views through which the parent reads theirs:
hyperparameters live in the parent's groups (:class:`ChildGroup`), state in the children's
(:class:`ChildState`); nothing is copied either way.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any, NoReturn

import torch

from ..planning.catalog import resolve_cost
from ..planning.cost import CostModel
from .layout_of import layout_of
from .layouts import LayoutConfig, UpdateLayout
from .registry import ChosenOptimizer, OptimizerFactory, group_flags
from .routing import RoutedParam

__all__ = ["ChildGroup", "ChildState", "RoleOptimizer", "first_nonfinite", "probe_defaults"]

# Keys a child group keeps for itself; every other key is the parent group's.
_OWN_KEYS = frozenset({"params", "param_names", "role", "optimizer"})
_MISSING = object()


class ChildGroup(dict):  # type: ignore[type-arg]
    """A child optimizer's param group: its own ``params`` (and ``_OWN_KEYS``); every other key
    is the parent group ``owner.param_groups[index]``'s (``torch.optim.Optimizer.add_param_group``
    takes a dict subclass). A copy (``dict(group)``, pickling) is a plain ``dict`` of the values.
    """

    __slots__ = ("_owner", "_index")

    def __init__(self, owner: torch.optim.Optimizer, index: int, params: list[torch.Tensor]) -> None:
        super().__init__(params=list(params))
        self._owner = owner
        self._index = index

    @property
    def parent(self) -> dict[str, Any]:
        """The parent param group whose values this group reads and writes."""
        return self._owner.param_groups[self._index]

    def __getitem__(self, key: str) -> Any:
        return dict.__getitem__(self, key) if key in _OWN_KEYS else self.parent[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key in _OWN_KEYS:
            dict.__setitem__(self, key, value)
        else:
            self.parent[key] = value

    def __delitem__(self, key: str) -> None:
        if key in _OWN_KEYS:
            dict.__delitem__(self, key)
        else:
            del self.parent[key]

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) if key in _OWN_KEYS else key in self.parent

    def __iter__(self) -> Iterator[str]:
        yield from dict.__iter__(self)
        yield from (k for k in self.parent if k not in _OWN_KEYS)

    def __reversed__(self) -> Iterator[str]:
        return reversed(list(self))

    def __len__(self) -> int:
        return dict.__len__(self) + sum(1 for k in self.parent if k not in _OWN_KEYS)

    # Mapping's own implementations, over the methods above (dict's would bypass them)
    keys, values, items = Mapping.keys, Mapping.values, Mapping.items  # type: ignore[assignment]
    get, __eq__ = Mapping.get, Mapping.__eq__  # type: ignore[assignment]
    setdefault, update = MutableMapping.setdefault, MutableMapping.update  # type: ignore[assignment]

    def pop(self, key: str, default: Any = _MISSING) -> Any:  # type: ignore[override]
        if key in self:
            value = self[key]
            del self[key]
            return value
        if default is _MISSING:
            raise KeyError(key)
        return default

    def popitem(self) -> NoReturn:
        raise TypeError("a child optimizer's param group has no last item to pop; pop a key by name")

    def clear(self) -> None:
        for key in list(self):
            del self[key]

    def copy(self) -> dict[str, Any]:  # type: ignore[override]
        return {k: self[k] for k in self}

    def __or__(self, other: Any) -> dict[str, Any]:  # type: ignore[override]
        return self.copy() | dict(other)

    def __ror__(self, other: Any) -> dict[str, Any]:  # type: ignore[override]
        return dict(other) | self.copy()

    def __ior__(self, other: Any) -> ChildGroup:  # type: ignore[override,misc]
        self.update(other)
        return self

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self.copy())

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (self.copy(),))


def probe_defaults(
    factory: OptimizerFactory, options: Mapping[str, Any], what: str
) -> tuple[dict[str, Any], torch.optim.Optimizer]:
    """The hyperparameters ``factory`` fills into a group, and the probe optimizer it built."""
    probe_param = torch.nn.Parameter(torch.zeros(2, 2))
    flags = group_flags(factory, what)  # a flag its groups must carry (pytorch-optimizer's Muon family)
    try:
        probe = factory([{"params": [probe_param], **flags}] if flags else [probe_param], **options)
    except (TypeError, ValueError) as exc:  # an unknown keyword, or a value the optimizer refuses
        raise ValueError(
            f"{what}_options {dict(options)!r} are not accepted by {factory!r}: {exc}. Pass only "
            f"the keyword arguments that optimizer takes, with values it accepts"
        ) from exc
    if not isinstance(probe, torch.optim.Optimizer):
        raise TypeError(f"{what} factory {factory!r} returned {type(probe).__name__}, not a torch.optim.Optimizer")
    group = probe.param_groups[0]
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}, probe


def first_nonfinite(value: Any, *, allow_inf: bool) -> Any:
    """The first non-finite number in a hyperparameter value (numbers, CPU scalars, tuples), or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        number = float(value)
        if math.isnan(number) or (math.isinf(number) and not allow_inf):
            return value
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and value.device.type == "cpu" and value.is_floating_point():
            return first_nonfinite(float(value), allow_inf=allow_inf)
        return None
    if isinstance(value, (tuple, list)):
        for v in value:
            bad = first_nonfinite(v, allow_inf=allow_inf)
            if bad is not None:
                return bad
    return None


class RoleOptimizer:
    """One of the two optimizers (``matrix``, or ``tail`` for tail and ``rows`` tensors); which
    one is its key in ``OwnerRoutedOptimizer._kinds`` (``what`` only words errors).

    ``child`` (``factory(groups, **options)``) steps this rank's proxies (None while it has
    none); ``cost`` prices the plan (``planning.catalog.resolve_cost``); ``layouts`` holds the
    update layout of each kind that has some of the role's tensors.
    """

    def __init__(self, what: str, chosen: ChosenOptimizer, options: Mapping[str, Any] | None) -> None:
        self.name = chosen.name
        self.factory = chosen.factory
        self.options: dict[str, Any] = dict(options or {})
        self.defaults, probe = probe_defaults(self.factory, self.options, what)
        self.cost: CostModel = resolve_cost(chosen.spec, built=probe)  # the one rule, as configured
        self.child: torch.optim.Optimizer | None = None
        self.layouts: dict[type[UpdateLayout], UpdateLayout] = {}

    @property
    def infinite_ok(self) -> set[str]:
        """Keys the optimizer itself defaults to an infinity (a threshold that is off), unless set."""
        return {k for k, v in self.defaults.items() if isinstance(v, float) and math.isinf(v) and k not in self.options}

    def reset(self) -> None:
        """Forget the child and the layouts (before routing swapped parameters anew)."""
        self.child = None
        self.layouts = {}

    def route(self, rps: list[RoutedParam], config: LayoutConfig) -> None:
        """Give ``rps`` to the layouts of their kinds (which set each one's proxy and owner)."""
        by_layout: dict[type[UpdateLayout], list[RoutedParam]] = {}
        for rp in rps:
            by_layout.setdefault(layout_of(rp.param), []).append(rp)
        for cls, entries in by_layout.items():
            if cls not in self.layouts:
                self.layouts[cls] = cls(config)
            self.layouts[cls].add(entries)

    def attach(self, owner: torch.optim.Optimizer, index: int, rps: list[RoutedParam]) -> None:
        """Give the child a :class:`ChildGroup` of the proxies this rank updates of group ``index``."""
        local = [rp.proxy for rp in rps if rp.proxy is not None]
        if not local:
            return
        group = ChildGroup(owner, index, local)
        if self.child is None:
            self.child = self.factory([group], **self.options)
        else:
            self.child.add_param_group(group)


class ChildState(MutableMapping):  # type: ignore[type-arg]
    """The parent's ``state``: ``state[param]`` is the child's state of its proxy, where the
    child keeps it (empty until a child makes state, as torch's). ``slots``: id(param) -> routing."""

    def __init__(self, slots: dict[int, tuple[RoutedParam, RoleOptimizer]]) -> None:
        self.slots = slots

    def _where(self, param: torch.Tensor) -> tuple[dict[torch.Tensor, Any], torch.Tensor]:
        rp, ropt = self.slots.get(id(param), (None, None))
        if rp is None or ropt is None or rp.proxy is None or ropt.child is None:
            raise KeyError(param)  # not stepped on this rank
        return ropt.child.state, rp.proxy

    def __getitem__(self, param: torch.Tensor) -> Any:
        state, proxy = self._where(param)
        if proxy not in state:
            raise KeyError(param)
        return state[proxy]

    def __setitem__(self, param: torch.Tensor, value: Any) -> None:
        state, proxy = self._where(param)
        state[proxy] = value

    def __delitem__(self, param: torch.Tensor) -> None:
        state, proxy = self._where(param)
        del state[proxy]

    def __iter__(self) -> Iterator[torch.Tensor]:
        for rp, ropt in list(self.slots.values()):
            if rp.proxy is not None and ropt.child is not None and rp.proxy in ropt.child.state:
                yield rp.param

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return repr(dict(self.items()))
