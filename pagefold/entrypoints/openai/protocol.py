"""Wire formats of the OpenAI-compatible server: request models, error bodies, SSE framing.

Requests are parsed with ``Model.model_validate_json(body, strict=True)`` (see
:func:`parse_request`): wrong JSON types are errors (``"5"`` is not an int, ``true`` not a
float), unknown fields are ignored as OpenAI ignores them. Every error the server returns has
OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` (``errors.error_body``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import StreamingResponse

from pagefold.entrypoints.openai.errors import bad_request, validation_error
from pagefold.entrypoints.openai.validation import check_numbers


def parse_request(model: type[BaseModel], body: bytes) -> Any:
    """Parse a JSON body into ``model`` (strict types), raising :class:`APIError` 400."""
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object", code="invalid_json")
    try:
        req = model.model_validate_json(body, strict=True)
    except ValidationError as e:
        if any(err.get("type") == "json_invalid" for err in e.errors()):
            msg = e.errors()[0].get("msg", "invalid JSON")
            raise bad_request(f"the request body is not valid JSON: {msg}",
                              code="invalid_json") from None
        if any(err.get("type") == "model_type" and not err.get("loc") for err in e.errors()):
            raise bad_request("the request body must be a JSON object",
                              code="invalid_json") from None
        raise validation_error(e) from None
    check_numbers(req)  # NaN / Infinity / integers past 64 bits: 400 naming the field
    return req


# --------------------------------------------------------------------------- requests
class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(_Lenient):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``; vLLM's
    ``structural_tag`` too."""

    type: str
    json_schema: JsonSchemaFormat | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None
    format: dict[str, Any] | None = None


class StructuredOutputsBody(_Lenient):
    """vLLM's ``structured_outputs`` body field (exactly one constraint)."""

    json_: dict[str, Any] | str | bool | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    backend: str | None = None


class SamplingRequest(_Lenient):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extras).

    Every field of vLLM's request models is declared here or in a subclass, so none is
    silently dropped: each is honoured, or refused with a 400 naming it when set to a value
    pagefold cannot honour (see ``fields.py``)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = 1
    best_of: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = None
    priority: int = 0
    # vLLM extras, honoured
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: str | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_temperature: float | None = None
    # Logprobs of these ids (and the sampled one) instead of the top-k; needs logprobs.
    logprob_token_ids: list[int] | None = None
    add_special_tokens: bool | None = None
    request_id: str | None = None
    session_id: str | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    spaces_between_special_tokens: bool = True
    length_penalty: float = 1.0
    use_beam_search: bool = False
    # Tenants that must not share prefix-cache entries send different salts (vLLM's field).
    cache_salt: str | None = None
    # vLLM extras refused unless neutral (fields.py says why)
    watermarking: Any = None
    routed_experts_prompt_start: Any = None
    return_token_offsets: Any = None
    return_prompt_text: Any = None
    mm_payload: Any = None
    return_mm_kwargs: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    vllm_xargs: Any = None
    repetition_detection: Any = None
    stream_interval: Any = None
    thinking_token_budget: Any = None
    logits_processors: Any = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    prompt_embeds: Any = None


class ContentPart(_Lenient):
    type: str
    text: str | None = None
    image_url: Any = None  # {"url": "data:image/...;base64,..."} (or the URL string)


class ChatMessage(BaseModel):
    """One message; fields beyond role/content (tool_calls, name, ...) go to the template."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True
    reasoning_effort: str | None = None
    echo: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    # vLLM's token-in chat: these ids are the prompt (messages must then be empty).
    prompt_token_ids: list[int] | None = None
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None


class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # None: True for a prompt, False for messages (the chat template writes the special
    # tokens; vLLM's defaults, so /tokenize of messages gives the ids chat completion uses).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def special_tokens(self) -> bool:
        """Whether the tokenizer adds its special tokens: as asked, else for a prompt only."""
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.messages is None


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------------------------- responses
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def sse(data: dict) -> str:
    """One server-sent event carrying ``data`` as compact JSON."""
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
FinishReason = Literal["stop", "length", "abort"] | None


def held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` that could still grow into a stop string.

    A stream must not send them yet: if the stop string completes, they are cut from the
    output (the same rule as the detokenizer's, applied to the cumulative text we receive).
    """
    held = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return held


class AbortingStreamingResponse(StreamingResponse):
    """A streaming response that notices a client disconnect at once and closes its body.

    Starlette may only notice a gone client at the next write, and may leave the body
    generator suspended; here a listener waits for ``http.disconnect`` alongside the stream
    and the body generator is always ``aclose()``-d, so its ``finally`` (which aborts the
    engine request) runs right away.
    """

    async def __call__(self, scope, receive, send) -> None:
        async def stream() -> None:
            try:
                await self.stream_response(send)
            except OSError:
                pass  # the client went away while we wrote

        streaming = asyncio.ensure_future(stream())
        listening = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({streaming, listening}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (streaming, listening):
                t.cancel()
            await asyncio.gather(streaming, listening, return_exceptions=True)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
        if not streaming.cancelled() and streaming.exception() is not None:
            raise streaming.exception()
        if self.background is not None:
            await self.background()
