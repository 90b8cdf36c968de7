"""Carrying out the LoRA registry's decisions on the agents: an adapter registered at run time (checked against
the served model, then loaded into a free slot), unloaded, or loaded into a slot when a waiting request needs it.

The registry (master/lora_registry.py, pure Python) decides which adapter takes which slot; the loader sends
the LoadLora control commands through the agent group and tells the registry and the scheduler what came of
them. The engine calls it: `load` and `unload` from the HTTP routes, `make_resident` before it schedules a step
while some waiting request's adapter is in no slot.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Callable

from llm_serving.agents import protocol as proto
from llm_serving.master.agent_group import AgentError, AgentGroup
from llm_serving.master.lora_registry import LoraRefusedError, LoraRegistry
from llm_serving.master.scheduler import Scheduler

logger = logging.getLogger(__name__)


class LoraLoader:
    """Loads and unloads the adapters of one model's agent group. `fail(request, error)` ends a request whose
    adapter could not be loaded."""

    def __init__(self, lora_config, model_path: str, model_name: str, registry: LoraRegistry, agents: AgentGroup,
                 scheduler: Scheduler, fail: Callable[[object, str], None]):
        self.config = lora_config
        self.model_path = model_path
        self.model_name = model_name
        self.registry = registry
        self.agents = agents
        self.scheduler = scheduler
        self.fail = fail
        self._base_config = None            # the served model's LlamaConfig, read at the first load

    async def load(self, name: str, path: str) -> dict:
        """Serve the PEFT adapter at `path` as model `name` from now on: checked against the served model here,
        then loaded by the agents into a free slot (or, with none free, when a request first names it).
        LoraRefusedError if it does not fit (nothing changes), LoraConflictError if the name is taken."""
        from llm_serving.models.lora import LoraError, load_lora_adapter
        from llm_serving.models.weights import checkpoint_config

        lc = self.config
        if not lc.enabled:
            raise LoraRefusedError("LoRA serving is off: start the server with lora_config.enable_lora (or "
                                   "lora_config.adapters)")
        registry = self.registry
        registry.check_new(name, self.model_name)
        path = str(Path(path).expanduser().resolve())
        loop = asyncio.get_running_loop()
        try:
            if self._base_config is None:
                self._base_config = await loop.run_in_executor(None, checkpoint_config, self.model_path)
            adapter = await loop.run_in_executor(None, load_lora_adapter, name, path, self._base_config,
                                                 lc.max_lora_rank)
        except LoraError as e:
            raise LoraRefusedError(str(e)) from None
        registry.check_new(name, self.model_name)        # (named meanwhile by a concurrent load)
        slot, slot_mb = registry.free_slot(), None
        if slot is not None:                      # else it is loaded when a request needs it (make_resident)
            registry.begin_load(name, slot)
            try:
                slot_mb = await self._load_into(slot, name, path)
            except AgentError as e:
                raise LoraRefusedError(f"the agent could not load adapter {name!r}: {e}") from None
        registry.add(name, path)
        if slot is not None:
            registry.loaded(name, slot)
        logger.info("LoRA adapter %r registered (rank %d)%s", name, adapter.rank,
                    f", in slot {slot}" if slot is not None else ", loaded on first use")
        return {"lora_name": name, "slot": slot, "rank": adapter.rank, "slot_mb": slot_mb}

    async def unload(self, name: str) -> None:
        """Stop serving adapter `name`: KeyError if it is not served, LoraConflictError while requests use it."""
        slot = self.registry.remove(name)
        if slot is not None:                      # (new requests cannot name it any more: the slot is free)
            try:
                await self.agents.control(proto.LoadLora(slot=slot, name=name, path=None))
            except AgentError as e:
                logger.warning("LoRA slot %d (%s) was not emptied on every agent: %s", slot, name, e)
        logger.info("LoRA adapter %r unloaded%s", name, f" from slot {slot}" if slot is not None else "")

    async def make_resident(self) -> None:
        """Load the adapters that waiting requests name but no slot holds, in queue order, while slots can be
        had (the registry's plan); a load that fails ends the requests that wait for it."""
        registry, sched = self.registry, self.scheduler
        wanted = [r.lora_adapter for r in sched.waiting if r.lora_slot < 0]
        plan = registry.plan(wanted, {r.lora_adapter for r in sched.running})
        for name, slot in plan.evicted:
            sched.set_lora(name, -1, 0)
            logger.info("LoRA adapter %r leaves slot %d (used longest ago)", name, slot)
        for name in plan.placed:                  # (loaded meanwhile)
            sched.set_lora(name, registry.slots[name], registry.roots[name])
        for i, (name, slot, path) in enumerate(plan.loads):
            try:
                await self._load_into(slot, name, path)
            except AgentError as e:
                for req in [r for r in sched.waiting if r.lora_adapter == name]:
                    self.fail(req, f"LoRA adapter {name!r} could not be loaded: {e}")
                continue
            except BaseException:                 # (cancelled: the engine stops) the plan's other slots are free
                for _, left, _ in plan.loads[i + 1:]:
                    registry.load_failed(left)
                raise
            root = registry.loaded(name, slot)
            if root is not None:
                sched.set_lora(name, slot, root)

    async def _load_into(self, slot: int, name: str, path: str) -> float:
        """The agents load adapter `name` into `slot`, which the registry holds for it (AgentError if one cannot:
        the slot is free again); the MB a slot takes on the agents. The caller then says it is loaded."""
        try:
            replies = await self.agents.control(proto.LoadLora(slot=slot, name=name, path=path))
        except BaseException:
            self.registry.load_failed(slot)
            raise
        return replies[0].slot_mb
