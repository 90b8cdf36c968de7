"""Nothing outlives its master: children killed with their parent, dead masters' segments swept, the compile
cache's lock released by a holder's death."""
import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing import shared_memory

import psutil
import pytest

from llm_serving.agents.lifetime import PARENT_PID_ENV, expected_parent, parent_gone, spawn
from llm_serving.shm.buffers import pid_namespace, segment_owner, segment_prefix, segment_stem
from llm_serving.shm.sweep import owner_alive, runs_llm_serving, stale_segments, sweep_stale_segments
from tests.conftest import REPO, SESSION_TAG


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# --- children die with their parent --------------------------------------------------------------------

# a parent that spawns a child busy in C code (no Python of its own runs), reports its pid, and waits to be killed
_PARENT = textwrap.dedent("""
    import os, sys, time
    from llm_serving.agents.lifetime import spawn
    child = spawn(["sleep", "600"], dict(os.environ))
    print(child.pid, flush=True)
    time.sleep(600)
""")


def test_a_spawned_child_is_killed_by_the_kernel_when_its_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        child = int(parent.stdout.readline())
        assert psutil.Process(child).ppid() == parent.pid
        assert psutil.Process(child).environ()[PARENT_PID_ENV] == str(parent.pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert _wait_gone(child, 5.0), "the child outlived its parent"
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()


def test_a_child_spawned_from_another_thread_only_has_its_watcher():
    """Linux ties the death signal to the forking thread: a thread that ends must not take the child with it."""
    started = []
    thread = threading.Thread(target=lambda: started.append(spawn(["sleep", "30"], dict(os.environ))))
    thread.start()
    thread.join()
    child = started[0]
    try:
        time.sleep(0.3)
        assert child.poll() is None, "the child died with the thread that started it"
    finally:
        child.kill()
        child.wait()


def test_the_expected_parent_comes_from_the_environment(monkeypatch):
    other = os.getppid() + 1                           # any pid but this process's parent (a fixed one can be it)
    monkeypatch.setenv(PARENT_PID_ENV, str(other))
    assert expected_parent() == other
    assert PARENT_PID_ENV not in os.environ            # this process's own children start without it
    assert expected_parent() == os.getppid()
    assert not parent_gone(os.getppid())
    assert parent_gone(other)


# --- shared-memory segments of dead masters ------------------------------------------------------------

def test_a_segment_name_carries_its_creators_pid_after_the_session_tag():
    stem, ns = segment_stem(), pid_namespace()
    assert stem.startswith(f"llmsrv_{SESSION_TAG}_p{os.getpid()}n{ns}_") and stem.startswith(segment_prefix())
    assert segment_owner(f"{stem}_input_ids") == (os.getpid(), ns)
    assert segment_owner("llmsrv_p12n34_0123456789ab_out_verify_ids") == (12, 34)         # no tag
    assert segment_owner("llmsrv_p7n8_p12n34_0123456789ab_tp") == (12, 34)              # a tag that looks the same
    assert segment_owner("llmsrv_p7n8_p12n34_0123456789ab_tp", tag="p7n8") == (12, 34)
    assert segment_owner("llmsrv_p7n8_p12n34_0123456789ab_tp", tag="") is None          # another deployment's
    assert segment_owner("llmsrv_p12n34_0123456789ab_tp", tag="") == (12, 34)
    # other namings: the form before pids, another program's, a longer random part
    for name in ["llmsrv_t1_0123456789ab_input_ids", "llmsrv_0123456789ab_tp", "psm_12345", "llmsrv_p12_0123456789ab_x",
                 "llmsrv_p12n34_0123456789abc_x", "xllmsrv_p12n34_0123456789ab_x"]:
        assert segment_owner(name) is None, name


def test_a_pid_reused_by_a_later_process_is_no_owner():
    me = psutil.Process().create_time()
    assert owner_alive(os.getpid(), made_at=me + 10)
    assert not owner_alive(os.getpid(), made_at=me - 60)      # made a minute before this process started
    assert not owner_alive(_dead_pid(), made_at=time.time())


def test_a_live_llm_serving_process_owns_its_segments_whatever_the_clock_says(monkeypatch):
    """A clock stepped forward (NTP) moves psutil's start times, not a segment's ctime: a live master whose start
    time now looks later than its segments is still their owner; any other process is judged by start time."""
    assert runs_llm_serving(["/usr/bin/python3", "-m", "llm_serving.cli", "start", "--port", "8000"])
    assert runs_llm_serving(["/usr/bin/python3", "-m", "llm_serving.agents.server"])
    assert runs_llm_serving(["/opt/venv/bin/python", "/opt/venv/bin/llm-serving", "start"])
    assert not runs_llm_serving(["/srv/llm-serving/.venv/bin/python", "-m", "pytest", "tests"])
    assert not runs_llm_serving(["python", "-c", "from multiprocessing.resource_tracker import main;main(15)"])
    later = time.time() + 3600
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: later)
    monkeypatch.setattr(psutil.Process, "cmdline", lambda self: ["python", "-m", "llm_serving.cli", "start"])
    assert owner_alive(os.getpid(), made_at=time.time())
    monkeypatch.setattr(psutil.Process, "cmdline", lambda self: ["python", "-m", "http.server"])
    assert not owner_alive(os.getpid(), made_at=time.time())


def test_the_sweep_removes_dead_masters_segments_and_keeps_the_rest(tmp_path):
    dead, live, ns = _dead_pid(), os.getpid(), pid_namespace()
    names = {
        "dead": [f"llmsrv_{SESSION_TAG}_p{dead}n{ns}_00112233aabb_{a}" for a in ("input_ids", "block_tables", "tp")],
        "live": [f"llmsrv_{SESSION_TAG}_p{live}n{ns}_00112233aabb_input_ids"],
        # another naming, another program's, a dead pid of another pid namespace (a container sharing /dev/shm),
        # a dead master of another deployment (another tag, or none: its own next start removes them)
        "other": [f"llmsrv_{SESSION_TAG}_00112233aabb_input_ids", "psm_deadbeef", f"llmsrv_p{dead}n{ns}_xyz",
                  f"llmsrv_{SESSION_TAG}_p{dead}n{ns + 1}_00112233aabb_input_ids",
                  f"llmsrv_x{SESSION_TAG}_p{dead}n{ns}_00112233aabb_input_ids",
                  f"llmsrv_p{dead}n{ns}_00112233aabb_input_ids"],
    }
    for group in names.values():
        for name in group:
            (tmp_path / name).write_bytes(b"\0" * 64)
    assert stale_segments(str(tmp_path)) == {dead: sorted(names["dead"])}
    assert sorted(sweep_stale_segments(str(tmp_path))) == sorted(names["dead"])
    assert sorted(os.listdir(tmp_path)) == sorted(names["live"] + names["other"])
    assert sweep_stale_segments(str(tmp_path)) == []
    # asked for another tag by name (the tests' sweep of earlier test processes): that tag's dead masters only
    other_tag = f"x{SESSION_TAG}"
    assert sweep_stale_segments(str(tmp_path), tag=other_tag) == [
        f"llmsrv_{other_tag}_p{dead}n{ns}_00112233aabb_input_ids"]
    assert sweep_stale_segments(str(tmp_path), tag="") == [f"llmsrv_p{dead}n{ns}_00112233aabb_input_ids"]


def test_the_sweep_of_dev_shm_unlinks_a_real_segment_of_a_dead_master():
    dead = _dead_pid()
    name = f"{segment_prefix()}p{dead}n{pid_namespace()}_{os.urandom(6).hex()}_input_ids"
    stale = shared_memory.SharedMemory(name=name, create=True, size=64)
    mine = shared_memory.SharedMemory(name=f"{segment_stem()}_input_ids", create=True, size=64)
    try:
        removed = sweep_stale_segments()
        assert name in removed and mine.name not in removed
        assert not os.path.exists(f"/dev/shm/{name}") and os.path.exists(f"/dev/shm/{mine.name}")
    finally:
        for seg in (stale, mine):
            seg.close()
            try:
                seg.unlink()
            except FileNotFoundError:
                pass


# --- the compile cache's lock --------------------------------------------------------------------------

_HOLDER = textwrap.dedent("""
    import sys, time
    from llm_serving.models.mindspore_env import _lock_cache
    assert _lock_cache(sys.argv[1], wait=False)
    print("locked", flush=True)
    time.sleep(600)
""")


def test_the_compile_cache_lock_of_a_killed_holder_makes_no_start_wait(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "locked"
        with open(tmp_path / ".lock", "a") as f:
            with pytest.raises(BlockingIOError):
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        assert (tmp_path / ".lock").exists()            # the file stays; the lock went with its holder
        with open(tmp_path / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
