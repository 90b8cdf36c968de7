"""The warmup plan: which graphs an agent compiles before it is ready, which after, and in which order.

Warmup compiles every graph a step may need (the decode runs, each bucket's model graph, the temperature sampler
of each row count) in one fixed order: the compile cache's condition (mindspore_env.py: MindSpore names a cached
graph by its compile index in the process). The whole plan takes seconds (SmolLM2: 17 entries, about 4 s compiled,
under 1 s read from a filled cache), and a first request needs three of its entries: the smallest decode run,
decode bucket and prefill bucket (a longer prompt needs the next prefill buckets, and a prompt-lookup match the
smallest verify bucket: the runner lists them next, runner/warm.py's `RunnerWarmup.entries`). So, staged (one agent,
the compile cache on), only the entries marked `first` run before the agent is ready, and the rest after it, still
in order and still through the cache:

- when the agent is idle (`warm_next`, one entry at a time, called between commands);
- on demand: a step about to call a graph that a pending entry compiles first runs the plan through that entry
  (`before_call`, by the name the runner gives each graph call: its kind and bucket shape).

The cache is on only while an entry runs, so a graph a step compiles in between (a top-k sampler, an embed
bucket) takes no compile index. Which names an entry calls is recorded in the cache directory (`plan.json`) by
the first process that ran the whole plan on it; without that record (a cold cache, which compiles every graph
anyway) only the `first` entries run before ready too, and a step about to call a graph that no entry run so far
called runs the whole rest of the plan first (one wait, on a model's first start). A graph a step needs is compiled
by its own entry or never through the cache, so every process compiles the cached graphs in the same order,
whichever requests came first.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

from .mindspore_env import close_compile_cache, quicken_compiles, set_compile_cache

logger = logging.getLogger(__name__)

RECORD = "plan.json"        # in the compile cache's directory: each entry's label and graph-call names


@dataclass(frozen=True)
class Entry:
    """One step of the plan: `run` compiles (or reads from the cache) its graphs and runs them on padding."""
    label: str                  # as the logs say it, e.g. "decode bucket (B=4, S=1, W=512)"
    run: Callable[[], None]
    first: bool = False         # a first request needs it: compiled before ready when staged


class WarmupPlan:
    """The entries in compile order (the `first` ones at the front) and how far they have run. The runner calls
    `before_call(name)` before every graph call, `run` once at start, then `warm_next` until `pending` is False."""

    def __init__(self, entries: list, cache_dir: Optional[str]):
        firsts = [e.first for e in entries]
        if firsts != sorted(firsts, reverse=True):
            raise ValueError("WarmupPlan: the entries a first request needs must come first")
        self.entries = entries
        self.done = 0                       # entries run so far (a prefix)
        self._cache_dir = cache_dir
        self._calls: Optional[set] = None   # the names the running entry calls
        self._seen: list = []               # per entry run in this process, the names it called
        self._bad_record = False            # a record of other entries, or unreadable: nothing staged
        self._index = self._read_record()   # name -> the first entry that calls it; None: no record

    @property
    def pending(self) -> bool:
        return self.done < len(self.entries)

    @property
    def can_stage(self) -> bool:
        """Whether the rest may wait until after ready: the cache is in use (knowing each entry's graphs from its
        record, or, on a cache without one, running the whole rest before a graph no entry run so far called)."""
        return self._cache_dir is not None and not self._bad_record

    def run(self, staged: bool, progress: Optional[Callable[[str], None]] = None) -> None:
        """The start's part: every entry, or, staged on a recorded cache, the `first` ones."""
        quicken_compiles(True)
        stop = sum(e.first for e in self.entries) if staged and self.can_stage else len(self.entries)
        self._run_through(stop - 1, progress)

    def warm_next(self, progress: Optional[Callable[[str], None]] = None) -> bool:
        """Run the next pending entry; whether any is left."""
        if self.pending:
            self._run_through(self.done, progress)
        return self.pending

    def before_call(self, name: tuple) -> None:
        """A graph call named `name` is about to run: inside an entry, noted; outside, when a pending entry calls
        it, the plan runs through that entry first (so its graph is compiled where the cache's order has it)."""
        if self._calls is not None:
            self._calls.add(name)
            return
        if self._index is None:
            # no record: which pending entry calls it is not known, so unless a finished entry called it, all of them
            # run first (a first start's first request of another shape waits for the rest of the plan once)
            if self.pending and not any(name in names for names in self._seen):
                logger.info("warmup on demand: %s %s needs the rest of the plan first (entries %d-%d)", name[0],
                            name[1], self.done + 1, len(self.entries))
                self._run_through(len(self.entries) - 1, None)
            return
        i = self._index.get(name)
        if i is not None and i >= self.done:
            logger.info("warmup on demand: %s %s needs entries %d-%d first", name[0], name[1], self.done + 1, i + 1)
            self._run_through(i, None)

    def abandon(self) -> None:
        """Stop here (an entry failed): the rest compile when a step needs them, outside the cache."""
        self.done = len(self.entries)
        self._finish()

    # ----------------------------------------------------------------------------------------------------------
    def _run_through(self, last: int, progress: Optional[Callable[[str], None]]) -> None:
        set_compile_cache(True)
        try:
            while self.done <= last:
                entry = self.entries[self.done]
                self._calls = set()
                t0 = time.perf_counter()
                entry.run()
                self._seen.append(sorted(self._calls))
                self._calls = None
                self.done += 1
                msg = f"warmup {self.done}/{len(self.entries)}: {entry.label} ready in {time.perf_counter() - t0:.1f}s"
                logger.info(msg)
                if progress is not None:
                    progress(msg)
        finally:
            self._calls = None
            if self.pending:
                set_compile_cache(False)
            else:
                self._finish()

    def _finish(self) -> None:
        if self._index is None and len(self._seen) == len(self.entries):
            self._write_record()
        close_compile_cache()
        quicken_compiles(False)

    def _labels(self) -> list:
        return [e.label for e in self.entries]

    def _read_record(self) -> Optional[dict]:
        if self._cache_dir is None:
            return None
        try:
            with open(os.path.join(self._cache_dir, RECORD)) as f:
                record = json.load(f)
            if record["labels"] != self._labels() or len(record["calls"]) != len(self.entries):
                logger.warning("warmup record %s names other entries: the whole plan runs before ready",
                               os.path.join(self._cache_dir, RECORD))
                self._bad_record = True
                return None
            index: dict = {}
            for i, names in enumerate(record["calls"]):
                for kind, shape in names:
                    index.setdefault((kind, tuple(shape)), i)
            return index
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("warmup record unreadable (%s): the whole plan runs before ready", e)
            self._bad_record = True
            return None

    def _write_record(self) -> None:
        if self._cache_dir is None:
            return
        path = os.path.join(self._cache_dir, RECORD)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump({"labels": self._labels(), "calls": [[[k, list(s)] for k, s in names]
                                                              for names in self._seen]}, f)
            os.replace(tmp, path)       # (a reader never sees half a record)
        except OSError as e:
            logger.warning("warmup record not written (%s): the next start warms up whole again", e)
