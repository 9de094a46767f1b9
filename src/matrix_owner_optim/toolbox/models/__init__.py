"""Built-in models for the CLI, benchmarks and tests."""

from .gpt import GPT, Block, GPTConfig

__all__ = ["GPT", "Block", "GPTConfig"]
