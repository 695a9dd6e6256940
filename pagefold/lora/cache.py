"""The host LRU of checked adapters (:class:`~pagefold.lora.peft.LoRAAdapter`), keyed by
``lora_int_id``. Holding ``capacity`` adapters at most; the least recently used goes first.
One id names one adapter: asking for a known id with another name or path is refused."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from pagefold.lora.peft import LoRAAdapter, LoRAError
from pagefold.lora.request import LoRARequest


class AdapterCache:
    def __init__(self, capacity: int, loader: Callable[[LoRARequest], LoRAAdapter]) -> None:
        if capacity < 1:
            raise ValueError(f"max_cpu_loras must be >= 1, got {capacity}")
        self.capacity = capacity
        self.loader = loader
        self.entries: OrderedDict[int, LoRAAdapter] = OrderedDict()

    def get(self, req: LoRARequest) -> LoRAAdapter:
        """The adapter of ``req``, read and checked on first use (raises ``LoRAError``)."""
        hit = self.entries.get(req.lora_int_id)
        if hit is not None:
            if (hit.name, hit.path) != (req.lora_name, str(req.lora_path)):
                raise LoRAError(f"lora_int_id {req.lora_int_id} already names adapter "
                                f"{hit.name!r} ({hit.path}), not {req.lora_name!r} "
                                f"({req.lora_path})")
            self.entries.move_to_end(req.lora_int_id)
            return hit
        adapter = self.loader(req)
        self.entries[req.lora_int_id] = adapter
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
        return adapter

    def drop(self, lora_id: int) -> None:
        self.entries.pop(lora_id, None)
