"""A runner's LoRA adapter slots (`LoraSlots`): which adapter each slot holds is written into the model's stacks in
place (no graph is compiled again); a step's rows name their slot (`lora`, 0: none)."""
from __future__ import annotations

import numpy as np

__all__ = ["LoraSlots"]


class LoraSlots:
    """`slots` adapter slots (0: none) of ranks up to `rank`, in the layers of the model they are attached to
    (`attach`; layer_weights.py's LoraStack)."""

    model = None                        # the LlamaForCausalLM whose stacks hold them
    num_layers = 0

    def __init__(self, slots: int, rank: int):
        self.slots, self.rank = int(slots), int(rank)

    def attach(self, model, num_layers: int) -> None:
        """The slots are `model`'s (its stacks made for `slots` and `rank`), of `num_layers` layers."""
        self.model, self.num_layers = model, num_layers

    @property
    def slot_bytes(self) -> int:
        """Memory one slot takes on this agent (the layer kernel's and MindSpore's forms, every layer, at `rank`);
        0 without slots."""
        return sum(st.slot_nbytes for layer in self.model.layers for st in layer.lora_stacks.values())

    def set(self, slot: int, adapter) -> None:
        """Slot `slot` (1..slots) now holds `adapter` (lora.load_lora_adapter's, checked against this model), or
        nothing (None): rows of later steps whose `lora` is `slot` run with it. The caller makes sure no step in
        flight uses the slot. ValueError for a slot out of range or an adapter of a rank above `rank`."""
        if not isinstance(slot, (int, np.integer)) or not 1 <= slot <= self.slots:
            raise ValueError(f"ModelRunner.set_lora: slot must be in 1..{self.slots}, got {slot!r}")
        if adapter is not None:
            if adapter.rank > self.rank:
                raise ValueError(f"ModelRunner.set_lora: adapter {adapter.name!r} has rank {adapter.rank}, above "
                                 f"this runner's lora_rank {self.rank}")
            unknown = [n for n in adapter.deltas if int(n.split(".")[2]) >= self.num_layers]
            if unknown:
                raise ValueError(f"ModelRunner.set_lora: adapter {adapter.name!r} adapts {unknown[0]}, a layer this "
                                 f"model does not have")
        self.model.write_lora(int(slot), adapter)
