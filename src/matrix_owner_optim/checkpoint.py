"""DCP checkpoints keyed by fqn, loadable at any world size and on any layout.

``save(path, model, optimizer)`` writes a ``torch.distributed.checkpoint`` (DCP) directory whose
keys and global shapes do not depend on the layout that wrote it:

* ``model.<fqn>``: every parameter once (tied parameters under their first fqn) and every
  persistent buffer, with its global shape. On the owner-shaped layout
  (:func:`matrix_owner_optim.fully_shard`) the owner contributes the whole tensor and the
  others nothing; ``sharded``-role tensors are contributed as DTensor ``Shard(0)`` row blocks
  (``torch.chunk`` rows, :meth:`MatrixShard.row_range`). Stock FSDP2 DTensors are saved as they
  are; in one process, plain tensors.
* ``model_aliases.<alias>``: the first fqn of a tied parameter, for every other name of it.
* ``optim.state.<fqn>.<key>``: optimizer state of each parameter, saved by the rank that holds
  it: whole tensors where one rank updates the whole parameter (Muon's ``momentum_buffer`` on
  the owner), DTensor row blocks where each rank updates its rows (AdamW moments of
  ``sharded`` tensors and of stock-FSDP2 tail shards), scalars (``step``) once.
* ``optim.param_groups.<i>.<name>``: the hyperparameters of param group ``i`` (``lr``,
  ``initial_lr``, ..., and ``role`` for :class:`OwnerRoutedOptimizer`), non-tensor entries.

``load(path, model, optimizer)`` reads the checkpoint metadata, allocates exactly what this rank
holds under *its* layout (owner: whole tensors; row blocks: its rows; DTensors: their local
shards), lets DCP read those pieces (DCP reshards: any saved chunking reads into any target
chunking), copies model tensors in place and installs optimizer state so that the next step
continues the saved trajectory. It checks shapes and missing keys on every rank before any
collective, so a bad checkpoint fails with the same clear error everywhere instead of hanging.

Every DCP call is collective over ``process_group`` (default: the world group) when a process
group is initialized; with none, both run in one process.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from .planning.metadata import Role, get_matrix_shard, get_shard_rank
from .tensors import is_dtensor as _is_dtensor

__all__ = ["save", "load", "CheckpointError", "MODEL_PREFIX", "OPTIM_STATE_PREFIX", "OPTIM_GROUPS_PREFIX"]

MODEL_PREFIX = "model."
ALIAS_PREFIX = "model_aliases."
OPTIM_STATE_PREFIX = "optim.state."
OPTIM_GROUPS_PREFIX = "optim.param_groups."
_GROUP_ATTR = "_moo_process_group"  # set on owner-sharded parameters by sharding.fully_shard


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model or optimizer it is loaded into."""


# --------------------------------------------------------------------------------------------
# layouts
# --------------------------------------------------------------------------------------------
_MESHES: dict[tuple[int, str], tuple[Any, Any]] = {}  # (id(group), device type) -> (group, mesh)


def _mesh_of_group(group: Any, device: torch.device) -> Any:
    """A 1D DeviceMesh over ``group`` (no collective), to describe row blocks as DTensors."""
    from torch.distributed.device_mesh import DeviceMesh

    group = group if group is not None else dist.group.WORLD
    key = (id(group), device.type)
    cached = _MESHES.get(key)
    if cached is None or cached[0] is not group:
        cached = (group, DeviceMesh.from_group(group, device.type))
        _MESHES[key] = cached
    return cached[1]


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


@dataclass
class _Layout:
    """How one rank holds one parameter (and its per-element optimizer state).

    ``kind``: ``"whole"`` (this rank holds the whole tensor), ``"rows"`` (a DTensor-described
    part: owner ``sharded`` row blocks or a stock-FSDP2 shard), ``"none"`` (another rank).
    """

    kind: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...] = ()
    mesh: Any = None
    placements: tuple[Any, ...] = ()

    def wrap(self, local: torch.Tensor, global_shape: tuple[int, ...] | None = None) -> Any:
        """A DTensor over ``local`` (no copy) describing its place in the global tensor."""
        from torch.distributed.tensor import DTensor

        shape = tuple(global_shape if global_shape is not None else self.global_shape)
        return DTensor.from_local(local, self.mesh, list(self.placements), run_check=False,
                                  shape=torch.Size(shape), stride=_contiguous_stride(shape))


def _param_layout(param: torch.Tensor) -> _Layout:
    """This rank's holding of ``param`` under whichever layout it is in."""
    if _is_dtensor(param):
        local = param._local_tensor  # type: ignore[attr-defined]
        return _Layout("rows", tuple(param.shape), tuple(local.shape), param.device_mesh,  # type: ignore[attr-defined]
                       tuple(param.placements))  # type: ignore[attr-defined]
    shard = get_matrix_shard(param)
    rank = get_shard_rank(param)
    if shard is None or rank is None or tuple(param.shape) == tuple(shard.shape) and shard.world_size == 1:
        return _Layout("whole", tuple(param.shape), tuple(param.shape))
    if shard.role is Role.SHARDED:
        from torch.distributed.tensor import Shard

        local = tuple(param.shape)
        expected = tuple(shard.local_shape(rank))
        if local != expected:  # e.g. unshard()-ed: full tensors on every rank
            if local == tuple(shard.shape):
                return _Layout("whole", tuple(shard.shape), local)
            raise CheckpointError(f"parameter {shard.fqn!r}: local shape {local} is neither its row block "
                                  f"{expected} nor its full shape {tuple(shard.shape)}")
        mesh = _mesh_of_group(getattr(param, _GROUP_ATTR, None), param.device)
        return _Layout("rows", tuple(shard.shape), local, mesh, (Shard(0),))
    if shard.is_owned_by(rank) or tuple(param.shape) == tuple(shard.shape) and param.numel() > 0:
        return _Layout("whole", tuple(shard.shape), tuple(shard.shape))
    return _Layout("none", tuple(shard.shape))


# --------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------
@dataclass
class _ModelParam:
    names: list[str]  # every fqn of this parameter object in the model, first one first
    param: torch.Tensor

    @property
    def fqn(self) -> str:
        return self.names[0]


def _model_params(model: nn.Module) -> list[_ModelParam]:
    by_id: dict[int, _ModelParam] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        entry = by_id.get(id(p))
        if entry is None:
            by_id[id(p)] = _ModelParam([name], p)
        elif name not in entry.names:
            entry.names.append(name)
    for entry in by_id.values():  # aliases the plan recorded (the model may name them differently)
        shard = get_matrix_shard(entry.param)
        if shard is not None:
            for alias in (shard.fqn, *shard.aliases):
                if alias not in entry.names:
                    entry.names.append(alias)
    return list(by_id.values())


def _model_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    out, seen = [], set()
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for b_name, buf in mod._buffers.items():
            if buf is None or b_name in mod._non_persistent_buffers_set:
                continue
            fqn = f"{mod_name}.{b_name}" if mod_name else b_name
            if id(buf) in seen:
                continue
            seen.add(id(buf))
            out.append((fqn, buf))
    return out


def _model_state(model: nn.Module) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for entry in _model_params(model):
        layout = _param_layout(entry.param)
        data = entry.param.detach()
        if layout.kind == "whole":
            state[MODEL_PREFIX + entry.fqn] = data
        elif layout.kind == "rows":
            if _is_dtensor(data):
                state[MODEL_PREFIX + entry.fqn] = data
            elif data.numel() > 0:
                state[MODEL_PREFIX + entry.fqn] = layout.wrap(data)
        for alias in entry.names[1:]:
            state[ALIAS_PREFIX + alias] = entry.fqn
    for fqn, buf in _model_buffers(model):
        state[MODEL_PREFIX + fqn] = buf.detach()
    return state


# --------------------------------------------------------------------------------------------
# optimizer
# --------------------------------------------------------------------------------------------
@dataclass
class _OptParam:
    """One parameter of an optimizer as this rank holds it."""

    fqn: str
    names: list[str]
    param: torch.Tensor
    layout: _Layout  # how this rank holds the parameter's per-element state
    local: bool  # this rank keeps optimizer state for it
    state_as_dtensor: bool  # the optimizer keeps DTensor state (torch optimizers on DTensors)
    children: list[dict[Any, Any]]  # child-optimizer state dicts that must share the entry
    proxy: torch.Tensor | None = None


def _is_routed(optimizer: Any) -> bool:
    from .optim.owner_routed import OwnerRoutedOptimizer

    return isinstance(optimizer, OwnerRoutedOptimizer)


def _opt_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[_OptParam]:
    names_of = {id(e.param): e for e in _model_params(model)}

    def names(p: torch.Tensor, label: str) -> list[str]:
        entry = names_of.get(id(p))
        if entry is None:
            raise CheckpointError(f"optimizer parameter {label} is not a parameter of the model passed to "
                                  "save/load; pass the model the optimizer was built on")
        return entry.names

    out: list[_OptParam] = []
    if _is_routed(optimizer):
        for rp in optimizer._routed:  # type: ignore[attr-defined]
            ns = names(rp.param, repr(rp.label))
            child = optimizer._children[Role.MATRIX if rp.role is Role.MATRIX else Role.TAIL]  # type: ignore[attr-defined]
            local = rp.proxy is not None
            if not local:
                layout = _Layout("none", tuple(rp.param.shape))
            elif _is_dtensor(rp.param) and rp.owner is None:
                layout = _param_layout(rp.param)  # a shard-local proxy (stock FSDP2 tail)
            elif _is_dtensor(rp.param):
                layout = _Layout("whole", tuple(rp.param.shape), tuple(rp.param.shape))  # owner's copy
            else:
                layout = _param_layout(rp.param)
            out.append(_OptParam(ns[0], ns, rp.param, layout, local, _is_dtensor(rp.proxy),
                                 [child.state] if child is not None else [], rp.proxy))
        return out
    seen: set[int] = set()
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if id(p) in seen:
                continue
            seen.add(id(p))
            ns = names(p, f"#{pi} of param group {gi} (shape {tuple(p.shape)})")
            layout = _param_layout(p)
            local = layout.kind != "none" and p.numel() > 0
            out.append(_OptParam(ns[0], ns, p, layout, local, _is_dtensor(p), [], p))
    return out


def _optim_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    state: dict[str, Any] = {}
    ops = _opt_params(model, optimizer)
    for op in ops:
        if not op.local:
            continue
        st = optimizer.state.get(op.param)
        if not st:
            continue
        for key, value in st.items():
            if "." in str(key):
                raise CheckpointError(f"optimizer state key {key!r} of {op.fqn!r} contains a '.'; "
                                      "checkpoint keys are '<fqn>.<key>'")
            name = f"{OPTIM_STATE_PREFIX}{op.fqn}.{key}"
            if isinstance(value, torch.Tensor):
                value = value.detach()
                if (op.layout.kind == "rows" and not _is_dtensor(value) and value.dim() > 0
                        and tuple(value.shape) == op.layout.local_shape):
                    if value.numel() == 0:
                        continue
                    value = op.layout.wrap(value)
            state[name] = value
    fqn_of = {id(op.param): op.fqn for op in ops}
    for gi, group in enumerate(optimizer.param_groups):
        for k, v in group.items():
            if k == "param_names":
                continue
            if k == "params":  # membership by fqn, checked on load
                v = [fqn_of[id(p)] for p in v]
            state[f"{OPTIM_GROUPS_PREFIX}{gi}.{k}"] = v
    return state


# --------------------------------------------------------------------------------------------
# save
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet_one_process() -> Any:
    """DCP warns on every one-process call; running without a process group is supported here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _dcp_kwargs(process_group: Any) -> dict[str, Any]:
    if dist.is_available() and dist.is_initialized():
        return {"process_group": process_group}
    return {"no_dist": True}


def save(path: "str | os.PathLike[str]", model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         *, process_group: Any = None) -> None:
    """Save ``model`` (and ``optimizer``) to the DCP directory ``path``; collective when distributed.

    The saved keys and global shapes are the same on every layout and world size (see the
    module docstring). Every rank of ``process_group`` (default: world) must call it.
    """
    path = os.fspath(path)
    state = _model_state(model)
    if optimizer is not None:
        state.update(_optim_state(model, optimizer))
    with _quiet_one_process():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), **_dcp_kwargs(process_group))


# --------------------------------------------------------------------------------------------
# load
# --------------------------------------------------------------------------------------------
def _read_metadata(path: str) -> Metadata:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path!r} is not a DCP checkpoint (no .metadata file)") from None


def _shape_error(path: str, fqn: str, what: str, saved: tuple[int, ...], here: tuple[int, ...]) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path!r}: {what} {fqn!r} has shape {saved} in the checkpoint but {here} in the "
        f"{'model' if what == 'parameter' or what == 'buffer' else 'optimizer'}; load it into a model "
        "built with the same configuration"
    )


def _resolve(names: list[str], keys: dict[str, Any], aliases: dict[str, str]) -> str | None:
    """The checkpoint fqn of a parameter known here as ``names`` (aliases resolve both ways)."""
    for n in names:
        if MODEL_PREFIX + n in keys:
            return n
    for n in names:
        target = aliases.get(n)
        if target is not None and MODEL_PREFIX + target in keys:
            return target
    return None


def _alias_keys(md: Metadata) -> dict[str, str]:
    return {k[len(ALIAS_PREFIX):]: k for k in md.state_dict_metadata if k.startswith(ALIAS_PREFIX)}


def load(path: "str | os.PathLike[str]", model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         *, strict: bool = True, process_group: Any = None) -> list[str]:
    """Load a checkpoint written by :func:`save` (at any world size and layout) into ``model``
    (and ``optimizer``) as they are laid out on this rank; collective when distributed.

    Model tensors are overwritten in place. Optimizer state is replaced by the checkpoint's for
    every parameter this rank updates, and param-group hyperparameters are restored.

    Raises :class:`CheckpointError` for a shape that does not match (naming the fqn, both shapes
    and the checkpoint), for a model parameter or buffer missing from the checkpoint, and for an
    optimizer whose param groups do not match; ``FileNotFoundError`` for a missing path.
    With ``strict=False`` missing and unexpected keys are skipped instead and returned.
    Every check runs on every rank before tensors are read, so all ranks fail alike.

    Returns the keys that were not loaded: model keys missing from the checkpoint, then
    checkpoint model entries this model has no parameter or buffer for (both are errors unless
    ``strict=False``). Empty when everything matched.
    """
    path = os.fspath(path)
    md = _read_metadata(path)
    keys = md.state_dict_metadata
    kw = _dcp_kwargs(process_group)
    missing: list[str] = []
    params = _model_params(model)

    # -- pass 1: the small non-tensor entries (aliases, param groups), when needed ----------------
    alias_keys = _alias_keys(md)
    group_keys: dict[int, dict[str, str]] = {}
    if optimizer is not None:
        for k in keys:
            if k.startswith(OPTIM_GROUPS_PREFIX):
                idx, _, name = k[len(OPTIM_GROUPS_PREFIX):].partition(".")
                group_keys.setdefault(int(idx), {})[name] = k
    need_aliases = any(_resolve(e.names, keys, {}) is None for e in params) and bool(alias_keys)
    small: dict[str, Any] = {}
    if need_aliases:
        small.update({k: None for k in alias_keys.values()})
    for names in group_keys.values():
        small.update({k: None for k in names.values()})
    if small:
        with _quiet_one_process():
            dcp.load(small, storage_reader=dcp.FileSystemReader(path), **kw)
    aliases = {a: str(small[k]) for a, k in alias_keys.items()} if need_aliases else {}

    # -- model: check every parameter and buffer ---------------------------------------------------
    request: dict[str, Any] = _Request()
    consumed: set[str] = set()
    for entry in params:
        fqn = _resolve(entry.names, keys, aliases)
        layout = _param_layout(entry.param)
        if fqn is None:
            missing.append(MODEL_PREFIX + entry.fqn)
            continue
        consumed.update(MODEL_PREFIX + n for n in (*entry.names, fqn))
        meta = keys[MODEL_PREFIX + fqn]
        if not isinstance(meta, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {path!r}: {MODEL_PREFIX + fqn!r} is not a tensor entry")
        saved = tuple(meta.size)
        if saved != layout.global_shape:
            raise _shape_error(path, fqn, "parameter", saved, layout.global_shape)
        data = entry.param.detach()
        if layout.kind == "whole" or (layout.kind == "rows" and _is_dtensor(data)):
            _want(request, MODEL_PREFIX + fqn, data)
        elif layout.kind == "rows" and data.numel() > 0:
            _want(request, MODEL_PREFIX + fqn, layout.wrap(data))
    for fqn, buf in _model_buffers(model):
        key = MODEL_PREFIX + fqn
        meta = keys.get(key)
        if meta is None:
            missing.append(key)
            continue
        saved_shape = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else "a non-tensor entry"
        if saved_shape != tuple(buf.shape):
            raise _shape_error(path, fqn, "buffer", saved_shape, tuple(buf.shape))  # type: ignore[arg-type]
        consumed.add(key)
        _want(request, key, buf.detach())
    if missing and strict:
        raise CheckpointError(
            f"checkpoint {path!r} has no entry for model "
            f"{'key' if len(missing) == 1 else 'keys'} {', '.join(repr(m) for m in missing)}; "
            "pass strict=False to skip missing keys explicitly (they keep their current values)"
        )
    unexpected = sorted(k for k, v in keys.items() if k.startswith(MODEL_PREFIX)
                        and isinstance(v, TensorStorageMetadata) and k not in consumed)
    if unexpected and strict:
        raise CheckpointError(
            f"checkpoint {path!r} has model {'entry' if len(unexpected) == 1 else 'entries'} "
            f"{', '.join(repr(k) for k in unexpected)} that this model has no parameter or buffer for; "
            "pass strict=False to leave them unloaded explicitly (they are returned)"
        )
    missing.extend(unexpected)

    # -- optimizer: allocate exactly what this rank holds, from the checkpoint's global shapes -------
    installs: list[tuple[_OptParam, dict[str, Any]]] = []
    if optimizer is not None:
        ops = _opt_params(model, optimizer)
        ckpt_fqn = {id(op.param): (_resolve(op.names, keys, aliases) or op.fqn) for op in ops}
        if not group_keys:
            if strict:
                raise CheckpointError(f"checkpoint {path!r} holds no optimizer state (it was saved without "
                                      "an optimizer); load the model alone or pass strict=False")
            missing.append(OPTIM_GROUPS_PREFIX.rstrip("."))
        else:
            _check_groups(path, optimizer, group_keys, small, ckpt_fqn)
            state_keys = _state_keys_by_fqn(keys, _known_fqns(params, aliases))
            for op in ops:
                if not op.local:
                    continue
                fqn = ckpt_fqn[id(op.param)]
                values = _allocate_state(path, op, fqn, state_keys.get(fqn, {}), keys, request)
                installs.append((op, values))

    # -- pass 2: one collective read of every tensor this rank holds --------------------------------
    with _quiet_one_process():
        dcp.load(request, storage_reader=dcp.FileSystemReader(path), **kw)
    request.copy_duplicates(path)

    if optimizer is not None and group_keys:
        for gi, names in group_keys.items():
            group = optimizer.param_groups[gi]
            for name, key in names.items():
                if name not in ("params", "param_names"):
                    group[name] = small[key]
        for op, values in installs:
            new = {name: (request[v] if isinstance(v, str) else v) for name, v in values.items()}
            _install(optimizer, op, _cast_like_torch(new, op))
        if _is_routed(optimizer):
            optimizer._sync_hyperparameters()  # type: ignore[attr-defined]
    return missing


class _Request(dict):
    """What one rank asks DCP for; a key wanted by several local targets (tied parameters
    loaded into an untied model) is read once and copied into the others."""

    def __init__(self) -> None:
        super().__init__()
        self.duplicates: list[tuple[str, Any]] = []

    def copy_duplicates(self, path: str) -> None:
        for key, target in self.duplicates:
            source = self[key]
            src = source._local_tensor if _is_dtensor(source) else source
            dst = target._local_tensor if _is_dtensor(target) else target
            if src.shape != dst.shape:
                raise CheckpointError(
                    f"checkpoint {path!r}: {key!r} is loaded into two tensors that this rank holds "
                    f"differently ({tuple(src.shape)} and {tuple(dst.shape)} locally); tie them or "
                    "give them the same layout"
                )
            with torch.no_grad():
                dst.copy_(src)


def _want(request: dict[str, Any], key: str, target: Any) -> None:
    if key in request and isinstance(request, _Request) and request[key] is not target:
        request.duplicates.append((key, target))
    else:
        request[key] = target


def _allocate_state(path: str, op: _OptParam, fqn: str, saved: dict[str, str], keys: dict[str, Any],
                    request: dict[str, Any]) -> dict[str, Any]:
    """Targets for the saved state of one parameter as this rank holds it; fills ``request``.

    Per-element state (global shape = the parameter's) follows the parameter's layout: row
    blocks where this rank holds rows, whole where it holds the whole tensor. Anything else
    (``step``, Shampoo's factors) is read whole. Non-tensor entries map to their key.
    """
    values: dict[str, Any] = {}
    device = op.param._local_tensor.device if _is_dtensor(op.param) else op.param.device  # type: ignore[attr-defined]
    for name, key in saved.items():
        meta = keys[key]
        if isinstance(meta, BytesStorageMetadata):
            request[key] = None
            values[name] = key
            continue
        assert isinstance(meta, TensorStorageMetadata)
        shape, dtype = tuple(meta.size), meta.properties.dtype
        if op.layout.kind == "rows" and len(shape) > 0 and shape == op.layout.global_shape:
            local = torch.empty(op.layout.local_shape, dtype=dtype, device=device)
            target = op.layout.wrap(local, shape)
            if local.numel() > 0:
                _want(request, key, target)
            values[name] = target if op.state_as_dtensor else local
        else:
            if op.layout.kind == "rows" and len(shape) > 0 and shape[1:] == op.layout.global_shape[1:] \
                    and shape[0] != op.layout.global_shape[0]:
                raise _shape_error(path, f"{fqn}.{name}", "optimizer state", shape, op.layout.global_shape)
            t = torch.empty(shape, dtype=dtype, device=device)
            _want(request, key, t)
            values[name] = t
    return values


def _known_fqns(params: list[_ModelParam], aliases: dict[str, str]) -> set[str]:
    out = set(aliases) | set(aliases.values())
    for e in params:
        out.update(e.names)
    return out


def _state_keys_by_fqn(keys: dict[str, Any], fqns: set[str]) -> dict[str, dict[str, str]]:
    """``optim.state.<fqn>.<name>`` keys grouped by fqn (the longest known fqn wins)."""
    out: dict[str, dict[str, str]] = {}
    for k in keys:
        if not k.startswith(OPTIM_STATE_PREFIX):
            continue
        rest = k[len(OPTIM_STATE_PREFIX):]
        fqn, _, name = rest.rpartition(".")
        if fqn not in fqns:  # a state name with dots, or a parameter this model does not have
            cands = [f for f in fqns if rest.startswith(f + ".")]
            if not cands:
                continue
            fqn = max(cands, key=len)
            name = rest[len(fqn) + 1:]
        out.setdefault(fqn, {})[name] = k
    return out


def _check_groups(path: str, optimizer: torch.optim.Optimizer, group_keys: dict[int, dict[str, str]],
                 small: dict[str, Any], ckpt_fqn: dict[int, str]) -> None:
    n_saved, n_here = len(group_keys), len(optimizer.param_groups)
    if n_saved != n_here or sorted(group_keys) != list(range(n_saved)):
        raise CheckpointError(
            f"checkpoint {path!r} has {n_saved} optimizer param groups but the optimizer has {n_here}; "
            "build the optimizer with the same param groups (and, for OwnerRoutedOptimizer, the same roles)"
        )
    for gi, group in enumerate(optimizer.param_groups):
        names = group_keys[gi]
        saved_role = small.get(names["role"]) if "role" in names else None
        if saved_role is not None and group.get("role") is not None and saved_role != group["role"]:
            raise CheckpointError(f"checkpoint {path!r}: optimizer param group {gi} has role {saved_role!r} "
                                  f"in the checkpoint but {group['role']!r} here")
        if "params" not in names:
            continue
        saved = list(small[names["params"]])
        here = [ckpt_fqn.get(id(p), "?") for p in group["params"]]
        if set(saved) != set(here):  # sets: a tied checkpoint may feed an untied model
            only_saved = sorted(set(saved) - set(here))
            only_here = sorted(set(here) - set(saved))
            raise CheckpointError(
                f"checkpoint {path!r}: optimizer param group {gi} holds different parameters "
                f"(only in the checkpoint: {only_saved}; only here: {only_here}); build the optimizer "
                "with the same param groups and roles (e.g. OwnerRoutedOptimizer(model, ...) on every "
                "layout, so names give the roles)"
            )


def _cast_like_torch(values: dict[str, Any], op: _OptParam) -> dict[str, Any]:
    """Cast floating state to the updated tensor's dtype and device, as ``torch.optim`` does
    (``step`` keeps its dtype)."""
    ref = op.proxy if op.proxy is not None else op.param
    if _is_dtensor(ref):
        ref = ref._local_tensor  # type: ignore[union-attr]
    out = {}
    for name, v in values.items():
        if isinstance(v, torch.Tensor) and not _is_dtensor(v) and name != "step" and v.is_floating_point() \
                and ref is not None and ref.is_floating_point():
            v = v.to(dtype=ref.dtype, device=ref.device)
        out[name] = v
    return out


def _install(optimizer: torch.optim.Optimizer, op: _OptParam, values: dict[str, Any]) -> None:
    """Replace the state of ``op.param`` in place: the parent's dict object is shared with the
    child optimizer's state (OwnerRoutedOptimizer), so update it rather than rebinding it."""
    st = optimizer.state[op.param]
    st.clear()
    st.update(values)
    for child_state in op.children:
        if op.proxy is not None and child_state.get(op.proxy) is not st:
            child_state[op.proxy] = st
