"""FSDP2's API surface of torch 2.13 and what the owner layout does with each part: the two
tables the docs' parity page is generated from, the argument checks, and :class:`FSDP2Methods`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .state import require_state

__all__ = [
    "FSDP2Methods",
    "FSDP_MODULE_METHODS",
    "FULLY_SHARD_ARGUMENTS",
    "check_reshard_after_forward_type",
    "check_unsupported_arguments",
    "resolve_reshard_after_forward",
]

# What the package does with each ``fully_shard`` argument of torch 2.13 (the docs' parity table).
FULLY_SHARD_ARGUMENTS: dict[str, str] = {
    "module": "a module or a list of modules (one unit), as FSDP2",
    "mesh": "None, a ProcessGroup, a 1D DeviceMesh, or a 2D (replicate, shard) DeviceMesh for HSDP",
    "reshard_after_forward": (
        "True / None: free non-owned tensors after forward, gather again in backward (the root keeps "
        "them, as FSDP2's root); False: keep them; an int N (a divisor of the shard size): N == shard "
        "size is True, 1 <= N < shard size keeps the gathered copy for backward (no backward all-gather, "
        "FSDP2's N == 1 meaning; a smaller reshard group holds a whole tensor on one rank or nothing, so "
        "the owner layout keeps the whole copy rather than 1/N of it)"
    ),
    "shard_placement_fn": (
        "None only; a function is refused: the owner layout places every tensor by its plan (roles=, "
        "plan=plan_model(...)), not by a Shard(dim) per parameter"
    ),
    "mp_policy": "MixedPrecisionPolicy: param_dtype, reduce_dtype, output_dtype, cast_forward_inputs",
    "offload_policy": (
        "OffloadPolicy() (no offload) only; CPUOffloadPolicy is refused (torch itself refuses its CPU "
        "path without an accelerator): keep the model on the mesh's device"
    ),
    "ignored_params": (
        "a set of parameters left as they are: not sharded, not moved, gradients not reduced (as FSDP2); "
        "give them to their own optimizer, not to OwnerRoutedOptimizer"
    ),
    "dp_mesh_dims": "None only; an SPMD mesh with data-parallel dims is refused: pass the data-parallel mesh",
}

# What the package does with each ``FSDPModule`` method of torch 2.13 (the docs' parity table).
FSDP_MODULE_METHODS: dict[str, str] = {
    "unshard": "implemented (async_op too): every rank holds the full tensors until reshard()",
    "reshard": "implemented: back to the owner layout",
    "reset_iter_state": (
        "implemented (on the root): drops the in-flight reduction and the failed iteration's "
        "unreduced gradients, reshards every unit; a forward pass also heals by itself"
    ),
    "set_requires_gradient_sync": "implemented: accumulate locally (reduce dtype) until a synced backward",
    "set_reshard_after_forward": "implemented (a bool, as FSDP2's method)",
    "set_reshard_after_backward": "implemented: False keeps the gathered tensors for the next forward",
    "set_gradient_divide_factor": "implemented (per unit, as FSDP2)",
    "set_reduce_scatter_divide_factor": "implemented: FSDP2's older name of set_gradient_divide_factor",
    "set_is_last_backward": "accepted and ignored: every reduction completes inside backward here",
    "set_modules_to_forward_prefetch": "implemented (explicit targets replace the automatic prefetch)",
    "set_modules_to_backward_prefetch": "implemented",
    "set_requires_all_reduce": (
        "True accepted (the default); False refused: the replica all-reduce of HSDP lands with the "
        "gradient; use set_requires_gradient_sync(False) to accumulate without communication"
    ),
    "set_unshard_in_backward": (
        "True accepted (the default); False refused: a unit whose weights backward does not read is "
        "found by itself (no gradient reaches its outputs, so nothing is gathered)"
    ),
    "set_post_optim_event": (
        "refused: the owner layout issues its all-gathers on the current stream, which already "
        "follows the optimizer step; drop the call"
    ),
    "set_all_reduce_hook": (
        "refused: the HSDP replica all-reduce is the package's own; reduce gradients after "
        "backward in the script if a custom reduction is needed"
    ),
    "set_custom_all_gather": "refused: the owner segments' all-gather-v is the package's own collective",
    "set_custom_reduce_scatter": "refused: the owner segments' reduce-scatter-v is the package's own collective",
    "set_allocate_memory_from_process_group_for_comm": "refused: the package allocates its own buffers",
    "set_force_sum_reduction_for_comms": (
        "refused: use set_gradient_divide_factor(1.0) for the sum of the ranks' gradients"
    ),
    "set_reduce_scatter_max_input_buffers": "refused: one reduction is in flight at a time (one unit's buffer)",
    "set_reduce_scatter_unused_params": (
        "refused: unused parameters get no gradient and are left out of the reduction on every rank alike"
    ),
    "set_separate_reduce_scatter_group": "refused: reductions run on the shard group",
    "set_symm_mem_for_comm": "refused: no symmetric-memory collectives (CUDA only, not implemented)",
    "_set_unshard_async_op": "refused: forward prefetches the next unit's all-gather asynchronously by itself",
}


def resolve_reshard_after_forward(value: Any, shard_size: int) -> bool:
    """``reshard_after_forward`` as a bool (:data:`FULLY_SHARD_ARGUMENTS`)."""
    check_reshard_after_forward_type(value)
    if value is None or isinstance(value, bool):
        return value is not False
    if not 1 <= value <= shard_size or shard_size % value != 0:
        raise ValueError(
            f"fully_shard(reshard_after_forward={value}): an int is the world size to reshard to after "
            f"forward and must divide the shard size {shard_size} (1 <= N <= {shard_size}); pass a divisor, "
            "or True / False"
        )
    return bool(value == shard_size)


def check_reshard_after_forward_type(value: Any) -> None:
    """Refuse anything but a bool, None or an int (before the process group is looked at)."""
    if value is None or isinstance(value, (bool, int)):
        return
    raise ValueError(
        f"fully_shard(reshard_after_forward={value!r}): takes True, False, None or an int dividing the "
        f"shard size, not a {type(value).__name__}"
    )


def check_unsupported_arguments(shard_placement_fn: Any, offload_policy: Any, dp_mesh_dims: Any) -> None:
    """Refuse the ``fully_shard`` arguments the owner layout has no meaning for."""
    if shard_placement_fn is not None:
        raise NotImplementedError(
            "fully_shard(shard_placement_fn=...): the owner layout places every tensor by its sharding "
            "plan (whole on one owner, or row blocks for embeddings and heads), not by a Shard(dim) per "
            "parameter; drop the argument and steer placement with roles= or plan=plan_model(model, W, ...)"
        )
    if offload_policy is not None:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        if isinstance(offload_policy, CPUOffloadPolicy) or type(offload_policy) is not OffloadPolicy:
            raise NotImplementedError(
                f"fully_shard(offload_policy={offload_policy!r}): CPU offload is not implemented for the "
                "owner layout (torch's own fully_shard refuses its CPU path without an accelerator); "
                "keep the model on the mesh's device and pass offload_policy=OffloadPolicy() or nothing"
            )
    if dp_mesh_dims is not None:
        raise NotImplementedError(
            "fully_shard(dp_mesh_dims=...): SPMD meshes whose parameters are already DTensors over "
            "other dims are not supported; pass the data-parallel mesh (1D, or 2D (replicate, shard)) "
            "as mesh= and drop dp_mesh_dims"
        )


class FSDP2Methods:
    """``FSDPModule`` methods beyond the owner layout's own (see :data:`FSDP_MODULE_METHODS`)."""

    def reset_iter_state(self) -> None:
        """FSDP2's recovery after an exception aborted a pass, on the root."""
        assert isinstance(self, nn.Module)
        state = require_state(self)
        if state.root is not state:
            raise RuntimeError(
                f"reset_iter_state() was called on {type(self).__name__}, which is not the root of its "
                "fully_shard tree; call it on the module of the outermost fully_shard call (the model)"
            )
        if state.tree.context is not None:  # a pending plan has no iteration state
            state.tree.context.reset_iteration()

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's older name of ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)  # type: ignore[attr-defined]

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """``True`` (the default) is what happens; ``False`` is refused (see the table)."""
        if not requires_all_reduce:
            _refuse("set_requires_all_reduce(False)")

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``True`` (the default) is what happens; ``False`` is refused (see the table)."""
        if not unshard_in_backward:
            _refuse("set_unshard_in_backward(False)")


def _refuse(call: str) -> None:
    name = call.split("(")[0]
    raise NotImplementedError(f"{call} is not supported by the owner layout: {FSDP_MODULE_METHODS[name]}")


def _refusal(name: str) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> None:
        _refuse(f"{name}()")

    method.__name__ = name
    method.__doc__ = f"Refused: {FSDP_MODULE_METHODS[name]}"
    return method


for _name, _what in FSDP_MODULE_METHODS.items():
    if _what.startswith("refused") and not hasattr(FSDP2Methods, _name):
        setattr(FSDP2Methods, _name, _refusal(_name))
