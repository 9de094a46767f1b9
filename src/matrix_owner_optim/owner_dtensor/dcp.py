"""DCP's checkpoint protocol for owner-layout DTensors: this rank's rows (on a 2D mesh its TP
slice, where it owns it) as one chunk and nothing where it holds none, so a checkpoint written
at W ranks loads at any W' on any layout (DESIGN.md, "State dicts and checkpoints").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.tensor import Replicate

__all__ = ["DcpChunks"]


class DcpChunks:
    """Mixed into :class:`~.tensor.OwnerDTensor` (which provides ``placement``, ``is_holder``,
    ``local_rows`` and ``_local_tensor``)."""

    if TYPE_CHECKING:  # what the mixin reads, provided by OwnerDTensor and torch.Tensor
        placement: Any
        placements: Any
        device_mesh: Any
        _local_tensor: torch.Tensor
        shape: torch.Size

        @property
        def is_holder(self) -> bool: ...

        def dim(self) -> int: ...

        def local_rows(self) -> tuple[int, int] | None: ...

    # -- DCP's checkpoint protocol: this rank's rows as one chunk, nothing where it holds none ----
    def _chunk(self) -> ChunkStorageMetadata | None:
        if self.device_mesh.ndim == 2:  # a TP slice held by its dp owner (two_dim.py): DTensor's own cut
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            sizes, offsets = compute_local_shape_and_global_offset(self.shape, self.device_mesh, self.placements)
            if self._local_tensor.numel() == 0:
                return None
            return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        p = self.placement
        if isinstance(p, Replicate):
            return ChunkStorageMetadata(offsets=torch.Size([0] * self.dim()), sizes=self.shape)
        if self.dim() == 0:
            return ChunkStorageMetadata(offsets=torch.Size([]), sizes=self.shape) if self.is_holder else None
        rows = self.local_rows()
        assert rows is not None
        if rows[1] <= rows[0]:
            return None
        return ChunkStorageMetadata(
            offsets=torch.Size([rows[0]] + [0] * (self.dim() - 1)),
            sizes=torch.Size([rows[1] - rows[0], *self.shape[1:]]),
        )

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        chunk = self._chunk()
        if chunk is None:
            return []
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk, properties=TensorProperties.create_from_tensor(self._local_tensor), size=self.shape
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        chunk = self._chunk()
        return [] if chunk is None else [chunk]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if self._chunk() is None:
            raise ValueError(f"{index.fqn}: this rank holds no piece of it")
        return self._local_tensor
