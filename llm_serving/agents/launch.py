"""How an agent process is launched: its environment, working directory, launch token and token file, huge pages.

The master starts an agent as `python -m llm_serving.agents.server` (another node's `llm-serving agent` too,
agents/node.py) with the environment `child_env` builds: what the agent is (ENV_CONFIG), the secret every
connect must carry (ENV_TOKEN) and the pipe it reports its status on (ENV_STATUS_FD); or, started ahead of need as
a spare (ENV_SPARE, master/spare_agents.py), the first two on its standard input once it is given a model. What
travels once the agent listens is the wire protocol's (agents/protocol.py).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from llm_serving.cache_dir import default_cache_dir

ENV_CONFIG = "LLM_SERVING_AGENT_CONFIG"    # JSON: {"config": {...}, "model_dir": str, "rank": int,
#                                                 "tp_comm": CPU tensor-parallel segment name | null,
#                                                 "remote": started on another node by `llm-serving agent`}
ENV_TOKEN = "LLM_SERVING_AGENT_TOKEN"      # per-launch secret every connect must carry; never logged
ENV_STATUS_FD = "LLM_SERVING_AGENT_STATUS_FD"   # pipe for the agent's status lines (listening/ready/failed)
# "1": a spare agent (master/spare_agents.py): it imports MindSpore and the runner first, then reads the rest of its
# environment (ENV_CONFIG, ENV_TOKEN) as one JSON line {"env": {...}} on its standard input; EOF: it exits
ENV_SPARE = "LLM_SERVING_AGENT_SPARE"
# glibc >= 2.35: malloc asks for transparent huge pages (madvise) on the memory it maps, which is where MindSpore's
# CPU tensors live; weight streaming reads 2 MiB pages instead of 4 KiB ones (serving_config.agent_huge_pages)
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
# agent_huge_pages auto: huge pages for checkpoints smaller than this (see ServingConfig.agent_huge_pages)
HUGE_PAGES_MAX_BYTES = 512 << 20


def agent_huge_pages(setting: str, model_dir: Optional[str]) -> bool:
    """Whether agents start with huge pages: serving_config.agent_huge_pages (auto: for a checkpoint whose
    files, a GGUF or a directory's weight files, take less than HUGE_PAGES_MAX_BYTES; a built-in model: yes)."""
    if setting != "auto":
        return setting == "on"
    path = Path(model_dir) if model_dir else None
    if path is None or not path.exists():
        return True
    files = [path] if path.is_file() else [f for f in path.iterdir()
                                           if f.suffix in (".gguf", ".safetensors", ".bin", ".npy")]
    return sum(f.stat().st_size for f in files) < HUGE_PAGES_MAX_BYTES


def with_huge_pages(env: dict) -> dict:
    """env with HUGE_PAGES_TUNABLE added to GLIBC_TUNABLES (kept as it is when that already sets hugetlb)."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb=" in tunables:
        return env
    return {**env, "GLIBC_TUNABLES": ":".join(filter(None, [tunables, HUGE_PAGES_TUNABLE]))}


def child_env(extra: dict, huge_pages: bool = False) -> tuple:
    """(environment, working directory) of an agent or cluster-scheduler process (the master's, or another
    node's `llm-serving agent`'s): this package importable, MindSpore's C++ log at errors only (it warns on every
    cached graph), its memory in huge pages if asked (with_huge_pages), and a working directory of its own, since
    MindSpore writes kernel build files into it."""
    env = {**os.environ, **extra}
    if huge_pages:
        env = with_huge_pages(env)
    env.setdefault("GLOG_v", "3")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                      env.get("PYTHONPATH")]))
    workdir = default_cache_dir() / "agent-workdir"
    workdir.mkdir(parents=True, exist_ok=True)
    return env, workdir


def runtime_dir() -> Path:
    """Where the master leaves each agent's launch token for `llm-serving agent-ctl` (mode 0700)."""
    base = os.environ.get("LLM_SERVING_RUNTIME_DIR") or os.path.join(
        os.environ.get("XDG_RUNTIME_DIR") or os.path.expanduser("~/.cache/llm-serving"), "run")
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def token_file(port: int) -> Path:
    """The file (mode 0600) holding the launch token of the agent listening on `port`."""
    return runtime_dir() / f"agent-{port}.token"


def read_token_file(path: str) -> str:
    """The launch token a group shares across nodes (serving_config.agent_token_file): the file's first word.
    ValueError when others than its owner may read the file, or it holds no token of 16 characters or more."""
    p = Path(path).expanduser()
    try:
        mode = p.stat().st_mode
        words = p.read_text().split()
    except OSError as exc:
        raise ValueError(f"serving_config.agent_token_file {path!r}: {exc.strerror}") from None
    if mode & 0o077:
        raise ValueError(f"serving_config.agent_token_file {path!r} may be read by others (mode {mode & 0o777:o}): "
                         "chmod 600 it")
    if not words or len(words[0]) < 16:
        raise ValueError(f"serving_config.agent_token_file {path!r} must hold a token of at least 16 characters")
    return words[0]
