"""Models shipped with shardline."""

from shardline.models.gpt import GPT, Block, GPTConfig

__all__ = ["GPT", "Block", "GPTConfig"]
