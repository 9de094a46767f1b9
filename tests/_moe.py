"""A tiny mixture-of-experts block shaped like transformers 5.x's Mixtral (fused experts).

``experts.gate_up_proj`` ``[E, 2I, H]`` and ``experts.down_proj`` ``[E, H, I]`` are plain
3D ``nn.Parameter`` s of a module that is not a Linear, as in ``MixtralExperts``; the router
``gate.weight`` ``[E, H]`` sits on its own module next to them (``MixtralTopKRouter``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedExperts(nn.Module):
    def __init__(self, experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, hidden) / hidden**0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inter) / inter**0.5)

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # dense mixture (every expert on every token, weighted): small and deterministic
        gate, up = torch.einsum("th,eoh->eto", x, self.gate_up_proj).chunk(2, dim=-1)
        y = torch.einsum("eti,ehi->eth", F.silu(gate) * up, self.down_proj)
        return torch.einsum("eth,te->th", y, weights)


class Router(nn.Module):
    def __init__(self, experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, hidden) / hidden**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight).softmax(-1)


class MoEBlock(nn.Module):
    def __init__(self, experts: int = 4, hidden: int = 32, inter: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        # attention-shaped projections (mixed, not attention: the block only needs their shapes)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.gate = Router(experts, hidden)
        self.experts = FusedExperts(experts, hidden, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.norm(x)
        h = self.o_proj(self.q_proj(n) * self.k_proj(n).sigmoid() + self.v_proj(n))
        return x + self.experts(h, self.gate(h))


class TinyMoE(nn.Module):
    """``layers.{i}.mlp`` MoE blocks between an embedding and a head (Mixtral's names)."""

    def __init__(self, layers: int = 2, experts: int = 4, hidden: int = 32, inter: int = 16, vocab: int = 64) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(nn.ModuleDict({"mlp": MoEBlock(experts, hidden, inter)}) for _ in range(layers))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx).flatten(0, -2)
        for layer in self.layers:
            x = layer["mlp"](x)
        return self.lm_head(x)
