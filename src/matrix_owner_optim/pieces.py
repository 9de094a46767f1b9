"""Pieces of global tensors: what state dicts hold for the owner layout (model and optimizer).

A state-dict entry of a sharded tensor is a piece of the global tensor that DCP and
``torch.distributed.checkpoint.state_dict`` understand:

* ``sharded`` role (row blocks split as ``torch.chunk`` splits them): a stock ``DTensor`` with
  ``Shard(0)`` on a 1D mesh over the shard group, exactly FSDP2's form.
* ``matrix`` and ``tail`` roles (the whole tensor on its owner, nothing elsewhere): no stock
  placement describes that, so :class:`OwnedTensor`, a ``DTensor`` subclass, does. DCP reads
  its pieces through the checkpoint protocol (``__create_write_items__``,
  ``__create_chunk_list__``, ``__get_tensor_shard__``: one chunk, the whole tensor, on the
  owner; none elsewhere), and ``full_tensor()`` / ``redistribute`` to ``Replicate`` broadcast
  it from the owner, which is what ``StateDictOptions(full_state_dict=True)`` calls. It is a
  ``DTensor`` for that reason: torch gathers only ``DTensor`` and ``ShardedTensor`` entries.

Loading takes back these pieces, and full (unsharded) tensors: :func:`local_piece` cuts this
rank's piece out of either. Both the model's state-dict hooks (:mod:`.sharding.state_dict`) and
the optimizer's placements (:mod:`.optim`) build on this module, which knows only MatrixShard
metadata.
"""


from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .planning.metadata import MatrixShard, Role, get_matrix_shard, get_shard_group, get_shard_rank

__all__ = [
    "OwnedTensor",
    "describe",
    "shard_info",
    "mesh_of_group",
    "piece_of",
    "local_piece",
    "row_block",
    "contiguous_stride",
]


# -- meshes ---------------------------------------------------------------------------------------
# (id(group), device type) -> mesh, held weakly: a DeviceMesh keeps its process group alive, and
# a process-lifetime cache would keep gloo's worker threads running into interpreter teardown.
# The pieces of one state dict hold their mesh, so they share it while they live.
_MESHES: "weakref.WeakValueDictionary[tuple[int, str], Any]" = weakref.WeakValueDictionary()


def mesh_of_group(group: Any, device_type: str) -> Any:
    """A 1D ``DeviceMesh`` over ``group`` (no collective) to describe pieces."""
    from torch.distributed.device_mesh import DeviceMesh

    group = group if group is not None else dist.group.WORLD
    key = (id(group), device_type)
    mesh = _MESHES.get(key)
    if mesh is None or mesh.get_group() is not group:
        mesh = DeviceMesh.from_group(group, device_type)
        _MESHES[key] = mesh
    return mesh


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


# -- the whole tensor on one rank ---------------------------------------------------------------------
_PASSTHROUGH = {"detach", "alias", "_to_copy", "clone", "contiguous"}


class OwnedTensor(DTensor):
    """A global tensor held whole by one rank of a 1D mesh (its owner) and by no other rank.

    ``to_local()`` is this rank's piece: the whole tensor on the owner, a numel-0 tensor
    elsewhere. ``full_tensor()`` and ``redistribute(placements=[Replicate()])`` broadcast it
    from the owner (collective). DCP saves the owner's chunk and reads into it. Elementwise
    copies (``detach``, ``.to``, ``clone``) keep the form; any other operator raises: call
    ``full_tensor()`` first. The declared placement (``Replicate``) is a stand-in that only
    this class's own methods read.
    """

    _owner: int

    @staticmethod
    def make(
        local: torch.Tensor,
        owner: int,
        mesh: Any,
        shape: Sequence[int],
        dtype: torch.dtype | None = None,
    ) -> "OwnedTensor":
        """Wrap ``local`` (the whole tensor on the owner, numel 0 elsewhere); no copy."""
        shape = torch.Size(tuple(int(s) for s in shape))
        dtype = dtype or local.dtype
        me = mesh.get_local_rank()
        if me == owner and tuple(local.shape) != tuple(shape):
            raise ValueError(
                f"the owner's piece has shape {tuple(local.shape)}, expected {tuple(shape)}"
            )
        if me != owner and local.numel() != 0:
            raise ValueError(f"a non-owner's piece must be empty, got shape {tuple(local.shape)}")
        spec = DTensorSpec(
            mesh, (Replicate(),), tensor_meta=TensorMeta(shape, contiguous_stride(shape), dtype)
        )
        r = DTensor.__new__(OwnedTensor, local, spec, requires_grad=False)  # type: ignore[call-arg]
        assert isinstance(r, OwnedTensor)
        r._owner = int(owner)
        return r

    @property
    def owner(self) -> int:
        """The mesh rank holding the tensor."""
        return self._owner

    @property
    def is_owner(self) -> bool:
        return self.device_mesh.get_local_rank() == self._owner

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"OwnedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, owner={self._owner}, "
            f"local={tuple(self._local_tensor.shape)})"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        owned = [a for a in args if isinstance(a, OwnedTensor)]
        if name in _PASSTHROUGH and len(owned) == 1 and args and args[0] is owned[0]:
            src = owned[0]
            local = func(src._local_tensor, *args[1:], **kwargs)
            if src.is_owner and tuple(local.shape) != tuple(src.shape):
                raise NotImplementedError(
                    f"OwnedTensor: {func} changes the shape; call full_tensor() first"
                )
            return OwnedTensor.make(
                local if src.is_owner else local.reshape(0),
                src._owner,
                src.device_mesh,
                src.shape,
                local.dtype,
            )
        if name == "copy_" and len(args) == 2 and isinstance(args[0], OwnedTensor):
            dst, src = args
            if isinstance(src, OwnedTensor) and src._owner == dst._owner:
                dst._local_tensor.copy_(src._local_tensor)
                return dst
        raise NotImplementedError(
            f"OwnedTensor (a tensor held whole by rank {owned[0]._owner if owned else '?'} of its mesh) "
            f"does not support {func}; call .full_tensor() (collective) for the whole tensor on every rank"
        )

    def redistribute(
        self,
        device_mesh: Any = None,
        placements: Sequence[Any] | None = None,
        *,
        async_op: bool = False,
        **kwargs: Any,
    ) -> DTensor:  # type: ignore[override]
        """To ``Replicate`` (the only target): the owner broadcasts; a plain replicated DTensor."""
        mesh = device_mesh if device_mesh is not None else self.device_mesh
        if (
            mesh is not self.device_mesh
            or placements is None
            or not all(isinstance(p, Replicate) for p in placements)
        ):
            raise NotImplementedError(
                "OwnedTensor redistributes only to Replicate() on its own mesh (full_tensor()); got "
                f"{placements}"
            )
        group = self.device_mesh.get_group()
        if self.is_owner:
            full = self._local_tensor.contiguous()
        else:
            full = torch.empty(self.shape, dtype=self.dtype, device=self._local_tensor.device)
        dist.broadcast(full, group_src=self._owner, group=group)
        return DTensor.from_local(
            full,
            self.device_mesh,
            [Replicate()],
            run_check=False,
            shape=self.shape,
            stride=self.stride(),
        )

    def full_tensor(self, *, grad_placements: Any = None) -> torch.Tensor:  # type: ignore[override]
        return self.redistribute(self.device_mesh, [Replicate()]).to_local()

    # -- DCP's checkpoint protocol: one chunk (the whole tensor) on the owner, none elsewhere ---------
    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([0] * self.dim()), sizes=self.shape)

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        if not self.is_owner:
            return []
        chunk = self._chunk()
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(self._local_tensor),
                    size=self.shape,
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()] if self.is_owner else []

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if not self.is_owner:
            raise ValueError(
                f"{index.fqn}: this rank is not the owner (rank {self._owner}) and holds no chunk"
            )
        return self._local_tensor


# -- pieces of sharded parameters ---------------------------------------------------------------------
def row_block(local: torch.Tensor, mesh: Any, shape: Sequence[int]) -> DTensor:
    """``local`` rows (``torch.chunk`` split over ``mesh``) as a ``Shard(0)`` DTensor (no copy)."""
    shape = torch.Size(tuple(int(s) for s in shape))
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=shape, stride=contiguous_stride(shape)
    )


def shard_info(param: torch.Tensor) -> tuple[MatrixShard, int, Any] | None:
    """(MatrixShard, rank in the shard group, shard group) of a multi-rank sharded parameter."""
    if isinstance(param, DTensor):
        return None
    shard = get_matrix_shard(param)
    rank = get_shard_rank(param)
    if shard is None or rank is None or shard.world_size <= 1:
        return None
    return shard, rank, get_shard_group(param)


def piece_of(
    local: torch.Tensor,
    shard: MatrixShard,
    rank: int,
    group: Any,
    shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """``local`` (this rank's piece of a tensor laid out like ``shard``) as a DCP piece.

    ``shape``: the global shape when it is not the parameter's (optimizer state such as
    Shampoo's factors, held whole by the owner). Row blocks of ``sharded`` tensors become
    ``Shard(0)`` DTensors, owner-held tensors :class:`OwnedTensor`.
    """
    mesh = mesh_of_group(group, local.device.type)
    if shard.role is Role.SHARDED:
        return row_block(local, mesh, shard.shape if shape is None else shape)
    assert shard.owner is not None
    return OwnedTensor.make(
        local, shard.owner, mesh, shard.shape if shape is None else shape, local.dtype
    )


def local_piece(
    value: Any, shard: MatrixShard, rank: int, *, what: str, like: torch.Tensor | None = None
) -> torch.Tensor:
    """This rank's piece of the global tensor ``value`` for a tensor laid out like ``shard``.

    ``value``: a piece in this layout (OwnedTensor or ``Shard(0)`` DTensor, e.g. read by DCP
    into what ``state_dict()`` gave), a replicated DTensor, or a full plain tensor. ``like``
    gives device (and the numel-0 shape of non-owners). No collective.
    """
    full_shape = tuple(shard.shape)
    if isinstance(value, OwnedTensor):
        if (
            shard.role is Role.SHARDED
            or value.owner != shard.owner
            or tuple(value.shape) != full_shape
        ):
            raise ValueError(
                f"{what}: the state dict holds it whole on rank {value.owner}, shape "
                f"{tuple(value.shape)}, but here it is {describe(shard, rank)}; load a full state dict "
                "or go through DCP (dcp.load into get_model_state_dict(model) / "
                "get_optimizer_state_dict(model, optimizer))"
            )
        return value._local_tensor
    if isinstance(value, DTensor):
        if all(isinstance(p, Replicate) for p in value.placements):
            value = value._local_tensor  # the full tensor
        elif (
            shard.role is Role.SHARDED
            and tuple(value.shape) == full_shape
            and len(value.placements) == 1
            and value.placements[0] == Shard(0)
            and value.device_mesh.size() == shard.world_size
            and value.device_mesh.get_local_rank() == rank
        ):
            return value._local_tensor
        else:
            raise ValueError(
                f"{what}: a DTensor with placements {tuple(value.placements)} on a mesh of "
                f"{value.device_mesh.size()} ranks, but here it is {describe(shard, rank)}; load a "
                "full state dict or go through DCP"
            )
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor, got {type(value).__name__}")
    local_shape = tuple(shard.local_shape(rank))
    if tuple(value.shape) == full_shape:
        if shard.role is Role.SHARDED:
            start, stop = shard.row_range(rank)
            return value[start:stop]
        if shard.is_owned_by(rank):
            return value
        device = like.device if like is not None else value.device
        return torch.empty(local_shape, dtype=value.dtype, device=device)
    if tuple(value.shape) == local_shape:
        return value
    raise ValueError(
        f"{what}: shape {tuple(value.shape)} is neither the global shape {full_shape} nor this "
        f"rank's piece {local_shape}; load a checkpoint of a model built with the same configuration"
    )


def describe(shard: MatrixShard, rank: int) -> str:
    if shard.role is Role.SHARDED:
        return f"row blocks over {shard.world_size} ranks (rank {rank} holds rows {shard.row_range(rank)})"
    return f"held whole by rank {shard.owner} of {shard.world_size}"


