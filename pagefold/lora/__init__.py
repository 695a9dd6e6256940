"""Multi-LoRA serving: PEFT adapters over one base model, batched per row (see
``docs/ARCHITECTURE.md``, "LoRA adapters").

* :mod:`.request`: ``LoRARequest(name, id, path)`` (vLLM's names);
* :mod:`.layout`: the model's LoRA-able linears and their checkpoint parts;
* :mod:`.peft`: reading and checking a PEFT adapter directory against that layout;
* :mod:`.cache`: the host LRU of loaded adapters;
* :mod:`.manager`: the runner side: ``max_loras`` resident slots and each step's row index.
"""

from pagefold.lora.request import LoRARequest

__all__ = ["LoRARequest"]
