"""Embedded training data: a deterministic character-level corpus of arithmetic facts.

No downloads: the corpus is generated from a seed, so every rank and every machine sees the
same bytes. Lines look like ``"417+38=455\\n"`` and ``"90-17=73\\n"``: the digits before ``=``
are noise a model can only memorise, the digits after it follow from them, so the loss
falls in two visible stages (format, then arithmetic) within a few hundred steps.
"""

from __future__ import annotations

import torch

__all__ = ["VOCAB", "encode", "decode", "arithmetic_corpus", "BatchSampler"]

VOCAB = "0123456789+-=\n"
_INDEX = {c: i for i, c in enumerate(VOCAB)}


def encode(text: str) -> torch.Tensor:
    try:
        return torch.tensor([_INDEX[c] for c in text], dtype=torch.long)
    except KeyError as exc:
        raise ValueError(f"character {exc.args[0]!r} is not in the corpus vocabulary {VOCAB!r}") from None


def decode(tokens: torch.Tensor) -> str:
    return "".join(VOCAB[int(t)] for t in tokens)


def arithmetic_corpus(num_lines: int = 20000, max_operand: int = 999, seed: int = 0) -> torch.Tensor:
    """``num_lines`` arithmetic facts as one long token tensor."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, max_operand + 1, (num_lines,), generator=g).tolist()
    b = torch.randint(0, max_operand + 1, (num_lines,), generator=g).tolist()
    op = torch.randint(0, 2, (num_lines,), generator=g).tolist()
    lines = []
    for x, y, o in zip(a, b, op, strict=True):
        if o == 0:
            lines.append(f"{x}+{y}={x + y}\n")
        else:
            x, y = max(x, y), min(x, y)
            lines.append(f"{x}-{y}={x - y}\n")
    return encode("".join(lines))


class BatchSampler:
    """Random windows of the corpus; rank ``r`` of ``W`` takes its slice of each global batch.

    The global batch of a step is the same on every rank and for every world size, so a run
    on W ranks sees exactly the data of a single-process run with the full batch.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, seed: int = 0) -> None:
        if tokens.numel() <= seq_len + 1:
            raise ValueError(f"corpus of {tokens.numel()} tokens is too short for seq_len={seq_len}")
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (self.global_batch,), generator=g)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        window = self.tokens[idx]
        return window[:, :-1], window[:, 1:]

    def rank_batch(self, step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.global_batch % world_size:
            raise ValueError(
                f"global batch {self.global_batch} is not divisible by world size {world_size}; "
                "pick a batch that is, so every rank gets the same number of sequences"
            )
        x, y = self.global_batch_at(step)
        per = self.global_batch // world_size
        return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
