"""The server's LoRA adapters (``--enable-lora --lora-modules NAME=PATH ...``): a request's
``model`` names the base model or an adapter, ``/v1/models`` lists both, and vLLM's runtime
endpoints ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (JSON ``{lora_name,
lora_path}``) add and remove adapters while serving (registered only with ``--enable-lora``).

Adapters are read and checked here, against a meta-device build of the model (shapes only),
when they are added: a rank above ``--max-lora-rank``, unknown target modules or another base
model's shapes are a 400 naming them. Each name gets a fresh ``lora_int_id``: an unloaded
name loaded again (maybe from another path) is a new adapter to the engine's caches.
"""

from __future__ import annotations

import itertools
import json

from starlette.requests import Request
from starlette.responses import PlainTextResponse

from pagefold.checkpoint import load_hf_config
from pagefold.config import EngineConfig
from pagefold.entrypoints.openai.errors import APIError, bad_request
from pagefold.lora.manager import adapter_checker
from pagefold.lora.request import LoRARequest


def parse_lora_modules(specs: list[str] | None) -> list[tuple[str, str]]:
    """``NAME=PATH`` or vLLM's JSON ``{"name": ..., "path": ...}`` -> (name, path)."""
    out = []
    for spec in specs or []:
        if spec.lstrip().startswith("{"):
            d = json.loads(spec)
            if "name" not in d or "path" not in d:
                raise ValueError(f"--lora-modules {spec!r}: JSON needs 'name' and 'path'")
            out.append((d["name"], d["path"]))
            continue
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {spec!r}: expected NAME=PATH")
        out.append((name, path))
    return out


class LoRAModules:
    """Adapter name -> LoRARequest, checked when added."""

    def __init__(self, config: EngineConfig, base_names: list[str]) -> None:
        arch, hf_config = load_hf_config(config.model)
        self.checker = adapter_checker(arch, hf_config, None, config.max_lora_rank, 1)
        self.base_names = set(base_names)
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, path: str) -> LoRARequest:
        if not name or not path:
            raise bad_request("lora_name and lora_path are required", "lora_name")
        if name in self.adapters or name in self.base_names:
            raise bad_request(f"The model `{name}` is already loaded", "lora_name")
        req = LoRARequest(name, next(self._ids), str(path))
        try:
            self.checker.get(req)
        except ValueError as e:
            raise bad_request(str(e), "lora_path") from None
        finally:
            self.checker.drop(req.lora_int_id)  # the engine keeps its own copy
        self.adapters[name] = req
        return req

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise APIError(404, f"The LoRA adapter `{name}` is not loaded", param="lora_name",
                           code="model_not_found")

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    def cards(self, parent: str, created: int) -> list[dict]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "pagefold",
                 "root": req.lora_path, "parent": parent}
                for name, req in self.adapters.items()]


def add_lora_routes(app, lora: LoRAModules, parse_body) -> None:
    """vLLM's runtime adapter endpoints (``parse_body(request) -> dict``)."""
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await parse_body(request)
        name = str(body.get("lora_name") or "")
        lora.add(name, str(body.get("lora_path") or ""))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await parse_body(request)
        name = str(body.get("lora_name") or "")
        lora.remove(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
