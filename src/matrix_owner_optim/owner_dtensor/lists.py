"""List operators on owner-layout tensors (``_foreach_*``, ``_fused_*``, ``_amp_foreach_*``), element
by element (DESIGN.md, "The representation", has the rule): elements of one layout run on their
local pieces in one kernel call (a 2D element keeps its spec; a ``_foreach_norm`` element is a
partial norm), the others on whole values with written lists' pieces back; GradScaler's
``found_inf`` is max-reduced over every mesh the gradients are split on, as DTensor's handler
does, and under HSDP over the replicate group too (``replica_sync.py``), so every rank skips the
same step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from .. import comm
from .decisions import learn_list
from .dispatch import OwnerDTensorType, full_of, lay_out_like, write_piece
from .ops import OperatorInfo, norm_partial
from .placement import same_layout
from .two_dim import is_2d, norm_2d, wrap_2d

aten = torch.ops.aten

__all__ = ["run_lists"]

_GATHERED_ALWAYS = frozenset({"_foreach_max"})
_FOUND_INF = "_amp_foreach_non_finite_check_and_unscale_"


def _is_list(a: Any) -> bool:
    return isinstance(a, (list, tuple)) and all(t is None or isinstance(t, torch.Tensor) for t in a) and len(a) > 0


def _element_ref(elem: list[Any]) -> tuple[bool, Any]:
    """Whether an element runs on local pieces, and its layout reference (a DTensor or None)."""
    ref = next((t for t in elem if isinstance(t, DTensor)), None)
    if ref is None:
        return True, None
    for t in elem:
        if t is None:
            continue
        if isinstance(t, DTensor):
            if not same_layout(t, ref, holders=False) or any(isinstance(p, Partial) for p in t.placements):
                return False, ref
        elif t.dim() > 0:
            return False, ref
    return True, ref


def _scalar_value(a: Any) -> Any:
    """A non-list argument as the same local value on every rank (a 0-dim DTensor's whole value)."""
    if isinstance(a, DTensor):
        return full_of(a) if not all(isinstance(p, Replicate) for p in a.placements) else a._local_tensor
    return a


def _wrap_local(cls: OwnerDTensorType, t: torch.Tensor, ref: Any, norm: Any) -> Any:
    """A local element result in its element's layout (a partial norm for ``_foreach_norm``)."""
    if ref is None:
        return t
    if isinstance(ref, cls) and is_2d(ref):
        return norm_2d(t, ref, norm) if norm is not None else wrap_2d(cls, t, ref)
    if norm is not None:
        if isinstance(ref, cls) and isinstance(ref.placement, Replicate):
            return cls.make(t, ref.device_mesh, Replicate(), ())
        if isinstance(ref, cls):  # one holder's (zeros elsewhere) or row blocks' partial norm
            local = t if ref.holder is None or ref.is_holder else torch.zeros_like(t)
            return cls.make(local, ref.device_mesh, norm, (), holder=ref.holder)
        if all(isinstance(p, Replicate) for p in ref.placements):
            return DTensor.from_local(t, ref.device_mesh, ref.placements, run_check=False)
        return DTensor.from_local(t, ref.device_mesh, [norm], run_check=False)
    if isinstance(ref, cls):
        return cls.make(t, ref.device_mesh, ref.placement, ref.shape, holder=ref.holder)
    return DTensor.from_local(t, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape, stride=ref.stride())


def run_lists(cls: OwnerDTensorType, func: Any, args: tuple, kwargs: dict, info: OperatorInfo) -> Any:
    """Run a list operator element by element (see the module docstring)."""
    base = func._schema.name.split("::")[-1]
    lists = [i for i, a in enumerate(args) if _is_list(a)]
    if not lists:
        raise NotImplementedError(f"{func} on owner-layout tensors with no tensor list argument")
    n = len(args[lists[0]])
    if any(len(args[i]) != n for i in lists):
        raise RuntimeError(f"{func}: tensor lists of different lengths {[len(args[i]) for i in lists]}")
    others_ok = all(not isinstance(a, DTensor) or a.dim() == 0 for i, a in enumerate(args) if i not in lists)
    others_ok = others_ok and all(not isinstance(v, DTensor) or v.dim() == 0 for v in kwargs.values())
    is_norm = base == "_foreach_norm"
    norm = None
    if is_norm:
        p = args[1] if len(args) > 1 and isinstance(args[1], (int, float)) else kwargs.get("ord", 2)
        norm = norm_partial(aten.linalg_vector_norm.default, (None, p), {}) or Partial("sum")
    local_js, gathered_js, refs = [], [], []
    for j in range(n):
        ok, ref = _element_ref([args[i][j] for i in lists])
        refs.append(ref)
        if ok and others_ok and base not in _GATHERED_ALWAYS and not (is_norm and norm is None):
            local_js.append(j)
        else:
            gathered_js.append(j)
    results: list[Any] = [None] * n
    returns_list = False
    if local_js:
        out = _run_local(func, args, kwargs, lists, local_js, is_norm)
        if out is not None:
            returns_list = True
            for j, t in zip(local_js, out, strict=True):
                results[j] = _wrap_local(cls, t, refs[j], norm)
    for j in gathered_js:
        out = _run_gathered(cls, func, args, kwargs, lists, j, refs[j], info)
        if out is not None:
            returns_list = True
            results[j] = out
    if base == _FOUND_INF:
        _agree_found_inf(args, kwargs, lists)
    elif len(local_js) == n:  # every element local: the decision is recorded (decisions.py)
        learn_list(cls, func, args, kwargs, results if returns_list else None)
    if returns_list:
        return results
    return None


def _unwrap_local(t: Any, zero_if_empty: bool) -> Any:
    if isinstance(t, DTensor):
        local = t._local_tensor
        if zero_if_empty and local.numel() == 0:  # the norm of nothing held: 0, the identity
            return local.new_zeros(1)
        return local
    return t


def _run_local(func: Any, args: tuple, kwargs: dict, lists: list[int], js: list[int], is_norm: bool) -> Any:
    largs = [[_unwrap_local(a[j], is_norm) for j in js] if i in lists else _scalar_value(a) for i, a in enumerate(args)]
    return func(*largs, **{k: _scalar_value(v) for k, v in kwargs.items()})


def _run_gathered(
    cls: OwnerDTensorType,
    func: Any,
    args: tuple,
    kwargs: dict,
    lists: list[int],
    j: int,
    ref: Any,
    info: OperatorInfo,
) -> Any:
    """Element ``j`` alone on whole values; written list elements get their pieces back."""
    if func._schema.name.split("::")[-1] == "_foreach_copy_":  # the element is a copy_: its own rule
        dst, src = args[lists[0]][j], args[lists[1]][j]
        dst.copy_(src)
        return None
    fulls = {i: full_of(args[i][j]) for i in lists}
    fargs = [[fulls[i]] if i in lists else _scalar_value(a) for i, a in enumerate(args)]
    out = func(*fargs, **{k: _scalar_value(v) for k, v in kwargs.items()})
    for i in {w[0] for w in info.written} & set(lists):
        dst = args[i][j]
        if isinstance(dst, DTensor):
            write_piece(dst, fulls[i], func)
    if out is None or not isinstance(out, (list, tuple)):
        return None
    (t,) = out
    if ref is None:
        return t
    return lay_out_like(cls, ref, t) if isinstance(ref, cls) else t


def _agree_found_inf(args: tuple, kwargs: dict, lists: list[int]) -> None:
    """GradScaler's ``found_inf`` as the max over every mesh its gradients are split on (each
    rank checked its pieces only): every rank then skips, or takes, the same step."""
    found_inf = args[1] if len(args) > 1 else kwargs["found_inf"]
    groups: list[Any] = []
    for t in args[lists[0]]:
        if isinstance(t, DTensor) and not all(isinstance(p, Replicate) for p in t.placements):
            for dim in range(t.device_mesh.ndim):
                g = t.device_mesh.get_group(dim)
                if all(g is not seen for seen in groups):
                    groups.append(g)
    # HSDP: the shard group's max, then the replicas' (a gradient of one replica's global owner
    # is on no rank of the other replicas' shard groups). Every gradient of a replicated tree
    # links to its tree, and every replica holds some (its tail), so all replicas issue this.
    for t in args[lists[0]]:
        link = getattr(t, "_tree", None)
        tree = None if link is None else link.tree
        replicas = None if tree is None else tree.replicas
        if replicas is not None and replicas.size > 1 and all(replicas.group is not seen for seen in groups):
            groups.append(replicas.group)
    for g in groups:
        comm.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=g, name="found_inf")
