"""Which request fields pagefold honours, which it refuses, and the constraint they ask for.

Every field of vLLM's ``ChatCompletionRequest`` / ``CompletionRequest`` is declared on the
request models (``protocol.py``), so none is dropped silently. A field pagefold cannot honour
is listed in :data:`REFUSED` with the values that mean "off"; any other value sent is a 400
naming the field (:func:`refuse_unsupported`). Everything else is honoured.

:func:`structured_outputs` turns ``response_format``, vLLM's ``structured_outputs`` and the
older ``guided_*`` fields into one :class:`StructuredOutputsParams` (two at once is a 400).
"""

from __future__ import annotations

import json
from typing import Any

from pagefold.entrypoints.openai.errors import bad_request
from pagefold.entrypoints.openai.protocol import SamplingRequest
from pagefold.structured_output import StructuredOutputsParams

# field -> (values that mean "off", why a different value is refused)
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "length_penalty": ((1.0, 1, None), "it only applies to beam search (use_beam_search)"),
    "spaces_between_special_tokens": (
        (True, None), "special tokens are always joined as the tokenizer decodes them"),
    "watermarking": ((False, None), "no watermarking"),
    "routed_experts_prompt_start": ((0, None), "no expert routing export"),
    "return_token_offsets": ((False, None), "not implemented"),
    "return_prompt_text": ((False, None), "not implemented"),
    "mm_payload": (("tensors", None), "no multimodal input"),
    "return_mm_kwargs": ((False, None), "no multimodal input"),
    "kv_transfer_params": ((None, {}), "this server was started without "
                           "--kv-transfer-config (prefill/decode disaggregation)"),
    "ec_transfer_params": ((None, {}), "no encoder cache transfer"),
    "vllm_xargs": ((None, {}), "no custom logits processors take extra arguments"),
    "repetition_detection": ((None,), "not implemented"),
    "stream_interval": ((None, 1), "every engine step is streamed"),
    "thinking_token_budget": ((None,), "not implemented"),
    "logits_processors": ((None, []), "custom logits processors are not supported"),
    "media_io_kwargs": ((None, {}), "no multimodal input"),
    "mm_processor_kwargs": ((None, {}), "no multimodal input"),
    "prompt_embeds": ((None, [], b""), "prompt embeddings are not supported"),
    "suffix": ((None, ""), "fill-in-the-middle is not supported"),
    "guided_whitespace_pattern": ((None,), "the xgrammar backend takes no whitespace pattern"),
}

BACKENDS = (None, "auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")


def refuse_unsupported(req: SamplingRequest, allow: tuple[str, ...] = ()) -> None:
    """400 naming the first field sent with a value pagefold cannot honour; ``allow``: fields
    this server honours after all (``kv_transfer_params`` with a kv_transfer_config)."""
    for name in sorted(req.model_fields_set):
        rule = REFUSED.get(name)
        if name in allow:
            if name == "kv_transfer_params" and not isinstance(req.kv_transfer_params,
                                                               dict | None):
                raise bad_request("kv_transfer_params must be an object", name)
            continue
        if rule is None or (name == "length_penalty" and req.use_beam_search):
            continue
        value = getattr(req, name)
        if any(value == v and type(value) is type(v) for v in rule[0] if v is not None) or (
                value is None and None in rule[0]):
            continue
        raise bad_request(f"{name}={json.dumps(value, default=str)[:60]} is not supported by "
                          f"pagefold: {rule[1]}", name, code="unsupported_field")
    backend = req.guided_decoding_backend
    if req.structured_outputs is not None and req.structured_outputs.backend is not None:
        backend = req.structured_outputs.backend
    if backend not in BACKENDS:
        raise bad_request(f"structured output backend {backend!r} is unknown; pagefold uses "
                          "xgrammar", "guided_decoding_backend")
    if req.truncation_side not in (None, "left", "right"):
        raise bad_request("truncation_side must be 'left' or 'right'", "truncation_side")


def structured_outputs(req: SamplingRequest) -> StructuredOutputsParams | None:
    """The one output constraint a request asks for, or None (400 when it asks for two)."""
    found: list[tuple[str, dict]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf.type == "json_schema":
            js = rf.json_schema
            if js is None or js.schema_ is None:
                raise bad_request("response_format json_schema needs json_schema.schema",
                                  "response_format")
            schema = js.schema_
            if schema is True:
                schema = {}
            elif schema is False:
                raise bad_request("response_format json_schema.schema false admits nothing",
                                  "response_format")
            found.append(("response_format", {"json": schema}))
        elif rf.type == "structural_tag":
            raise bad_request("response_format structural_tag is not supported; use "
                              "json_schema or tools", "response_format")
        else:
            raise bad_request(f"response_format type must be text, json_object or "
                              f"json_schema, got {rf.type!r}", "response_format")
    so = req.structured_outputs
    if so is not None:
        kw = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
              "json_object": so.json_object, "structural_tag": so.structural_tag,
              "disable_any_whitespace": so.disable_any_whitespace,
              "whitespace_pattern": so.whitespace_pattern}
        found.append(("structured_outputs", {k: v for k, v in kw.items() if v is not None}))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar"),
                      ("structural_tag", "structural_tag")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, {key: value}))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise bad_request(f"give one output constraint, got several: {names}", found[1][0])
    name, kw = found[0]
    if name == "structured_outputs" and isinstance(kw.get("json"), bool):
        kw["json"] = {} if kw["json"] else None
    try:
        return StructuredOutputsParams(**kw)
    except ValueError as e:
        raise bad_request(str(e), name) from None
