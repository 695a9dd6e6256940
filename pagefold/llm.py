"""Offline API with vLLM's names: ``LLM(model=...)``, ``generate``, ``chat``."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from pagefold.architectures import resolve_architecture
from pagefold.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from pagefold.checkpoint import generation_eos_ids, load_tokenizer, read_config_dict
from pagefold.config import EngineConfig
from pagefold.engine.core import EngineCore
from pagefold.engine.output_processor import OutputProcessor
from pagefold.generation_defaults import (
    generation_defaults,
    log_generation_defaults,
    truncate_prompt,
)
from pagefold.lora.request import LoRARequest
from pagefold.models.gguf_checkpoint import GGUFConversionError, resolve_model
from pagefold.multimodal.inputs import MultiModalInputs
from pagefold.multimodal.processor import image_processor_for
from pagefold.outputs import RequestOutput
from pagefold.sampling_params import SamplingParams

logger = logging.getLogger("pagefold")

PromptType = str | dict[str, Any]


class LLM:
    """An engine in this process. Keyword arguments are :class:`EngineConfig` fields.

    ``model`` is a Hugging Face checkpoint directory or a ``.gguf`` file (converted once into
    the pagefold cache, its quantized tensors kept quantized; ``quantization="none"``: the
    dequantized bf16 conversion; see ``pagefold.models.gguf_checkpoint``).
    """

    def __init__(self, model: str, *, tokenizer: str | None = None, **engine_kwargs: Any) -> None:
        try:
            model = resolve_model(str(model),
                                  quantization=engine_kwargs.get("quantization"))
        except GGUFConversionError as e:
            raise ValueError(str(e)) from e
        self.config = EngineConfig(model=model, tokenizer=tokenizer, **engine_kwargs)
        # Path and architecture first: a tokenizer failure on a bad path reads as a hub error.
        resolve_architecture(read_config_dict(Path(model)))
        self.tokenizer = load_tokenizer(tokenizer or model)
        self.engine = EngineCore(self.config)
        limits = self.config.limit_mm_per_prompt or {}
        self.mm_processor = image_processor_for(model, self.engine.hf_config, self.engine.arch,
                                                limits.get("image"),
                                                self.config.allowed_local_media_path)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._extra_eos = [t for t in generation_eos_ids(model)
                           if t != self.engine.eos_token_id]
        self._counter = itertools.count()
        self.default_sampling = generation_defaults(model, self.config.generation_config)
        log_generation_defaults(self.default_sampling, self.config.generation_config)

    def get_tokenizer(self):
        return self.tokenizer

    # ------------------------------------------------------------------ requests
    @staticmethod
    def _salt(prompt: PromptType, cache_salt: str | None) -> str | None:
        """A prompt dict's own ``cache_salt`` wins over the call's."""
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            return prompt["cache_salt"]
        return cache_salt

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._prompt_ids(prompt["prompt"])
        raise ValueError("a prompt is a string or a dict with 'prompt' or 'prompt_token_ids'")

    def _with_images(self, prompt: PromptType, ids: list[int]
                     ) -> tuple[list[int], MultiModalInputs | None]:
        """A prompt dict's ``multi_modal_data`` (vLLM's: ``{"image": PIL.Image or a list}``)
        processed: placeholders expanded, images checked and described for the engine."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not data:
            return ids, None
        if not isinstance(data, dict) or set(data) - {"image"}:
            got = sorted(data) if isinstance(data, dict) else data
            raise ValueError("multi_modal_data takes only an 'image' entry (a PIL.Image or a "
                             f"list of them); got {got!r}")
        if self.mm_processor is None:
            raise ValueError(f"{self.engine.arch} as loaded takes no image inputs")
        return self.mm_processor.process(ids, data["image"])

    def _with_image_parts(self, message: dict, images: list) -> dict:
        """A chat message whose content list has ``image_url`` parts (data URLs) as the server
        renders it: text parts joined by newlines, each image written as its placeholder and
        decoded into ``images``. Other messages are returned as they are."""
        content = message.get("content")
        if not isinstance(content, list) or not any(
                isinstance(p, dict) and p.get("type") == "image_url" for p in content):
            return message
        if self.mm_processor is None:
            raise ValueError(f"{self.engine.arch} as loaded takes no image inputs")
        texts = []
        for p in content:
            if p.get("type") == "image_url":
                url = p.get("image_url")
                images.append(self.mm_processor.decode_url(
                    url.get("url") if isinstance(url, dict) else url))
                texts.append(self.mm_processor.placeholder(self.tokenizer))
            elif p.get("type") == "text":
                texts.append(p.get("text", ""))
            else:
                raise ValueError(f"unsupported content part type {p.get('type')!r}")
        return {**message, "content": "\n".join(texts)}

    def _params_for(self, params: SamplingParams) -> SamplingParams:
        if self._extra_eos and not params.ignore_eos:
            params = params.clone()
            params.stop_token_ids = sorted(set(params.stop_token_ids or []) | set(self._extra_eos))
        if params.bad_words and params.bad_words_token_ids is None:
            params = params.clone()
            params.update_from_tokenizer(self.tokenizer)
        return params

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults (unless
        ``generation_config="vllm"``), as vLLM's ``LLM`` uses when none are given."""
        return SamplingParams(**self.default_sampling)

    def add_request(self, prompt: PromptType, params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> str:
        """Queue one prompt. ``cache_salt`` (or the prompt dict's ``"cache_salt"``) keeps it
        from sharing prefix-cache entries with requests salted otherwise (or not at all).
        ``lora_request``: the PEFT adapter it runs with (needs ``enable_lora=True``)."""
        text, ids = self._prompt_ids(prompt)
        ids, mm = self._with_images(prompt, ids)
        params = self._params_for(params)
        if params.truncate_prompt_tokens is not None and mm is not None:
            raise ValueError("truncate_prompt_tokens cannot cut a prompt with images")
        if params.truncate_prompt_tokens is not None:
            text, ids = None, truncate_prompt(ids, params.truncate_prompt_tokens,
                                              self.engine.max_model_len)
        rid = str(next(self._counter))
        self.engine.add_request(rid, ids, params, priority=priority,
                                cache_salt=self._salt(prompt, cache_salt), mm_inputs=mm,
                                lora_request=lora_request)
        self.output_processor.add_request(rid, text, ids, params)
        return rid

    def abort(self, request_ids: list[str]) -> None:
        self.engine.abort(request_ids)
        for rid in request_ids:
            self.output_processor.abort(rid)
        self.engine.flush()

    def step(self) -> list[RequestOutput]:
        outs, to_abort = self.output_processor.process(self.engine.step())
        if to_abort:
            self.engine.abort(to_abort)
        return outs

    # ------------------------------------------------------------------ batch API
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """``lora_request``: one adapter for every prompt, or one (or None: the base model)
        per prompt; adapters and the base model share the step's batch."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (list(sampling_params) if isinstance(sampling_params, Sequence)
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        loras = (list(lora_request) if isinstance(lora_request, Sequence)
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} lora requests")
        ids: list[str] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                ids.append(self.add_request(p, sp, priority[i] if priority else 0,
                                            cache_salt, lora_request=loras[i]))
        except Exception:
            self.abort(ids)  # nothing of a rejected batch stays queued
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while pending:
                for out in self.step():
                    if out.finished and out.request_id in pending:
                        final[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:
            self.abort(list(pending))
            raise
        finally:
            bar.close()
        self.engine.flush()
        return [final[i] for i in ids]

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM-style beam search; beams fork (shared attention blocks, copied states)."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        if any(isinstance(p, dict) and p.get("multi_modal_data") for p in prompts):
            raise ValueError("beam search takes no image inputs")
        ids = [self._prompt_ids(p)[1] for p in prompts]
        return beam_search(self.engine, self.get_tokenizer(), ids, params)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        use_tqdm: bool = True,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: ``tools`` and ``chat_template_kwargs`` go to the template."""
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        extra = dict(chat_template_kwargs or {})
        if tools:
            extra["tools"] = tools
        for conv in convs:
            images: list = []
            conv = [self._with_image_parts(m, images) for m in conv]
            ids = self.tokenizer.apply_chat_template(
                conv, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                tokenize=True, **extra)
            if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
                ids = ids["input_ids"]
            prompt: dict[str, Any] = {"prompt_token_ids": list(ids)}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
