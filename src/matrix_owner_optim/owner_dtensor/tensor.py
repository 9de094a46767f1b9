"""``OwnerDTensor``: the DTensor subclass every owner-layout tensor is, and its operators
(DESIGN.md, "The representation")."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, TypeGuard

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._ops._math_ops import _NormPartial
from torch.utils import _foreach_utils

from .. import comm
from ..planning.metadata import chunk_row_range
from ..tensors import TreeLink
from .assign import assign_data
from .base import OwnerTensorBase
from .dcp import DcpChunks
from .decisions import LEARNABLE_RULES, MISS, fast_call, learn
from .dispatch import local_rank, run_rules
from .lists import run_lists
from .ops import OpClass, operator_info
from .placement import (
    OwnerShard,
    as_bytes,
    contiguous_stride,
    gather_ranges,
    interned,
    owned_ranges,
    spec_for,
    spec_piece,
)
from .two_dim import NOT_LOCAL, full_value_2d, local_2d, spec_2d

aten = torch.ops.aten

__all__ = ["OwnerDTensor", "as_owner_dtensor", "is_owner_dtensor", "like_layout", "mesh_of_group"]


def is_owner_dtensor(t: Any) -> TypeGuard[OwnerDTensor]:
    return isinstance(t, OwnerDTensor)


def as_owner_dtensor(value: Any) -> Any:
    """``value`` as an owner-layout DTensor when it is a plain ``DTensor`` carrying an owner
    placement (torch's state-dict utilities rebuild pieces with ``DTensor.from_local``);
    anything else as it is."""
    if (
        isinstance(value, DTensor)
        and not isinstance(value, OwnerDTensor)
        and len(value.placements) == 1
        and isinstance(value.placements[0], OwnerShard)
    ):
        return OwnerDTensor.make(
            value._local_tensor, value.device_mesh, value.placements[0], value.shape, value.stride()
        )
    return value


def like_layout(t: OwnerDTensor, local: torch.Tensor) -> OwnerDTensor:
    """``local`` (this rank's piece of a tensor laid out as ``t``) as an owner-layout DTensor.

    A piece of ``t``'s dtype on a contiguous ``t`` shares ``t``'s spec (specs are immutable):
    a gradient is wrapped this way once per parameter per step, and building a new
    ``DTensorSpec`` each time was most of the layout's own cost in a W=1 step."""
    return OwnerDTensor._wrap(local, spec_for(t._spec, local.dtype), t._holder)


# (id(group), device type) -> mesh, held weakly: a DeviceMesh keeps its process group alive, and
# a process-lifetime cache would keep gloo's worker threads running into interpreter teardown.
_MESHES: weakref.WeakValueDictionary[tuple[int, str], Any] = weakref.WeakValueDictionary()


def mesh_of_group(group: Any, device_type: str) -> Any:
    """The 1D ``DeviceMesh`` over ``group`` (no collective) owner-layout tensors live on."""
    from torch.distributed.device_mesh import DeviceMesh

    group = group if group is not None else dist.group.WORLD
    key = (id(group), device_type)
    mesh = _MESHES.get(key)
    if mesh is None or mesh.get_group() is not group:
        mesh = DeviceMesh.from_group(group, device_type)
        _MESHES[key] = mesh
    return mesh


def _plain_attribute(name: str) -> Any:
    """torch's ``Tensor.<name>`` read (and written, where torch writes it) with no subclass
    ``__torch_function__``."""
    torch_attribute = getattr(torch._C.TensorBase, name)

    def get(self: Any) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            return torch_attribute.__get__(self)

    def put(self: Any, value: Any) -> None:
        with torch._C.DisableTorchFunctionSubclass():
            torch_attribute.__set__(self, value)

    return property(get, put, doc=torch_attribute.__doc__)


class OwnerDTensor(DcpChunks, OwnerTensorBase):
    """A DTensor of the owner layout (see the module docstring).

    Built with :meth:`make` (no copy). The placement is ``OwnerShard``, ``Shard(0)`` or
    ``Replicate()``; 0-dim values held by one rank carry a ``Partial`` placement and their
    holder in ``_holder``. A parameter of a fixed ``fully_shard`` tree, its gradient and its
    ``detach()`` aliases link to their tree in ``_tree`` (HSDP's replicas are read there).
    """

    _tree: TreeLink | None = None  # the link to its tree of fully_shard calls (tensors.TreeLink)

    # -- construction -------------------------------------------------------------------------
    @staticmethod
    def make(
        local: torch.Tensor,
        mesh: Any,
        placement: Any,
        shape: Sequence[int],
        stride: Sequence[int] | None = None,
        *,
        requires_grad: bool = False,
        holder: int | None = None,
    ) -> OwnerDTensor:
        """Wrap ``local`` (this rank's piece) with ``placement`` for a global ``shape``; no copy."""
        shape = torch.Size(tuple(int(s) for s in shape))
        stride = tuple(stride) if stride is not None else contiguous_stride(shape)
        spec = interned(DTensorSpec(mesh, (placement,), tensor_meta=TensorMeta(shape, stride, local.dtype)))
        holder = holder if holder is not None else (placement.holder if isinstance(placement, OwnerShard) else None)
        return OwnerDTensor._wrap(local, spec, holder, requires_grad=requires_grad)

    @staticmethod
    def _wrap(
        local: torch.Tensor, spec: DTensorSpec, holder: int | None, *, requires_grad: bool = False
    ) -> OwnerDTensor:
        """``local`` under an existing ``spec`` (no copy, no new spec)."""
        r = DTensor.__new__(OwnerDTensor, local, spec, requires_grad=requires_grad)  # type: ignore[call-arg]
        assert isinstance(r, OwnerDTensor)
        r._holder = holder
        return r

    @staticmethod
    def owned(local: torch.Tensor, owner: int, mesh: Any, shape: Sequence[int]) -> OwnerDTensor:
        """A tensor held whole by ``owner``: ``local`` is the whole tensor there, empty elsewhere."""
        shape = tuple(int(s) for s in shape)
        me = local_rank(mesh)
        if len(shape) == 0:  # a scalar: the owner's value, a zero placeholder elsewhere (Partial sum)
            value = local.reshape(()) if me == owner else torch.zeros((), dtype=local.dtype, device=local.device)
            return OwnerDTensor.make(value, mesh, Partial("sum"), shape, holder=owner)
        if me == owner and tuple(local.shape) != shape:
            raise ValueError(f"the owner's piece has shape {tuple(local.shape)}, expected {shape}")
        if me != owner and local.numel() != 0:
            raise ValueError(f"a non-owner's piece must be empty, got shape {tuple(local.shape)}")
        if me != owner:
            local = local.reshape((0, *shape[1:]))
        return OwnerDTensor.make(local, mesh, OwnerShard(0, owned_ranges(shape[0], owner, mesh.size())), shape)

    @staticmethod
    def rows(local: torch.Tensor, mesh: Any, shape: Sequence[int]) -> OwnerDTensor:
        """``local`` rows of a tensor split as ``torch.chunk`` splits it (``Shard(0)``)."""
        return OwnerDTensor.make(local, mesh, Shard(0), shape)

    @staticmethod
    def tensor_parallel(
        local: torch.Tensor, mesh: Any, placements: tuple[Any, Any], shape: Sequence[int]
    ) -> OwnerDTensor:
        """``local`` (this rank's piece of a tensor-parallel slice) on the 2D (dp, tp) ``mesh``
        with ``placements`` (dp's: ``Replicate()`` before the plan, ``OwnerShard`` after; tp's
        as ``parallelize_module`` left it) for a global ``shape`` (``two_dim.py``)."""
        dp = placements[0]
        holder = dp.holder if isinstance(dp, OwnerShard) else None
        return OwnerDTensor._wrap(local, spec_2d(mesh, placements, shape, local.dtype), holder)

    @staticmethod
    def replicated(full: torch.Tensor, mesh: Any) -> OwnerDTensor:
        """Every rank holds ``full`` (a module's parameters until the plan is fixed)."""
        return OwnerDTensor.make(full, mesh, Replicate(), full.shape, full.stride())

    # -- layout -----------------------------------------------------------------------------------
    @property
    def placement(self) -> Any:
        return self._spec.placements[0]

    @property
    def holder(self) -> int | None:
        """The rank holding the whole value, or None (split rows, or replicated)."""
        return self._holder

    @property
    def is_holder(self) -> bool:
        return self._holder is not None and local_rank(self.device_mesh) == self._holder

    def relayout(self, local: torch.Tensor, placement: Any, *, holder: int | None = None) -> None:
        """Replace this object's piece and placement in place (the plan was fixed: the object a
        module and an optimizer hold stays the same, as FSDP2 re-points ``_local_tensor``)."""
        meta = self._spec.tensor_meta
        assert meta is not None
        placements = tuple(placement) if isinstance(placement, tuple) else (placement,)
        self._spec = interned(
            DTensorSpec(self.device_mesh, placements, tensor_meta=TensorMeta(meta.shape, meta.stride, local.dtype))
        )
        self._local_tensor = local
        dp = placements[0]
        self._holder = holder if holder is not None else (dp.holder if isinstance(dp, OwnerShard) else None)

    def local_rows(self) -> tuple[int, int] | None:
        """This rank's rows ``[start, stop)`` of dim 0 (None for a replicated or 0-dim tensor)."""
        p = self.placement
        if self.dim() == 0 or isinstance(p, (Replicate, Partial)):
            return None
        me = local_rank(self.device_mesh)
        if isinstance(p, OwnerShard):
            return p.ranges[me]
        return chunk_row_range(int(self.shape[0]), self.device_mesh.size(), me)

    def piece_of_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full tensor of this tensor's global shape (a view, no copy)."""
        if self.device_mesh.ndim == 2:  # the TP slice on the owner, nothing elsewhere
            return spec_piece(full, self)
        if isinstance(self.placement, Replicate):
            return full
        if self.dim() == 0:
            return full if self.is_holder else torch.zeros_like(full)
        rows = self.local_rows()
        assert rows is not None
        return full[rows[0] : rows[1]]

    def __getstate__(self) -> Any:
        """What ``torch.save`` and copies keep of the Python object: everything but the link to
        a live tree (a loaded tensor belongs to no tree)."""
        state = super().__getstate__()  # type: ignore[misc]  # (__dict__, slots): DTensor keeps its piece in slots
        if isinstance(state, tuple) and isinstance(state[0], dict) and "_tree" in state[0]:
            return ({k: v for k, v in state[0].items() if k != "_tree"}, *state[1:])
        return state

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"OwnerDTensor(shape={tuple(self.shape)}, dtype={self.dtype}, placement={self.placement!r}, "
            f"local={tuple(self._local_tensor.shape)})"
        )

    # -- gathering ----------------------------------------------------------------------------
    def _as_stock(self) -> DTensor:
        """The same local tensor and spec as a plain DTensor (for DTensor's own rules)."""
        return DTensor.__new__(
            DTensor,
            self._local_tensor,
            self._spec,  # type: ignore[call-arg]
            requires_grad=False,
        )

    def full_value(self) -> torch.Tensor:
        """The whole tensor on every rank, in new storage (a collective unless replicated): as
        DTensor's ``full_tensor()`` of a sharded tensor, changing the result never changes this
        tensor, nor the other way round, also on the rank that holds it. Under HSDP (read
        through the link to its tree) a parameter whose replicas' broadcast is deferred to the
        next forward lands it first."""
        if self.device_mesh.ndim == 2:  # a tensor-parallel slice held by its dp owner
            return full_value_2d(self)
        link = self._tree
        tree = None if link is None else link.tree
        replicas = None if tree is None else tree.replicas
        if link is None or tree is None or replicas is None or replicas.size <= 1:
            return self._full_in_group()
        tree.land_replicas()
        if link.held_on is None:
            return self._full_in_group()
        # HSDP optimizer state held on one replica (its global owner's): gathered in that
        # replica's shard group, then broadcast over the replicate group to the other replicas
        src = link.held_on
        if replicas.rank == src:
            full = self._full_in_group()
        else:
            full = torch.empty(tuple(self.shape), dtype=self.dtype, device=self._local_tensor.device)
        comm.broadcast(as_bytes(full), group_src=src, group=replicas.group, name="replica_full_state")
        return full

    def _full_in_group(self) -> torch.Tensor:
        """:meth:`full_value` over this tensor's own mesh (the shard group)."""
        p, local = self.placement, self._local_tensor
        group = self.device_mesh.get_group()
        if isinstance(p, Replicate) or self.device_mesh.size() == 1:
            return local.clone(memory_format=torch.contiguous_format)
        if isinstance(p, OwnerShard):
            return gather_ranges(local, p, tuple(self.shape), group)
        if isinstance(p, Partial) and self._holder is not None:
            full = local.clone() if self.is_holder else torch.empty((), dtype=local.dtype, device=local.device)
            comm.broadcast(as_bytes(full), group_src=self._holder, group=group, name="owner_full_tensor")
            return full
        if type(p) is Shard:  # torch.chunk's rows, gathered as explicit ranges
            n, W = int(self.shape[0]), self.device_mesh.size()
            ranges = [chunk_row_range(n, W, r) for r in range(W)]
            return gather_ranges(local, OwnerShard(0, ranges), tuple(self.shape), group)
        # a Partial of every rank (DTensor's rules on row blocks make these): DTensor reduces it
        return self._as_stock().full_tensor()

    def redistribute(
        self, device_mesh: Any = None, placements: Sequence[Any] | None = None, *, async_op: bool = False, **kwargs: Any
    ) -> DTensor:  # type: ignore[override]
        """To ``Replicate`` on its own mesh (what ``full_tensor()`` and state-dict gathering ask)."""
        mesh = self.device_mesh
        if (
            (device_mesh is not None and device_mesh is not mesh and device_mesh != mesh)
            or placements is None
            or len(placements) != mesh.ndim
            or not all(isinstance(p, Replicate) for p in placements)
        ):
            raise NotImplementedError(
                f"an owner-layout tensor redistributes only to Replicate() on its own mesh (full_tensor()); "
                f"got {placements}. Gather with full_tensor() and distribute the result"
            )
        full = self.full_value()
        return DTensor.from_local(full, mesh, placements, run_check=False, shape=self.shape, stride=self.stride())

    def full_tensor(self, *, grad_placements: Any = None) -> torch.Tensor:  # type: ignore[override]
        """The whole tensor on every rank, in new storage (see :meth:`full_value`)."""
        return self.full_value()

    def tolist(self) -> Any:  # type: ignore[override]
        """The whole value as Python numbers on every rank: a collective read, as ``item()``
        (torch refuses ``tolist()`` of tensor subclasses before any dispatch)."""
        return self.full_value().tolist()

    # -- attributes read every step: torch's own, with no __torch_function__ call (the hook has
    # nothing to do for them; zero_grad, clipping and norm logs read them per parameter per step)
    grad = _plain_attribute("grad")
    requires_grad = _plain_attribute("requires_grad")
    shape = _plain_attribute("shape")
    dtype = _plain_attribute("dtype")
    device = _plain_attribute("device")
    is_leaf = _plain_attribute("is_leaf")
    grad_fn = _plain_attribute("grad_fn")

    # -- operators --------------------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        """``out=`` given an owner-layout tensor: the result computed out of place, then copied
        into each ``out`` tensor (its piece, by the ``copy_`` rule). Composite operators' out
        kernels write their result below dispatch in ways no ``__torch_dispatch__`` sees, so
        this is the one place ``out=`` is exact by construction. Everything else passes through
        unchanged (DTensor's own ``__torch_function__`` is disabled)."""
        if kwargs:
            out = kwargs.get("out")
            if out is not None and any(isinstance(o, OwnerDTensor) for o in _as_tuple(out)):
                return _out_of_place(func, args, kwargs, out)
        elif type(func) is _METHOD_WRAPPER and func == _SET_DATA:  # t.data = value (assign.py)
            return assign_data(cls, args[0], args[1])
        with torch._C.DisableTorchFunctionSubclass():
            try:
                return func(*args, **kwargs) if kwargs else func(*args)
            except RuntimeError as exc:
                if "data is not allocated yet" not in str(exc):
                    raise
                raise RuntimeError(  # raised on every rank: the same metadata everywhere
                    f"{getattr(func, '__name__', func)} reads the data of an owner-layout tensor argument "
                    "directly, below any dispatch (an index or size argument): pass a plain tensor "
                    "(t.full_tensor()) there"
                ) from exc

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        """Every aten call on an owner-layout tensor: one rule, chosen from metadata only
        (``dispatch.py`` for single calls, ``lists.py`` for list operators)."""
        if func is _DETACH and type(args[0]) is cls:  # an alias: the same piece and spec, decided
            a = args[0]
            out = cls._wrap(a._local_tensor.detach(), a._spec, a._holder)
            out._tree = a._tree  # p.detach().full_tensor() lands a deferred HSDP sync too
            return out
        kwargs = kwargs or {}
        out = fast_call(cls, func, args, kwargs)  # a decision recorded for this metadata
        if out is MISS:
            info = operator_info(func)
            if info.cls is OpClass.LIST:  # element by element, 2D elements included
                return run_lists(cls, func, args, kwargs, info)
            if _any_2d(args, kwargs):  # a tensor-parallel slice held by its dp owner: its local rules
                out = local_2d(cls, func, args, kwargs, info)
                if out is not NOT_LOCAL:
                    return out
            rule, holder, out = run_rules(cls, func, args, kwargs, info)
            if rule in LEARNABLE_RULES:
                learn(cls, func, args, kwargs, info, rule, holder, out)
        if (func is _DETACH or func is _ALIAS) and isinstance(out, OwnerDTensor):
            out._tree = args[0]._tree
        return out


_SET_DATA = torch._C.TensorBase.data.__set__  # type: ignore[attr-defined]
_METHOD_WRAPPER = type(_SET_DATA)

_DETACH, _ALIAS = torch.ops.aten.detach.default, torch.ops.aten.alias.default


def _is_2d_owner(a: Any) -> bool:
    return isinstance(a, OwnerDTensor) and a._spec.mesh.ndim == 2


def _any_2d(args: tuple, kwargs: dict | None) -> bool:
    """Whether a call has an owner-layout argument on a 2D (dp, tp) mesh (``two_dim.py``)."""
    for a in (*args, *(kwargs or {}).values()):
        if _is_2d_owner(a) or (isinstance(a, (list, tuple)) and any(_is_2d_owner(t) for t in a)):
            return True
    return False


def _out_of_place(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """``func(*args, out=out)`` with owner-layout ``out`` tensors: computed out of place, then
    copied into each ``out`` tensor (its piece, by the ``copy_`` rule)."""
    with torch._C.DisableTorchFunctionSubclass():
        result = func(*args, **{k: v for k, v in kwargs.items() if k != "out"})
        for o, r in zip(_as_tuple(out), _as_tuple(result), strict=True):
            if tuple(o.shape) != tuple(r.shape):
                raise RuntimeError(
                    f"{getattr(func, '__name__', func)}: out= tensor of shape {tuple(o.shape)} for a result of "
                    f"shape {tuple(r.shape)}: an owner-layout tensor cannot be resized in place; pass an out= "
                    "tensor of the result's shape"
                )
            o.copy_(r)
        return out


def _as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


torch.serialization.add_safe_globals([OwnerDTensor, OwnerShard, _NormPartial])

# torch's clip_grad_norm_ / get_total_norm / clip_grad_value_ take their list (foreach) path for
# the tensor types of this registry (``type(t) in`` it: a subclass of DTensor is not DTensor),
# where torch.distributed.tensor registers DTensor itself. Registered, the gradients' norms are one
# ``_foreach_norm`` and the scaling one ``_foreach_mul_`` on the local pieces (lists.py), instead
# of one call per gradient. (Only this registry: torch.optim keeps its own, whose default for
# owner-layout parameters stays as it is.)
if OwnerDTensor not in _foreach_utils._foreach_supported_types:
    _foreach_utils._foreach_supported_types.append(OwnerDTensor)  # type: ignore[arg-type]
