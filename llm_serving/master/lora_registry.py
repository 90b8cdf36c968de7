"""The master's registry of LoRA adapters: which are served (name -> PEFT directory), which sit in one of the
agents' `max_loras` slots (name -> slot), each load's prefix-cache root, when each was last named, how many
requests in flight use each, and which slots are being loaded. Pure Python: the engine carries out what it
decides (it sends the LoadLora control commands to the agents and places waiting requests through
`Scheduler.set_lora`), and the agent group starts agents from its `snapshot()`.

More adapters than slots: a request naming an adapter in no slot waits (`Request.lora_slot` -1) until
`plan()` has given it one: a free slot, else that of the adapter named longest ago that no running request
uses, whose waiting requests then wait for it in turn."""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from llm_serving.config import LORA_NAME


class LoraConflictError(RuntimeError):
    """A LoRA adapter cannot be loaded or unloaded now (its name is taken, every slot is used, requests in flight
    use it); answered with 409."""


class LoraRefusedError(ValueError):
    """A LoRA adapter that does not fit the served model (or LoRA serving is off); answered with 400."""


@dataclass
class LoraPlan:
    """What the engine does before the next schedule so that waiting requests' adapters are in slots. Its slots
    are reserved until the engine reports each load (`LoraRegistry.loaded` or `load_failed`)."""

    evicted: list = field(default_factory=list)   # [(name, slot)]: out of its slot now; its waiting requests wait
    loads: list = field(default_factory=list)     # [(name, slot, path)]: load these, in order
    placed: list = field(default_factory=list)    # names already in a slot: their waiting requests take it
    blocked: bool = False                         # some adapter got no slot (all serve running requests)


class LoraRegistry:
    """LoRA adapters served on the base model, and the agents' slots 1..max_loras (slot 0 is the base model)."""

    def __init__(self, adapters: dict, slots: dict, max_loras: int):
        """adapters: {name: directory} served; slots: {name: slot} of those the agents load at start."""
        self.max_loras = max_loras
        self.paths = dict(adapters)                # every adapter served: name -> directory
        self.slots = dict(slots)                   # those in a slot now: name -> slot
        # name -> prefix-cache root, unique per load: a slot loaded again holds other weights, so the KV its old
        # adapter cached must not be reused (roots 1..max_loras are the start-up loads')
        self.roots = dict(self.slots)
        self._next_root = itertools.count(max_loras + 1)
        self._clock = itertools.count(1)
        self._last_named: dict = {}                # name -> tick of the last request that named it
        self._in_flight: Counter = Counter()       # name -> requests in flight that use it
        self._loading: dict = {}                   # slot -> name being loaded into it
        self.wants_loads = False                   # some waiting request may name an adapter in no slot

    def __contains__(self, name) -> bool:
        return name in self.paths

    # --- requests ----------------------------------------------------------------------------------

    def place(self, name: str) -> tuple:
        """A new request names adapter `name`: (its slot, its prefix-cache root), slot -1 when it is in none
        (it is loaded before the request is admitted). KeyError when it is not served."""
        if name not in self.paths:
            raise KeyError(f"LoRA adapter {name!r} is not served here")
        self._last_named[name] = next(self._clock)
        if name not in self.slots:
            self.wants_loads = True
            return -1, 0
        return self.slots[name], self.roots[name]

    def hold(self, name: str) -> None:
        """A request using adapter `name` is in flight (queued)."""
        self._in_flight[name] += 1

    def release(self, name: str) -> None:
        """A request using adapter `name` ended."""
        self._in_flight[name] -= 1
        if self._in_flight[name] <= 0:
            del self._in_flight[name]

    def in_flight(self, name: str) -> int:
        return self._in_flight[name]

    # --- loading and unloading ---------------------------------------------------------------------

    def taken(self, name: str) -> bool:
        """Whether `name` is served, or being loaded under that name."""
        return name in self.paths or name in self._loading.values()

    def check_new(self, name, model_name: str) -> None:
        """`name` is free for a new adapter: LoraRefusedError when it is no adapter name, LoraConflictError when
        it is the served model's or taken."""
        if not isinstance(name, str) or LORA_NAME.fullmatch(name) is None:
            raise LoraRefusedError(f"lora_name {name!r}: an adapter name is 1-128 letters, digits, '.', '_' or "
                                   "'-' (it appears in URL paths)")
        if name == model_name or self.taken(name):
            raise LoraConflictError(f"the name {name!r} is already served; unload it first or pick another")

    def free_slot(self) -> Optional[int]:
        """The lowest slot that holds no adapter and is not being loaded; None when there is none."""
        used = set(self.slots.values()) | set(self._loading)
        return next((s for s in range(1, self.max_loras + 1) if s not in used), None)

    def begin_load(self, name: str, slot: int) -> None:
        """The agents are loading adapter `name` into `slot`: no one else gets the slot meanwhile."""
        self._loading[slot] = name

    def loaded(self, name: str, slot: int) -> Optional[int]:
        """The agents hold adapter `name` in `slot` now: its new prefix-cache root, or None when the adapter was
        unloaded meanwhile (the slot stays free)."""
        self._loading.pop(slot, None)
        if name not in self.paths:
            return None
        self.slots[name], self.roots[name] = slot, next(self._next_root)
        return self.roots[name]

    def load_failed(self, slot: int) -> None:
        """The load into `slot` failed: the slot is free again."""
        self._loading.pop(slot, None)

    def add(self, name: str, path: str) -> None:
        """Serve adapter `name` (loaded into a slot already, or on first use)."""
        self.paths[name] = path

    def remove(self, name: str) -> Optional[int]:
        """Stop serving adapter `name`: the slot it leaves (for the agents to empty), or None. KeyError when it
        is not served, LoraConflictError while requests in flight use it."""
        if name not in self.paths:
            raise KeyError(name)
        busy = self.in_flight(name)
        if busy:
            raise LoraConflictError(f"{busy} request(s) in flight use adapter {name!r}; unload it when they end")
        del self.paths[name]
        self.roots.pop(name, None)
        self._last_named.pop(name, None)
        return self.slots.pop(name, None)

    def plan(self, wanted: list, running: set) -> LoraPlan:
        """Slots for the adapters waiting requests name but no slot holds (`wanted`, in queue order) while slots
        can be had: a free one, else that of the adapter named longest ago among those no running request uses
        (`running`: the adapters of running requests) and no waiting request is about to take. The plan's slots
        are reserved at once; an adapter being loaded already is left to that load."""
        self.wants_loads = False
        plan = LoraPlan()
        loading = set(self._loading.values())
        todo = [n for n in dict.fromkeys(wanted) if n in self.paths and n not in loading]
        plan.placed = [n for n in todo if n in self.slots]
        keep = set(running) | set(plan.placed)
        for name in todo:
            if name in self.slots:
                continue
            slot = self.free_slot()
            if slot is None:
                victim = self._evict(keep)
                if victim is None:                 # every slot serves running requests: try after the next step
                    plan.blocked = self.wants_loads = True
                    break
                plan.evicted.append(victim)
                slot = victim[1]
            self.begin_load(name, slot)
            plan.loads.append((name, slot, self.paths[name]))
        if plan.evicted:
            self.wants_loads = True                # (an evicted adapter's waiting requests need it back)
        return plan

    def _evict(self, keep: set) -> Optional[tuple]:
        """(name, slot) of the adapter named longest ago outside `keep`, out of its slot now; None if none."""
        idle = [n for n in self.slots if n not in keep]
        if not idle:
            return None
        victim = min(idle, key=lambda n: self._last_named.get(n, 0))
        self.roots.pop(victim, None)
        return victim, self.slots.pop(victim)

    # --- for the agent group -----------------------------------------------------------------------

    def snapshot(self) -> dict:
        """{slot: (name, path)} of the adapters in slots: what agents (re)started now must load."""
        return {slot: (name, self.paths[name]) for name, slot in sorted(self.slots.items(), key=lambda x: x[1])}
