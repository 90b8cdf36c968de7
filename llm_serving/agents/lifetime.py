"""Process lifetime: every process the master (or another node's `llm-serving agent`) starts dies with it.

`spawn` starts a child with Linux's PR_SET_PDEATHSIG set to SIGKILL, set in the child between fork and exec:
the kernel kills the child the moment its parent goes, whatever the child is doing (a MindSpore graph compile
may hold the GIL for a minute, during which no Python thread of the child runs). Right after the prctl, the
child checks that its parent is still the one that forked it, which closes the window where the parent died
before the prctl ran. The child also finds its parent's pid in PARENT_PID_ENV, for a Python watcher of its own
(`parent_gone`: agents/server.py), which covers the cases the kernel cannot.

Linux sends the signal when the *thread* that forked the child exits, not the process. Children are therefore
started from the main thread (the master's asyncio loop runs there, and so does the node launcher's loop); a
spawn from another thread, which may end while the process goes on, gets no PDEATHSIG and relies on the watcher.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import threading

logger = logging.getLogger(__name__)

PARENT_PID_ENV = "LLM_SERVING_PARENT_PID"    # the pid of the process that started this one
PR_SET_PDEATHSIG = 1                         # <linux/prctl.h>


def _load_prctl():
    """libc's prctl, looked up once in the parent (the child between fork and exec must not import or load)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):        # not Linux: children rely on their watcher
        return None
    prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    prctl.restype = ctypes.c_int
    return prctl


_prctl = _load_prctl()


def _die_with(parent_pid: int):
    """The preexec_fn of a child of `parent_pid`: SIGKILL when the parent dies, and exit now if it already has."""
    sigkill = int(signal.SIGKILL)

    def preexec() -> None:
        _prctl(PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)
    return preexec


def spawn(args: list, env: dict, cwd=None, pass_fds=(), stdin=None) -> subprocess.Popen:
    """subprocess.Popen(args) in a session of its own (a terminal's Ctrl-C reaches the parent only, which then
    stops its children in order), killed by the kernel when this process dies (see the module docstring)."""
    pid = os.getpid()
    preexec = None
    if _prctl is not None and threading.current_thread() is threading.main_thread():
        preexec = _die_with(pid)
    elif _prctl is not None:
        logger.warning("%s started from thread %r, not the main thread: it will not be killed with this process "
                       "by the kernel, only by its own watcher", args[-1], threading.current_thread().name)
    return subprocess.Popen(args, env={**env, PARENT_PID_ENV: str(pid)}, cwd=cwd, pass_fds=pass_fds, stdin=stdin,
                            start_new_session=True, preexec_fn=preexec)


def expected_parent() -> int:
    """The pid of the process that started this one: PARENT_PID_ENV when `spawn` did, else the current parent.
    Read once: it leaves the environment, so that this process's own children do not take it for theirs."""
    value = os.environ.pop(PARENT_PID_ENV, "")
    return int(value) if value.isdigit() else os.getppid()


def parent_gone(parent_pid: int) -> bool:
    """Whether `parent_pid` is no longer this process's parent: it exited (its children are handed to another
    process as it does, before it is even reaped)."""
    return os.getppid() != parent_pid
