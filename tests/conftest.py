import os
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# This test process's mark, inherited by every server and agent it starts: its shared-memory segments are
# named with it and its processes carry it, so the leak checks below see only this process's (with
# pytest-xdist, each worker is such a process and the workers' checks do not see each other's servers).
SESSION_TAG = f"t{os.getpid()}"
os.environ["LLM_SERVING_SHM_TAG"] = SESSION_TAG
os.environ["LLM_SERVING_TEST_SESSION"] = SESSION_TAG


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"../shared is not present at {SHARED}; it holds the pretrained test model and datasets")
    return SHARED


def _project_processes(since: float) -> list:
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline", "create_time"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["create_time"] >= since and p.pid != os.getpid() and (
                "llm_serving.agents.server" in cmd or "llm_serving.cli" in cmd or "llm-serving" in cmd):
            try:
                mine = p.environ().get("LLM_SERVING_TEST_SESSION") == SESSION_TAG
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            if mine:
                found.append(f"{p.pid}: {cmd[:120]}")
    return found


def _project_shm() -> set:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(f"llmsrv_{SESSION_TAG}_")}
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True, scope="session")
def _nothing_left_after_the_suite():
    """After the whole run: no process the suite started is alive, no shm segment it made is left."""
    start, shm_before = time.time() - 1, _project_shm()
    yield
    deadline = time.monotonic() + 10   # processes being reaped by their parents
    while time.monotonic() < deadline and _project_processes(start):
        time.sleep(0.2)
    assert _project_processes(start) == [], "processes of the project outlived the test suite"
    assert _project_shm() - shm_before == set(), "shared-memory segments of the project outlived the suite"


@pytest.fixture(autouse=True, scope="session")
def _private_runtime_dirs(tmp_path_factory):
    """Agent tokens and the default model cache go to per-run temp dirs unless the caller set them."""
    os.environ.setdefault("LLM_SERVING_RUNTIME_DIR", str(tmp_path_factory.mktemp("run")))
    yield
