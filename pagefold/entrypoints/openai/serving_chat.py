"""``POST /v1/chat/completions``: the tokenizer's chat template, then one engine request.

Messages are rendered to text with the tokenizer's chat template (or ``--chat-template``) and
tokenized without adding special tokens (the template writes them), exactly as the offline
``LLM.chat`` does, so greedy output matches it for the same conversation.

``n`` > 1 gives ``n`` choices (index ``j`` = sample ``j``, seed + ``j`` when seeded); a stream
opens every choice with its role delta, then sends per-choice content deltas, each choice
finishing on its own. ``best_of`` is a completions-only field (400 here, as OpenAI).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pagefold.entrypoints.openai.memory import json_response
from pagefold.entrypoints.openai.protocol import (
    SSE_DONE,
    AbortingStreamingResponse,
    ChatCompletionRequest,
    ChatMessage,
    bad_request,
    sse,
    usage,
)
from pagefold.entrypoints.openai.serving_completion import (
    OpenAIServing,
    StreamCursor,
    _clamp,
    completion_tokens,
    ranked,
)
from pagefold.outputs import CompletionOutput, RequestOutput
from pagefold.sampling_params import SamplingParams


def _token_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _clamp(logprob), "bytes": list(text.encode("utf-8"))}


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args: Any, chat_template: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chat_template = chat_template

    # ------------------------------------------------------------------ prompt
    @staticmethod
    def _message_dict(i: int, m: ChatMessage) -> dict:
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text":
                    raise bad_request(f"messages[{i}].content[{j}]: only text content parts "
                                      f"are supported, got type {part.type!r}", "messages")
                if part.text is None:
                    raise bad_request(f"messages[{i}].content[{j}]: a content part of type "
                                      "'text' needs a 'text' string", "messages")
                texts.append(part.text)
            d["content"] = "\n".join(texts)
        elif m.content is None:
            d["content"] = ""
        return d

    def render(self, messages: list[ChatMessage], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False,
               chat_template_kwargs: dict | None = None) -> tuple[str, list[int]]:
        """``(prompt text, prompt token ids)`` of a conversation (400 on template errors)."""
        if not messages:
            raise bad_request("messages is empty; give at least one message", "messages")
        if continue_final_message and add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both "
                              "be true", "continue_final_message")
        conv = [self._message_dict(i, m) for i, m in enumerate(messages)]
        kwargs = dict(chat_template_kwargs or {})
        if continue_final_message:
            kwargs["continue_final_message"] = True
        if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("this model's tokenizer has no chat template; start the server "
                              "with --chat-template FILE or use /v1/completions", "messages")
        try:
            text = self.tokenizer.apply_chat_template(
                conv, chat_template=self.chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # noqa: BLE001 - jinja errors, template raise_exception
            raise bad_request(f"cannot apply the chat template: {e}", "messages") from None
        ids = self.tokens.encode_sync(text, add_special_tokens=False)
        return text, ids

    async def render_async(self, messages: list[ChatMessage], **kwargs: Any
                           ) -> tuple[str, list[int]]:
        """:meth:`render` in the tokenizer pool (templates and tokenizing are slow on long
        conversations; the event loop must stay free)."""
        return await self.tokens.run(self.render, messages, **kwargs)

    @staticmethod
    def content_chars(messages: list[ChatMessage]) -> int:
        """Characters of every message's text: the rendered prompt has at least these."""
        total = 0
        for m in messages:
            if isinstance(m.content, str):
                total += len(m.content)
            elif isinstance(m.content, list):
                total += sum(len(p.text or "") for p in m.content)
        return total

    # ------------------------------------------------------------------ request
    async def create(self, raw: Request, req: ChatCompletionRequest) -> Response:
        self.check_model(req.model)
        if req.tools and req.tool_choice != "none":
            raise bad_request("tool calling is not supported yet; omit tools or set "
                              "tool_choice to 'none'", "tools")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise bad_request("best_of is only available on /v1/completions; use n for "
                              "several chat choices", "best_of")
        self.check_text_fits(self.content_chars(req.messages), "messages")
        text, ids = await self.render_async(
            req.messages, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template_kwargs=req.chat_template_kwargs)
        self.check_ids(ids, "messages")
        if req.max_completion_tokens is not None:
            max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = req.max_tokens, "max_tokens"
        num_lp = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens=max_tokens, max_tokens_param=param,
                                      logprobs=num_lp, prompt_len=len(ids),
                                      logprobs_param="top_logprobs")
        rid = self.new_id("chatcmpl")
        created = int(time.time())
        stream = self.start([rid], [(text, ids)], [params], req.priority, req.cache_salt)
        if req.stream:
            first = await self.prime(raw, stream)
            body = self._stream(req, rid, created, params, first, stream)
            return AbortingStreamingResponse(body, media_type="text/event-stream")
        (final,) = await self.collect(raw, stream, 1)
        return json_response(self._response(req, rid, created, final))

    def _logprobs(self, comp: CompletionOutput, t0: int, t1: int, num: int) -> dict:
        content = []
        for tid, entry in zip(comp.token_ids[t0:t1], (comp.logprobs or [])[t0:t1]):
            lp = entry[tid]
            item = _token_entry(lp.decoded_token or "", lp.logprob)
            item["top_logprobs"] = [_token_entry(x.decoded_token or "", x.logprob)
                                    for x in ranked(entry, num)]
            content.append(item)
        return {"content": content}

    def _response(self, req: ChatCompletionRequest, rid: str, created: int,
                  out: RequestOutput) -> dict:
        choices = []
        for comp in out.outputs:
            lps = None
            if req.logprobs:
                lps = self._logprobs(comp, 0, len(comp.token_ids), req.top_logprobs or 0)
            choices.append({"index": comp.index,
                            "message": {"role": "assistant", "content": comp.text},
                            "logprobs": lps, "finish_reason": comp.finish_reason,
                            "stop_reason": comp.stop_reason})
        return {
            "id": rid, "object": "chat.completion", "created": created,
            "model": self.served_model_name, "choices": choices,
            "usage": usage(len(out.prompt_token_ids), completion_tokens([out]),
                           out.num_cached_tokens),
        }

    async def _stream(self, req: ChatCompletionRequest, rid: str, created: int,
                      params: SamplingParams, first: tuple[int, RequestOutput],
                      stream: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": self.served_model_name}

        def chunk(index: int, delta: dict, lps: dict | None = None, finish: str | None = None,
                  stop_reason: Any = None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = stop_reason
            data = dict(head, choices=[choice])
            if include_usage:
                data["usage"] = None
            return sse(data)

        cursors = [StreamCursor() for _ in range(params.n)]
        final: RequestOutput | None = None
        try:
            for j in range(params.n):
                yield chunk(j, {"role": "assistant", "content": ""})
            item: tuple[int, RequestOutput] | None = first
            while item is not None:
                out = item[1]
                if out.finished:
                    final = out
                for comp in out.outputs:
                    cur = cursors[comp.index]
                    if cur.finished:
                        continue  # this choice ended earlier; its siblings go on
                    delta, t0, t1 = cur.advance(comp, params.stop)
                    lps = (self._logprobs(comp, t0, t1, req.top_logprobs or 0)
                           if req.logprobs else None)
                    if cur.finished:
                        yield chunk(comp.index, {"content": delta} if delta else {}, lps,
                                    comp.finish_reason, comp.stop_reason)
                    elif delta or t1 > t0:
                        yield chunk(comp.index, {"content": delta}, lps)
                item = await anext(stream, None)
            if include_usage and final is not None:
                yield sse(dict(head, choices=[], usage=usage(
                    len(final.prompt_token_ids), completion_tokens([final]),
                    final.num_cached_tokens)))
            yield SSE_DONE
        except Exception as e:  # noqa: BLE001 - headers are out: report in-band
            yield self.stream_error_event(e)
            yield SSE_DONE
        finally:
            await stream.aclose()
