"""Shared CLI pieces: the built-in GPT flags and loading a user's ``module:factory`` model."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

from torch import nn

from ..models import GPT, GPTConfig

__all__ = ["add_model_args", "build_model", "load_factory"]


def add_model_args(
    parser: argparse.ArgumentParser, *, layers: int, width: int, vocab: int, heads: int, seq_len: int
) -> None:
    g = parser.add_argument_group("built-in GPT")
    g.add_argument("--layers", type=int, default=layers, help="transformer blocks")
    g.add_argument("--width", type=int, default=width, help="model width d_model")
    g.add_argument("--heads", type=int, default=heads, help="attention heads")
    g.add_argument("--vocab", type=int, default=vocab, help="vocabulary size")
    g.add_argument("--seq-len", type=int, default=seq_len, help="context length")
    g.add_argument("--untied", action="store_true", help="do not tie the LM head to the embedding")
    g.add_argument(
        "--model",
        default=None,
        metavar="MODULE:FACTORY",
        help="plan a user model instead: a callable returning an nn.Module "
        "(called with device='meta' when it accepts a device keyword)",
    )


def gpt_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq_len,
        n_layers=args.layers,
        d_model=args.width,
        n_heads=args.heads,
        tie_embeddings=not args.untied,
    )


def load_factory(spec: str) -> Callable[..., Any]:
    """Import ``module:attr`` and return the attribute, with errors that say what to fix."""
    if ":" not in spec:
        raise SystemExit(f"--model {spec!r}: expected MODULE:FACTORY, e.g. mypkg.models:build")
    mod_name, attr = spec.split(":", 1)
    try:
        module = importlib.import_module(mod_name)
    except ImportError as exc:
        raise SystemExit(f"--model {spec!r}: cannot import module {mod_name!r}: {exc}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise SystemExit(f"--model {spec!r}: module {mod_name!r} has no attribute {attr!r}") from None


def build_model(args: argparse.Namespace, *, device: str = "meta") -> tuple[nn.Module, list[str] | None]:
    """The model to plan and its unit prefixes (FSDP2 call order) when known."""
    if args.model:
        factory = load_factory(args.model)
        try:
            model = factory(device=device)
        except TypeError:
            model = factory()
        if not isinstance(model, nn.Module):
            raise SystemExit(f"--model {args.model!r} returned {type(model).__name__}, not an nn.Module")
        unit_prefixes = getattr(model, "unit_prefixes", None)
        prefixes = list(unit_prefixes()) if callable(unit_prefixes) else None
        return model, prefixes
    model = GPT(gpt_config(args), device=device)
    return model, model.unit_prefixes()
