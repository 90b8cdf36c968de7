"""The integration tests' view of a server: `llm_serving.server_process.ServerProcess` plus checks that it left
no process, port or shared-memory segment behind."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import psutil

from llm_serving.server_process import ServerProcess, free_port, http, parse_sse
from llm_serving.shm.buffers import segment_prefix

__all__ = ["REPO", "ServerProcess", "free_port", "http", "leftovers", "parse_sse", "precision_gate",
           "project_shm_segments", "serving", "tagged_processes"]

REPO = Path(__file__).resolve().parents[2]


def private_cache(path: Path) -> Path:
    """A cache directory of a test's own at `path` (for LLM_SERVING_CACHE: its compile cache, GGUF tensors, models)
    whose kernels/ is the machine's: the C++ kernels are built once per machine (a minute of a core each for
    decoder_layer_cpu.cc), not once per test that wants an empty compile cache."""
    from llm_serving.cache_dir import default_cache_dir

    shared = default_cache_dir() / "kernels"
    shared.mkdir(parents=True, exist_ok=True)
    path.mkdir(parents=True, exist_ok=True)
    (path / "kernels").symlink_to(shared)
    return path


def precision_gate(url, tmp_path, *extra, cli=True):
    """`llm-serving precision` (or, cli=False, its script wrapper tools/precision.py) against url:
    (the finished process, its JSON result or None)."""
    out = tmp_path / "precision.json"
    command = ["-m", "llm_serving.cli", "precision"] if cli else [str(REPO / "tools" / "precision.py")]
    proc = subprocess.run([sys.executable, *command, "--url", url, "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def project_shm_segments() -> list:
    """This test process's segments (named with its LLM_SERVING_SHM_TAG, see tests/conftest.py)."""
    prefix = segment_prefix()
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except FileNotFoundError:
        return []


def tagged_processes(tag: str) -> list:
    """Live processes whose environment carries tag (LLM_SERVING_TEST_TAG: a master and everything it started)."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("LLM_SERVING_TEST_TAG") == tag and p.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{p.pid}: {' '.join(p.cmdline())[:100]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def leftovers(server: ServerProcess) -> list:
    """Processes, ports and shm segments of this server that are still there."""
    found = []
    for p in [psutil.Process(server.proc.pid)] if server.proc.poll() is None else []:
        found.append(f"master pid {p.pid}")
    for p in server.children:
        if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
            found.append(f"agent pid {p.pid}")
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=1):
            found.append(f"port {server.port} still accepting")
    except OSError:
        pass
    return found


@contextmanager
def serving(args: list, log_path: Path, **kwargs):
    """A ready server for the block's duration; afterwards, checks that it left no process, port or segment."""
    shm_before = set(project_shm_segments())
    server = ServerProcess(args, log_path, **kwargs)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
    assert leftovers(server) == []
    assert set(project_shm_segments()) - shm_before == set()
