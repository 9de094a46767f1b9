"""One MoE router rule for every MoE model the suite knows: the router stays on the tail optimizer
(AdamW), the experts and every other matrix go to the matrix optimizer, per model.

* transformers Mixtral and Qwen3-MoE (``mlp.gate`` next to ``mlp.experts``) and the suite's
  ``TinyMoE`` (tests/_moe.py): built, routed by ``OwnerRoutedOptimizer``;
* torchtitan 0.3's DeepSeek-V3 (``moe.router.gate`` next to ``moe.routed_experts`` and
  ``moe.shared_experts``) and Qwen3-MoE (``moe.router.gate`` next to ``moe.routed_experts``
  only: the rule missed it when it knew only ``experts`` / ``shared_experts``): their parameter
  names and shapes as torchtitan's ``models/common/moe.py`` names them, routed by the same rule
  (torchtitan's MoE modules import triton at import time, which a CPU machine lacks).
"""

from __future__ import annotations

import pytest
import torch

from _clients import build_hf
from _moe import TinyMoE
from matrix_owner_optim import OwnerRoutedOptimizer
from matrix_owner_optim.planning.roles import role_from_name, router_fqns

E, D, F, V = 8, 32, 16, 64


def _titan_layer(i: int, shared: bool) -> dict[str, tuple[int, ...]]:
    """One torchtitan MoE decoder layer's parameters (attention, norms, MoE)."""
    p = f"layers.{i}"
    names = {
        f"{p}.attention.wq.weight": (D, D),
        f"{p}.attention.wkv.weight": (2 * D, D),
        f"{p}.attention.wo.weight": (D, D),
        f"{p}.attention_norm.weight": (D,),
        f"{p}.ffn_norm.weight": (D,),
        f"{p}.moe.router.gate.weight": (E, D),
        f"{p}.moe.routed_experts.inner_experts.w1_EFD": (E, F, D),
        f"{p}.moe.routed_experts.inner_experts.w2_EDF": (E, D, F),
        f"{p}.moe.routed_experts.inner_experts.w3_EFD": (E, F, D),
    }
    if shared:
        names |= {
            f"{p}.moe.shared_experts.w1.weight": (F, D),
            f"{p}.moe.shared_experts.w2.weight": (D, F),
            f"{p}.moe.shared_experts.w3.weight": (F, D),
        }
    return names


def _titan(shared: bool) -> dict[str, tuple[int, ...]]:
    names = {"tok_embeddings.weight": (V, D), "norm.weight": (D,), "output.weight": (V, D)}
    for i in range(2):
        names |= _titan_layer(i, shared)
    return names


@pytest.mark.parametrize("model", ["deepseek_v3", "qwen3_moe"])
def test_torchtitan_routers_stay_on_the_tail(model: str) -> None:
    names = _titan(shared=model == "deepseek_v3")
    routers = router_fqns(names)
    assert routers == {f"layers.{i}.moe.router.gate.weight" for i in range(2)}
    roles = {n: role_from_name(n, shape, router=n in routers).value for n, shape in names.items()}
    assert {n for n, r in roles.items() if r == "tail" and len(names[n]) == 2} == routers
    experts = [n for n in names if "experts" in n]
    assert experts and all(roles[n] == "matrix" for n in experts), roles


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "tiny_moe"])
def test_built_models_routers_stay_on_the_tail(kind: str) -> None:
    model = TinyMoE() if kind == "tiny_moe" else build_hf(kind)
    names = [n for n, _ in model.named_parameters()]
    routers = router_fqns(names)
    assert routers and all(n.endswith("gate.weight") for n in routers), routers
    roles = {r["name"]: r["role"] for r in OwnerRoutedOptimizer(model).routes()}
    assert all(roles[n] == "tail" for n in routers), {n: roles[n] for n in routers}
    two_d = {n for n, p in model.named_parameters() if p.dim() >= 2}
    assert {n for n in two_d if roles[n] == "tail"} == routers  # no other matrix left to AdamW
    assert all(roles[n] == "matrix" for n in names if "experts" in n)


def test_frozen_parameters_are_not_routed() -> None:
    """``routes()`` lists what is stepped: a frozen matrix is in no route."""
    model = TinyMoE()
    frozen = "layers.0.mlp.q_proj.weight"
    model.get_parameter(frozen).requires_grad_(False)
    routes = {r["name"] for r in OwnerRoutedOptimizer(model).routes()}
    assert frozen not in routes and "layers.1.mlp.q_proj.weight" in routes
    assert len(routes) == sum(1 for p in model.parameters() if p.requires_grad)
    assert isinstance(model.get_parameter(frozen), torch.nn.Parameter)
