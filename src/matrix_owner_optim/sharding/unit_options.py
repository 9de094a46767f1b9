"""What a unit is set to: the options the user sets on its module and the dtype it computes in.

:class:`UnitOptions` is the record a ``fully_shard`` module's ``set_*`` methods write and the
unit and its context read when they act (so a setter never needs the plan);
:func:`compute_dtype` and :func:`one_compute_dtype` turn a ``MixedPrecisionPolicy`` and the
parameters' dtypes into the one dtype a unit gathers and computes in (planning refuses a mix
before any unit exists, ``build.py``; the unit checks again when it is rebuilt).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["UnitOptions", "compute_dtype", "one_compute_dtype"]


def compute_dtype(mp_policy: Any, dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter of ``dtype`` computes and is gathered in: the policy's
    ``param_dtype`` for floating-point parameters, else its own."""
    param_dtype = getattr(mp_policy, "param_dtype", None)
    return param_dtype if (param_dtype is not None and dtype.is_floating_point) else dtype


def one_compute_dtype(unit: int, dtypes: dict[str, torch.dtype]) -> torch.dtype | None:
    """The one compute dtype of a unit's parameters (``fqn -> dtype``; one all-gather buffer),
    None for a unit without parameters; a mix is refused, naming every parameter."""
    if len(set(dtypes.values())) > 1:
        names = ", ".join(f"{fqn}: {dt}" for fqn, dt in dtypes.items())
        raise NotImplementedError(
            f"fully_shard unit {unit} mixes parameter dtypes ({names}); give the unit one "
            "dtype or set MixedPrecisionPolicy(param_dtype=...) so all compute in one dtype"
        )
    return next(iter(dtypes.values()), None)


@dataclass(eq=False)
class UnitOptions:
    """What the user set on a ``fully_shard`` module (its ``set_*`` methods record here; the
    unit and the context read it when they act, so a setter never needs the plan)."""

    reshard_after_forward: bool
    requires_gradient_sync: bool = True
    reshard_after_backward: bool = True
    gradient_divide_factor: float | None = None  # None: the data-parallel size (the average)
    forward_prefetch: list[nn.Module] | None = None  # explicit targets; None: automatic
    backward_prefetch: list[nn.Module] | None = None
