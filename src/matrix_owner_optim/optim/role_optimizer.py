"""The two optimizers (matrix and tail), and the child groups and state through which the
parent reads and writes theirs.

``OwnerRoutedOptimizer`` splits every user param group into one group per tensor role
(``"role"``), each stepped by one of two optimizers (``"optimizer"``: ``matrix``, or ``tail`` for
``tail`` and ``rows`` tensors), each one :class:`RoleOptimizer`. A child's group is a
:class:`ChildGroup` over its parent group (hyperparameters have one home, the parent's); the
parent's ``state`` is a :class:`ChildState` over the children's (state has one home, the
child's). Nothing is copied either way.
"""

from __future__ import annotations

import math
from collections.abc import ItemsView, Iterator, KeysView, Mapping, MutableMapping, ValuesView
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
    """A child optimizer's param group: its own ``params``; every other key is the parent's.

    ``owner.param_groups[index]`` is the parent group. Reads, writes, ``in``, iteration,
    ``get``/``setdefault``/``pop``/``update`` and the views go to the parent for every key but
    ``params`` (and ``param_names``/``role``/``optimizer``, which the parent keeps for its own
    parameters), so a torch optimizer handed this group (``torch.optim.Optimizer.add_param_group`` accepts a
    ``dict`` subclass) sees one source of truth. A copy (``dict(group)``, ``copy``, pickling)
    is a plain ``dict`` of the current values.
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

    def keys(self) -> KeysView[str]:  # type: ignore[override]
        return KeysView(self)

    def values(self) -> ValuesView[Any]:  # type: ignore[override]
        return ValuesView(self)

    def items(self) -> ItemsView[str, Any]:  # type: ignore[override]
        return ItemsView(self)

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        return self[key] if key in self else default

    def setdefault(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        if key not in self:
            self[key] = default
        return self[key]

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

    def update(self, other: Any = (), /, **kwargs: Any) -> None:  # type: ignore[override]
        pairs = other.items() if isinstance(other, Mapping) else other
        for key, value in [*pairs, *kwargs.items()]:
            self[key] = value

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

    def __eq__(self, other: object) -> bool:
        return self.copy() == (other.copy() if isinstance(other, ChildGroup) else other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self.copy())

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (self.copy(),))


def probe_defaults(
    factory: OptimizerFactory, options: Mapping[str, Any], what: str
) -> tuple[dict[str, Any], torch.optim.Optimizer]:
    """The hyperparameters ``factory`` fills into a group, and the optimizer it built to tell
    (on a probe tensor, so that its configured ``cost_model`` can price the plan)."""
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
    """The first non-finite number in a hyperparameter value (a number, a CPU scalar tensor,
    or a tuple/list of them such as ``betas``), or None."""
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
    """One of the two optimizers (``matrix``, or ``tail`` for tail and ``rows`` tensors). Which
    one it is, is its key in the optimizer (``OwnerRoutedOptimizer._kinds``), not a fact it holds;
    ``what`` (``"matrix"``, ``"tail"``) only words its construction errors.

    Attributes:
        name: the optimizer as the user named it (reports, error messages).
        factory, options: what builds the child: ``factory(groups, **options)``.
        defaults: the hyperparameters the factory fills into a group (every parent group of
            this kind starts with them).
        cost: what the planner charges per tensor (``planning.catalog.resolve_cost`` of the
            optimizer as given and as configured: a configured Shampoo's blocks count).
        child: the optimizer stepping this rank's proxies (None while this rank updates
            none of the role's tensors).
        layouts: the update layout of each kind that holds some of the role's tensors.
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
        """Keys whose optimizer itself defaults to an infinity (a threshold that is off), unless
        the user set them."""
        return {k for k, v in self.defaults.items() if isinstance(v, float) and math.isinf(v) and k not in self.options}

    def reset(self) -> None:
        """Forget the child and the layouts (before routing swapped parameters anew)."""
        self.child = None
        self.layouts = {}

    def route(self, rps: list[RoutedParam], config: LayoutConfig) -> None:
        """Give ``rps`` (tensors of this role) to the layouts of their kinds, which set each
        one's proxy and owner."""
        by_layout: dict[type[UpdateLayout], list[RoutedParam]] = {}
        for rp in rps:
            by_layout.setdefault(layout_of(rp.param), []).append(rp)
        for cls, entries in by_layout.items():
            if cls not in self.layouts:
                self.layouts[cls] = cls(config)
            self.layouts[cls].add(entries)

    def attach(self, owner: torch.optim.Optimizer, index: int, rps: list[RoutedParam]) -> None:
        """Give the child the proxies this rank updates of parent group ``index`` (built on the
        first such group): one :class:`ChildGroup` over that parent group."""
        local = [rp.proxy for rp in rps if rp.proxy is not None]
        if not local:
            return
        group = ChildGroup(owner, index, local)
        if self.child is None:
            self.child = self.factory([group], **self.options)
        else:
            self.child.add_param_group(group)

    def before_step(self) -> None:
        for layout in self.layouts.values():
            layout.before_step()

    def step(self) -> None:
        if self.child is not None:
            self.child.step()

    def after_step(self) -> None:
        for layout in self.layouts.values():
            layout.after_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for layout in self.layouts.values():
            layout.zero_grad(set_to_none)


class ChildState(MutableMapping):  # type: ignore[type-arg]
    """The parent optimizer's ``state``: ``state[param]`` is the child's state of the param's
    proxy, read and written where the child keeps it, so nothing is copied or re-linked after a
    step. Empty until a child makes state, as torch's is (``get_optimizer_state_dict`` relies on
    that to initialise it). ``slots``: id(param) -> its routing and its optimizer."""

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
