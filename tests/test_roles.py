"""Default roles: what is a head, and what happens when parameters come without names."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from matrix_owner_optim import OwnerRoutedOptimizer, Role, plan_model
from matrix_owner_optim.planning.roles import module_roles
from matrix_owner_optim.toolbox.models import GPT, GPTConfig


class _FeedForward(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _Block(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.attention = nn.Linear(d, d, bias=False)
        self.feed_forward = _FeedForward(d, hidden)


class _Llama(nn.Module):
    """A llama-shaped transformer: vocab = hidden = 4 d, so w1/w3 have the table's shape."""

    def __init__(
        self, d: int = 16, layers: int = 3, tied_functionally: bool = False, head_name: str = "output"
    ) -> None:
        super().__init__()
        vocab = 4 * d
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_Block(d, 4 * d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        if not tied_functionally:
            self.add_module(head_name, nn.Linear(d, vocab, bias=False))


def _mlp_roles(model: nn.Module) -> dict[str, Role]:
    roles = module_roles(model)
    return {n: roles[id(p)] for n, p in model.named_parameters() if ".feed_forward." in n}


@pytest.mark.parametrize("tied_functionally", [False, True])
def test_vocab_4d_transformer_every_mlp_matrix_is_matrix(tied_functionally: bool) -> None:
    model = _Llama(tied_functionally=tied_functionally)
    mlp = _mlp_roles(model)
    assert len(mlp) == 9 and set(mlp.values()) == {Role.MATRIX}, mlp
    roles = module_roles(model)
    assert roles[id(model.tok_embeddings.weight)] is Role.ROWS
    if not tied_functionally:  # "output": not named like a head, but the final projection
        assert roles[id(model.output.weight)] is Role.ROWS
    # The planner sees the same roles.
    plan = plan_model(model, 2)
    assert plan["layers.0.feed_forward.w1.weight"].role is Role.MATRIX
    assert plan["layers.2.feed_forward.w3.weight"].role is Role.MATRIX


def test_gpt_with_vocab_4d_routes_every_mlp_matrix_to_muon() -> None:
    model = GPT(GPTConfig(vocab_size=4 * 32, d_model=32, n_heads=4, n_layers=2, seq_len=16, tie_embeddings=False))
    opt = OwnerRoutedOptimizer(model)
    routes = {r["name"]: r["role"] for r in opt.routes()}
    fc = [n for n in routes if n.endswith("mlp.fc.weight")]
    assert fc and all(routes[n] == "matrix" for n in fc)
    assert routes["lm_head.weight"] == "rows" and routes["wte.weight"] == "rows"


def test_heads_by_tie_name_and_position() -> None:
    # Tied: the Linear's weight is the embedding's.
    model = _Llama(head_name="proj_out")
    model.proj_out.weight = model.tok_embeddings.weight
    assert module_roles(model)[id(model.proj_out.weight)] is Role.ROWS
    # Named like a head, anywhere.
    model = nn.Sequential()
    model.add_module("embed", nn.Embedding(40, 8))
    model.add_module("lm_head", nn.Linear(8, 40))
    model.add_module("after", nn.Linear(40, 40))
    roles = module_roles(model)
    assert roles[id(model.lm_head.weight)] is Role.ROWS
    # Last Linear with 40 = vocabulary outputs, but not alone among its parent's Linears.
    assert roles[id(model.after.weight)] is Role.MATRIX


def test_a_plain_mlp_has_no_head() -> None:
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 10))
    roles = module_roles(model)
    assert {roles[id(p)] for p in model.parameters() if p.ndim == 2} == {Role.MATRIX}


def test_unnamed_parameters_warn_once_listing_shape_routed() -> None:
    model = _Llama(layers=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        OwnerRoutedOptimizer(model.parameters())
    relevant = [w for w in caught if "routed by shape alone" in str(w.message)]
    assert len(relevant) == 1
    msg = str(relevant[0].message)
    assert "(64, 16)" in msg and "#0" in msg  # the embedding table, by index and shape
    assert "named_parameters" in msg
    # Several unnamed groups: still one warning, listing the matrices of every group.
    params = list(model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        OwnerRoutedOptimizer([{"params": params[:2]}, {"params": params[2:]}])
    relevant = [w for w in caught if "routed by shape alone" in str(w.message)]
    assert len(relevant) == 1
    listed = str(relevant[0].message).split(":")[1]
    assert listed.count("#") == sum(1 for p in params if p.ndim == 2)
    # Names, or the module itself, route without the warning.
    for params in (model, model.named_parameters()):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            OwnerRoutedOptimizer(params)


def test_channels_last_conv_kernel_in_matrix_role_is_refused() -> None:
    conv = nn.Conv2d(3, 8, 3, bias=False).to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match=r"conv\.weight.*channels_last|conv\.weight.*contiguous"):
        OwnerRoutedOptimizer([("conv.weight", conv.weight)], roles={"conv.*": "matrix"})
    # Routed to the tail it is fine; contiguous it is a matrix.
    OwnerRoutedOptimizer([("conv.weight", conv.weight)], roles={"conv.*": "tail"})
    plain = nn.Conv2d(3, 8, 3, bias=False)
    OwnerRoutedOptimizer([("conv.weight", plain.weight)], roles={"conv.*": "matrix"})
