"""Removing the shared-memory segments of servers that died without removing them.

A master unlinks its segments when it stops, and its resource tracker (a process Python starts beside it) when
it is killed. When both are killed at once (the OOM killer, `kill -9` of the process group), the segments stay
in /dev/shm until reboot. Their names carry the pid of the master that created them (buffers.segment_stem), so
a start removes those whose master is gone: no process with that pid, a zombie, or a process with that pid that
started after the segment was made (the pid was reused). Only its own deployment's (the same
LLM_SERVING_SHM_TAG, or none for both): another deployment's leftovers are its own next start's, and a start of
one deployment never races another's checks of what it left. Names of another form, segments of other users, and
those made in another pid namespace (another container sharing /dev/shm: its processes are not visible here)
are never touched.
"""
from __future__ import annotations

import logging
import os
from collections import defaultdict

import psutil

from llm_serving.shm.buffers import pid_namespace, segment_owner, segment_tag

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
CLOCK_SLACK_S = 2.0     # a process's start time is known to about a second (the boot time is whole seconds)


def runs_llm_serving(args: list) -> bool:
    """Whether a command line is one of this project's processes (`python -m llm_serving.…`, the `llm-serving`
    script)."""
    return any(a.startswith("llm_serving.") or os.path.basename(a) == "llm-serving" for a in args)


def owner_alive(pid: int, made_at: float) -> bool:
    """Whether the process that made a segment at `made_at` (epoch seconds) may still be the process `pid`.

    A live process that runs llm-serving always counts as the owner: start times are wall-clock times (psutil
    derives them from the boot time, which moves when the clock is stepped), so comparing them would take a live
    master for a reused pid after an NTP step. Any other live process with that pid is the owner unless it
    started after the segment was made (the pid was reused)."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return runs_llm_serving(process.cmdline()) or process.create_time() <= made_at + CLOCK_SLACK_S
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:          # another user's process: alive, and not ours to judge
        return True


def stale_segments(shm_dir: str = SHM_DIR, tag: str | None = None) -> dict:
    """{dead owner pid: [segment names]} of this user's segments, of this process's tag (or `tag`), whose master is
    gone."""
    stale = defaultdict(list)
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return {}
    uid, namespace, tag = os.getuid(), pid_namespace(), segment_tag() if tag is None else tag
    for name in sorted(names):
        owner = segment_owner(name, tag)
        if owner is None or owner[1] != namespace:
            continue
        pid = owner[0]
        try:
            st = os.stat(os.path.join(shm_dir, name))
        except FileNotFoundError:        # removed meanwhile
            continue
        if st.st_uid != uid:
            continue
        if not owner_alive(pid, st.st_ctime):       # (st_ctime: when it was made, or changed since)
            stale[pid].append(name)
    return dict(stale)


def sweep_stale_segments(shm_dir: str = SHM_DIR, tag: str | None = None) -> list:
    """Unlink the segments stale_segments finds, logging each dead master's; returns the names removed."""
    removed = []
    for pid, names in stale_segments(shm_dir, tag).items():
        gone = []
        for name in names:
            try:
                os.unlink(os.path.join(shm_dir, name))
                gone.append(name)
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("could not remove shared-memory segment %s of dead master pid %d: %s", name, pid, exc)
        if gone:
            logger.warning("removed %d shared-memory segment(s) left by master pid %d, which is gone: %s",
                           len(gone), pid, ", ".join(gone))
        removed += gone
    return removed
