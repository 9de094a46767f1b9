"""Where fully_shard keeps a unit's tensors: the mesh's device, as FSDP2.

``move_states_to_device`` without processes: tensors already on the device and tensors on
``meta`` are left alone (same objects, no copy); ``mesh_device`` on a two-rank gloo job for
every mesh form ``fully_shard`` takes. The move itself needs a second device: a CPU-built model
on an NCCL mesh is checked by ``benchmarks/device_check.py`` (its ``on_mesh_device`` field) on
a GPU machine.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _ranks import spawn_ranks
from matrix_owner_optim.sharding.api import mesh_device, move_states_to_device


def test_tensors_on_meta_or_already_there_stay() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    with torch.device("meta"):
        model.append(nn.Linear(3, 2))  # built on meta: materialised later by to_empty
    params = list(model.parameters())
    ptrs = [t.data_ptr() for t in [*model[0].parameters(), *model[1].parameters(), *model[1].buffers()]]
    move_states_to_device(model, torch.device("cpu"))
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))  # the same objects
    assert [
        t.data_ptr() for t in [*model[0].parameters(), *model[1].parameters(), *model[1].buffers()]
    ] == ptrs  # nothing copied
    assert all(p.device.type == "meta" for p in model[2].parameters())


def _devices(rank: int, world_size: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    group = dist.new_group(list(range(world_size)))
    mesh = init_device_mesh("cpu", (world_size,))
    return [
        str(mesh_device(None, dist.group.WORLD)),
        str(mesh_device(group, group)),
        str(mesh_device(mesh, mesh.get_group())),
    ]


@pytest.mark.multirank
def test_gloo_meshes_keep_tensors_on_the_cpu() -> None:
    for res in spawn_ranks(_devices, 2, threads_per_rank=1):
        assert res == ["cpu", "cpu", "cpu"]
