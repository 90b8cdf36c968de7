"""Where llm-serving keeps what it builds once and reuses (`default_cache_dir`): the default model, compiled
kernels, MindSpore's compile cache, dequantized GGUF weights, rebuilt GGUF vocabularies, the agents' working
directory.

A leaf: it imports nothing of the project, so every room (models, tokenizers, agents, the bench scripts) can
ask for the cache directory without importing another room.
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_ENV_VAR", "default_cache_dir"]

CACHE_ENV_VAR = "LLM_SERVING_CACHE"


def default_cache_dir() -> Path:
    """`$LLM_SERVING_CACHE`, else `~/.cache/llm-serving`."""
    env = os.environ.get(CACHE_ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "llm-serving"
