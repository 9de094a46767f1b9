"""Default roles and user overrides (``{"fqn-glob": role}``, the last matching glob wins).

From a module: 2D ``nn.Linear`` weights and stacks of matrices (a >2D parameter of a non-conv
module, :mod:`.views`) are ``matrix``; ``nn.Embedding`` weights and output heads are ``rows``;
an MoE router (:func:`router_fqns`) and everything else is ``tail``. An output head is a Linear
tied to an embedding, named like a head (:data:`EMBEDDING_NAME_HINTS`) or the model's final
projection (:func:`final_projection`), never just any Linear of the vocabulary table's shape
(with ``vocab = 4 d`` every MLP up-projection has it). From names alone: 2D tensors are
``matrix`` unless named like an embedding, a head or a router; >2D tensors named like experts
(:data:`STACK_NAME_HINTS`) are stacks. The router stays on the tail optimizer, as Moonlight's,
torchtitan's and Megatron's Muon MoE recipes keep it: its rows are per-expert logit scales that
load balancing tunes one by one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .globs import GlobOverrides
from .metadata import Role, parse_role
from .views import MatrixView, ViewOverrides

__all__ = [
    "TensorSpec",
    "EMBEDDING_NAME_HINTS",
    "STACK_NAME_HINTS",
    "ROUTER_MODULE_NAMES",
    "router_fqns",
    "is_matrix_stack",
    "RoleOverrides",
    "role_from_name",
    "specs_from_module",
    "module_roles",
    "final_projection",
    "validate_role",
]

# Substrings of a parameter name that mark an embedding table or an output head.
EMBEDDING_NAME_HINTS: tuple[str, ...] = (
    "embed",
    "wte",
    "wpe",
    "tok_emb",
    "pos_emb",
    "lm_head",
    "output_head",
)
# Substrings of a >2D parameter's name that mark a stack of matrices when no module is known.
STACK_NAME_HINTS: tuple[str, ...] = ("expert",)
# Module names of a mixture-of-experts router, when a sibling or parent holds the experts.
ROUTER_MODULE_NAMES: tuple[str, ...] = ("gate", "router")
EXPERTS_MODULE_NAMES: tuple[str, ...] = ("experts", "shared_experts", "shared_expert")


def is_experts_module(name: str) -> bool:
    """A module name that holds experts: ``experts``, ``shared_experts``, ``shared_expert`` and
    any other name ending in ``experts`` / ``expert`` (torchtitan's ``routed_experts``)."""
    return name in EXPERTS_MODULE_NAMES or name.endswith(("experts", "expert"))


def router_fqns(fqns: Iterable[str]) -> set[str]:
    """The names among ``fqns`` of mixture-of-experts routers: a parameter of a module named
    ``gate`` or ``router`` (or ``*expert_gate``, Qwen2-MoE's shared-expert gate) whose parent or
    grandparent module also holds experts (:func:`is_experts_module`: transformers
    ``mlp.gate.weight`` next to ``mlp.experts``; torchtitan ``moe.router.gate.weight`` next to
    ``moe.routed_experts`` or ``moe.shared_experts``). A GLU's
    ``gate_proj`` is not a router, and neither is a ``gate`` with no experts beside it."""
    names = list(fqns)
    with_experts: set[str] = set()
    for n in names:
        parts = n.split(".")
        for i, part in enumerate(parts[:-1]):
            if is_experts_module(part):
                with_experts.add(".".join(parts[:i]))
    found: set[str] = set()
    for n in names:
        parts = n.split(".")
        if len(parts) < 2:
            continue
        module = parts[-2]
        if module not in ROUTER_MODULE_NAMES and not module.endswith("expert_gate"):
            continue
        if ".".join(parts[:-2]) in with_experts or (len(parts) >= 3 and ".".join(parts[:-3]) in with_experts):
            found.add(n)
    return found


def is_matrix_stack(fqn: str, shape: tuple[int, ...]) -> bool:
    """A >2D tensor that reads as a stack of matrices: its last two dims both > 1 and its name
    not an embedding's (a ViT ``pos_embed`` ``[1, T, d]`` or a ``cls_token`` is not one)."""
    if len(shape) < 3 or shape[-2] < 2 or shape[-1] < 2:
        return False
    return not any(h in fqn.lower() for h in EMBEDDING_NAME_HINTS)


@dataclass(frozen=True)
class TensorSpec:
    """What the planner needs to know about one parameter (no values)."""

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    role: Role
    unit: int = 0
    aliases: tuple[str, ...] = ()
    requires_grad: bool = True
    view: MatrixView | None = None  # how a matrix is read (None: the default of views.py)
    # placed whole on one owner, never split by expert or band: a TP or EP slice on a 2D mesh,
    # held whole by its dp owner (sharding/build.py: _whole_slices)
    whole: bool = False


class RoleOverrides(GlobOverrides[Role]):
    """``roles={"fqn-glob": role}`` (:class:`~.globs.GlobOverrides`: the last match wins, an
    unmatched glob is an error)."""

    what = "roles"

    def __init__(self, roles: Mapping[str, str | Role] | None) -> None:
        super().__init__(roles, lambda v, where: parse_role(v, where=where))  # type: ignore[arg-type]


def validate_role(fqn: str, shape: tuple[int, ...], role: Role) -> None:
    """A ``matrix`` needs at least two dims; a ``rows`` tensor at least one."""
    if role is Role.MATRIX and len(shape) < 2:
        raise ValueError(
            f"parameter {fqn!r} with shape {tuple(shape)} cannot take role 'matrix': matrix "
            "optimizers need a 2D tensor (or >2D: a stack of matrices or a conv kernel, see "
            "matrix_views=); route it to 'tail'"
        )
    if role is Role.ROWS and len(shape) < 1:
        raise ValueError(f"parameter {fqn!r} is a scalar and cannot take role 'rows'; use 'tail'")


def role_from_name(fqn: str, shape: tuple[int, ...], *, router: bool = False) -> Role:
    """Default role when only a name and a shape are known (``router``: the name is in
    :func:`router_fqns` of the names around it)."""
    if len(shape) == 2:
        lowered = fqn.lower()
        if any(h in lowered for h in EMBEDDING_NAME_HINTS):
            return Role.ROWS
        return Role.TAIL if router else Role.MATRIX
    if any(h in fqn.lower() for h in STACK_NAME_HINTS) and is_matrix_stack(fqn, shape):
        return Role.MATRIX
    return Role.TAIL


def final_projection(model: nn.Module, vocab_sizes: set[int]) -> nn.Linear | None:
    """The model's final projection onto a vocabulary, if it has one.

    That is the last ``nn.Linear`` registered in ``model`` when (a) its ``out_features`` is a
    vocabulary size (the row count of an embedding table with more rows than columns) and (b) it
    is the only Linear among its parent module's direct children. (b) keeps a block's own
    projections out: in a model whose head is tied functionally (no head module), the last
    Linear is inside the last block (e.g. an MLP's ``w3``), next to its siblings.
    """
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears or not vocab_sizes:
        return None
    name, last = linears[-1]
    if last.out_features not in vocab_sizes:
        return None
    parent = name.rpartition(".")[0]
    siblings = [n for n, _ in linears if n.rpartition(".")[0] == parent]
    return last if len(siblings) == 1 else None


def module_roles(model: nn.Module) -> dict[int, Role]:
    """Default role of every parameter object of ``model``, keyed by ``id``."""
    embedding_ids: set[int] = set()
    vocab_sizes: set[int] = set()
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            embedding_ids.add(id(module.weight))
            rows, cols = module.weight.shape
            # Only a table with more rows than columns reads as a vocabulary; a square
            # positional table would otherwise make a d x d projection look like a head.
            if rows > cols:
                vocab_sizes.add(int(rows))
    head = final_projection(model, vocab_sizes)
    routers = router_fqns(name for name, _ in model.named_parameters())
    roles: dict[int, Role] = {}
    for mod_name, module in model.named_modules():
        is_conv = isinstance(module, nn.modules.conv._ConvNd)
        for p_name, param in module.named_parameters(recurse=False):
            if id(param) in roles:
                continue
            fqn = f"{mod_name}.{p_name}" if mod_name else p_name
            shape = tuple(param.shape)
            if id(param) in embedding_ids:  # an embedding, or a head tied to one
                roles[id(param)] = Role.ROWS
            elif len(shape) == 2 and fqn in routers:
                roles[id(param)] = Role.TAIL
            elif isinstance(module, nn.Linear) and p_name == "weight":
                is_head = module is head or role_from_name(fqn, shape) is Role.ROWS
                roles[id(param)] = Role.ROWS if is_head else Role.MATRIX
            elif len(shape) == 2 and not is_conv:
                roles[id(param)] = role_from_name(fqn, shape)
            elif not is_conv and is_matrix_stack(fqn, shape):
                roles[id(param)] = Role.MATRIX  # fused experts and other stacks of matrices
            else:
                roles[id(param)] = Role.TAIL
    return roles


def conv_params(model: nn.Module) -> dict[int, bool]:
    """Per parameter object (``id``): whether its module is a convolution (the view rule)."""
    return {id(p): isinstance(m, nn.modules.conv._ConvNd) for m in model.modules() for p in m.parameters(recurse=False)}


def specs_from_module(
    model: nn.Module,
    *,
    roles: Mapping[str, str | Role] | None = None,
    unit_prefixes: Iterable[str] | None = None,
    matrix_views: Mapping[str, str | MatrixView] | None = None,
) -> list[TensorSpec]:
    """One :class:`TensorSpec` per distinct parameter of ``model``, in model order.

    Every ``matrix`` spec carries its :class:`~.views.MatrixView`: a ``matrix_views`` glob's,
    else the default (conv modules ``"conv"``, other >2D tensors ``"stack"``).

    ``unit_prefixes`` lists module fqns in the order ``fully_shard`` was (or would be) called;
    a parameter belongs to the unit of the longest prefix containing it, and parameters under
    no prefix to the last unit listed as ``""`` (the root). ``None`` means a single unit.
    """
    overrides = RoleOverrides(roles)
    view_overrides = ViewOverrides(matrix_views)
    defaults = module_roles(model)
    convs = conv_params(model)
    prefixes = list(unit_prefixes) if unit_prefixes is not None else [""]
    if "" not in prefixes:
        prefixes.append("")

    def unit_of(fqn: str) -> int:
        best, best_len = prefixes.index(""), -1
        for i, prefix in enumerate(prefixes):
            if prefix and (fqn == prefix or fqn.startswith(prefix + ".")):
                if len(prefix) > best_len:
                    best, best_len = i, len(prefix)
        return best

    aliases: dict[int, list[str]] = {}
    order: list[tuple[str, nn.Parameter]] = []
    for fqn, param in model.named_parameters(remove_duplicate=False):
        if id(param) in aliases:
            aliases[id(param)].append(fqn)
        else:
            aliases[id(param)] = []
            order.append((fqn, param))

    specs = []
    for fqn, param in order:
        names = (fqn, *aliases[id(param)])
        shape = tuple(int(s) for s in param.shape)
        role = overrides.lookup(names) or defaults.get(id(param), role_from_name(fqn, shape))
        validate_role(fqn, shape, role)
        view = view_overrides.view_for(names, shape, convs.get(id(param))) if role is Role.MATRIX else None
        if view is not None:
            view.resolve(shape, fqn)  # a view that does not fit fails here, naming the parameter
        specs.append(
            TensorSpec(
                fqn=fqn,
                shape=shape,
                dtype=param.dtype,
                role=role,
                unit=unit_of(fqn),
                aliases=tuple(aliases[id(param)]),
                requires_grad=bool(param.requires_grad),
                view=view,
            )
        )
    overrides.check_all_used()
    view_overrides.check_all_used()
    return specs
