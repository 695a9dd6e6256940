"""The runner side of multi-LoRA: ``max_loras`` resident slots on every LoRA-able linear and
the per-row slot index of each step.

``LoRAModelManager(model, ...)`` attaches a :class:`~pagefold.layers.lora_linear.LoRALinear`
to every linear of :func:`~pagefold.lora.layout.lora_layout` and a
:class:`~pagefold.layers.lora_experts.LoRAExperts` to every routed expert stack (nothing is
attached when LoRA is off: the model runs as before). Before each forward the runner calls
:meth:`set_step` with each request's adapter (or None) and token count: the step's adapters
are made resident (a free slot, else the least recently used slot no row of this step needs;
its matrices are rewritten from the host cache), and the row index is set. The scheduler
admits no more distinct adapters than slots among the running requests, so a step always fits.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from pagefold.checkpoint import text_config
from pagefold.layers.lora_experts import LoRAExperts
from pagefold.layers.lora_linear import LoRALinear, LoRAStep
from pagefold.lora.cache import AdapterCache
from pagefold.lora.layout import experts_layouts, lora_layout
from pagefold.lora.peft import LoRAAdapter, load_adapter
from pagefold.lora.request import LoRARequest
from pagefold.models.registry import model_class


def adapter_loader(model: nn.Module, max_rank: int):
    """A loader for :class:`AdapterCache`: reads and checks adapters against ``model``'s
    layout (a meta-device model does: only shapes are read)."""
    layout = {p: lay for p, (_, lay) in lora_layout(model).items()}
    experts = {p: lay for p, (_, lay, _) in experts_layouts(model).items()}
    fused = dict(getattr(model, "fused_names", {}))
    convert = getattr(model, "convert_weight", None)

    def load(req: LoRARequest) -> LoRAAdapter:
        return load_adapter(req.lora_int_id, req.lora_name, req.lora_path, layout, fused,
                            max_rank, convert, experts)

    return load


def adapter_checker(arch: str, hf_config, model: nn.Module | None, max_rank: int,
                    capacity: int) -> AdapterCache:
    """A host cache of adapters read and checked against ``model``'s layout; with no model
    (tensor-parallel engine, API process) a whole one of ``arch`` is built on the meta device
    (shapes only, no memory)."""
    if model is None:
        with torch.device("meta"):
            model = model_class(arch)(text_config(hf_config), max_positions=2)
    return AdapterCache(capacity, adapter_loader(model, max_rank))


class LoRAModelManager:
    def __init__(self, model: nn.Module, *, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int | None = None, cache: AdapterCache | None = None) -> None:
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras ({max_loras}) and max_lora_rank ({max_lora_rank}) "
                             f"must be >= 1")
        self.max_loras = max_loras
        self.step = LoRAStep()
        self.layers: dict[str, LoRALinear | LoRAExperts] = {
            path: LoRALinear(mod, lay, self.step, num_slots=max_loras, max_rank=max_lora_rank)
            for path, (mod, lay) in lora_layout(model).items()}
        for path, (mod, lay, like) in experts_layouts(model).items():  # routed experts
            self.layers[path] = LoRAExperts(mod, lay, like, self.step, num_slots=max_loras,
                                            max_rank=max_lora_rank)
        self.cache = cache or AdapterCache(max(max_cpu_loras or 0, max_loras),
                                           adapter_loader(model, max_lora_rank))
        self.resident: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, LRU first
        self.device = next(model.parameters()).device
        self.loads = 0  # slot writes so far (tests and logs)

    def _place(self, adapter: LoRAAdapter, slot: int) -> None:
        for layer in self.layers.values():
            layer.clear_slot(slot)
        for (path, part), (a, b) in adapter.parts.items():
            self.layers[path].set_part(slot, part, a, b)
        self.loads += 1

    def _slot_for(self, req: LoRARequest, needed: set[int]) -> int:
        slot = self.resident.get(req.lora_int_id)
        if slot is not None:
            self.resident.move_to_end(req.lora_int_id)
            return slot
        used = set(self.resident.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next((i for i in self.resident if i not in needed), None)
            if victim is None:
                raise RuntimeError(f"a step needs more than max_loras ({self.max_loras}) "
                                   f"adapters")
            slot = self.resident.pop(victim)
        self._place(self.cache.get(req), slot)
        self.resident[req.lora_int_id] = slot
        return slot

    def set_step(self, loras: list[LoRARequest | None], counts: list[int]) -> bool:
        """Make this step's adapters resident and set the row index (request ``i`` has
        ``counts[i]`` rows, in order). Returns whether any row uses an adapter."""
        if all(r is None for r in loras):
            self.step.idx = None
            return False
        needed = {r.lora_int_id for r in loras if r is not None}
        slots = [-1 if r is None else self._slot_for(r, needed) for r in loras]
        idx = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int64),
                                      torch.tensor(counts, dtype=torch.int64))
        self.step.idx = idx.to(self.device)
        return True

    def evict(self, lora_id: int) -> None:
        """Forget adapter ``lora_id`` (unloaded): its slot frees, the host copy goes."""
        slot = self.resident.pop(lora_id, None)
        if slot is not None:
            for layer in self.layers.values():
                layer.clear_slot(slot)
        self.cache.drop(lora_id)
