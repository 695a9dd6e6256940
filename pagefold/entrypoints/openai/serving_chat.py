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

from pagefold.entrypoints.openai.beam import beam_chat
from pagefold.entrypoints.openai.chat_parsing import (
    ToolCall,
    named_choice,
    parse_required,
    parse_tool_calls,
    partial_suffix,
    split_reasoning,
    template_messages,
    tool_constraint,
    tool_function,
    tool_start_marker,
)
from pagefold.entrypoints.openai.errors import bad_request
from pagefold.entrypoints.openai.fields import refuse_unsupported
from pagefold.entrypoints.openai.logprobs import (
    clamp_logprob,
    prompt_logprobs_json,
    ranked_ids,
    token_name,
)
from pagefold.entrypoints.openai.memory import json_response
from pagefold.entrypoints.openai.options import stream_usage
from pagefold.entrypoints.openai.protocol import (
    SSE_DONE,
    AbortingStreamingResponse,
    ChatCompletionRequest,
    ChatMessage,
    sse,
    usage,
)
from pagefold.entrypoints.openai.serving_completion import (
    OpenAIServing,
    StreamCursor,
    completion_tokens,
    refuse_beam_lora,
)
from pagefold.entrypoints.openai.tool_prompt import template_takes_tools, with_tools_fallback
from pagefold.entrypoints.openai.tool_stream import ToolCallStream
from pagefold.multimodal.processor import ImageInputProcessor
from pagefold.outputs import CompletionOutput, RequestOutput
from pagefold.sampling_params import SamplingParams


def _token_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": clamp_logprob(logprob), "bytes": list(text.encode("utf-8"))}


# Fields that shape the chat template's rendering: meaningless with ``prompt_token_ids``.
TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template",
                   "chat_template_kwargs", "tools", "documents", "reasoning_effort")


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args: Any, chat_template: str | None = None,
                 mm_processor: ImageInputProcessor | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chat_template = chat_template
        # Image inputs (``image_url`` parts) for a checkpoint with a vision tower, else None.
        self.mm_processor = mm_processor

    # ------------------------------------------------------------------ prompt
    def _message_dict(self, i: int, m: ChatMessage, images: list | None = None) -> dict:
        """The message as the template sees it; with ``images`` (a model that takes them)
        each ``image_url`` part is decoded into it and written as the image placeholder."""
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type == "image_url" and images is not None:
                    url = part.image_url
                    url = url.get("url") if isinstance(url, dict) else url
                    try:
                        images.append(self.mm_processor.decode_url(url))
                    except ValueError as e:
                        raise bad_request(f"messages[{i}].content[{j}]: {e}",
                                          "messages") from None
                    texts.append(self.mm_processor.placeholder(self.tokenizer))
                    continue
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
               chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
               documents: list[dict] | None = None, chat_template: str | None = None,
               add_special_tokens: bool = False, tool_mode: str = "auto",
               tool_name: str | None = None, images: list | None = None
               ) -> tuple[str, list[int]]:
        """``(prompt text, prompt token ids)`` of a conversation (400 on template errors).
        ``tools`` and ``documents`` are handed to the template, as vLLM does; a template
        that does not render ``tools`` gets them in the system message instead
        (:mod:`~pagefold.entrypoints.openai.tool_prompt`; ``tool_mode`` / ``tool_name``
        say how the model is asked to call; ``images``: a list the messages' images are appended
        to, None where images are refused)."""
        if not messages:
            raise bad_request("messages is empty; give at least one message", "messages")
        if continue_final_message and add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both "
                              "be true", "continue_final_message")
        conv = template_messages([self._message_dict(i, m, images)
                                  for i, m in enumerate(messages)])
        kwargs = dict(chat_template_kwargs or {})
        if continue_final_message:
            kwargs["continue_final_message"] = True
        if tools:
            kwargs["tools"] = tools
        if documents:
            kwargs["documents"] = documents
        template = chat_template or self.chat_template
        if template is None and not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("this model's tokenizer has no chat template; start the server "
                              "with --chat-template FILE or use /v1/completions", "messages")
        if not template_takes_tools(template or self.tokenizer.chat_template):
            conv = with_tools_fallback(conv, tools, tool_mode, tool_name,
                                       self.options.tool_call_parser)
            kwargs.pop("tools", None)
        try:
            text = self.tokenizer.apply_chat_template(
                conv, chat_template=template, tokenize=False,
                add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # noqa: BLE001 - jinja errors, template raise_exception
            raise bad_request(f"cannot apply the chat template: {e}", "messages") from None
        ids = self.tokens.encode_sync(text, add_special_tokens=add_special_tokens)
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
    def _tool_mode(self, req: ChatCompletionRequest) -> tuple[str, str | None]:
        """``(mode, named function)``: mode none / auto / required / named."""
        if not req.tools:
            if req.tool_choice not in (None, "none", "auto"):
                raise bad_request("tool_choice needs tools", "tool_choice")
            return "none", None
        try:
            for t in req.tools:
                tool_function(t)
            name = named_choice(req.tool_choice)
        except ValueError as e:
            raise bad_request(str(e), "tools") from None
        if name is not None:
            return "named", name
        choice = req.tool_choice or "auto"
        if choice not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice must be none, auto, required or a named function, "
                              f"got {choice!r}", "tool_choice")
        if choice == "auto":
            opts = self.options
            if not (opts.enable_auto_tool_choice and opts.tool_call_parser):
                raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                                  '--tool-call-parser to be set', "tool_choice")
        return choice, None

    async def create(self, raw: Request, req: ChatCompletionRequest) -> Response:
        lora = self.check_model(req.model)
        refuse_unsupported(req, self.allowed_fields)
        mode, tool_name = self._tool_mode(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise bad_request("best_of is only available on /v1/completions; use n for "
                              "several chat choices", "best_of")
        kwargs = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        images = [] if self.mm_processor is not None else None
        if req.prompt_token_ids is not None:
            text, ids = None, self._token_in(req)
        else:
            self.check_text_fits(self.content_chars(req.messages), "messages")
            text, ids = await self.render_async(
                req.messages, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template_kwargs=kwargs, tools=req.tools,
                documents=req.documents, chat_template=req.chat_template,
                add_special_tokens=bool(req.add_special_tokens), tool_mode=mode,
                tool_name=tool_name, images=images)
        ids2 = self.prepare_prompt(req, ids)
        if ids2 != ids:
            if images:
                raise bad_request("truncate_prompt_tokens cannot cut a prompt with images",
                                  "truncate_prompt_tokens")
            text, ids = None, ids2
        mm = None
        if images:
            if req.use_beam_search:
                raise bad_request("beam search takes no image inputs", "use_beam_search")
            try:
                ids, mm = self.mm_processor.process(ids, images)
            except ValueError as e:
                raise bad_request(str(e), "messages") from None
        self.check_ids(ids, "messages")
        if req.max_completion_tokens is not None:
            max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = req.max_tokens, "max_tokens"
        num_lp = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens=max_tokens, max_tokens_param=param,
                                      logprobs=num_lp, prompt_len=len(ids),
                                      logprobs_param="top_logprobs")
        if mode in ("named", "required"):
            if params.structured_outputs is not None:
                raise bad_request("tool_choice required / named cannot be combined with "
                                  "another output constraint", "tool_choice")
            try:
                params.structured_outputs = tool_constraint(
                    req.tools, req.tool_choice, req.parallel_tool_calls is not False)
            except ValueError as e:
                raise bad_request(str(e), "tool_choice") from None
        rid = f"chatcmpl-{req.request_id}" if req.request_id else self.new_id("chatcmpl")
        created = int(time.time())
        if req.use_beam_search:
            refuse_beam_lora(lora)
            return await beam_chat(self, raw, req, (text, ids), params, rid, created, mode)
        stream = self.start([rid], [(text, ids)], [params], req.priority, req.cache_salt, lora,
                            mm_inputs=mm)
        if req.stream:
            first = await self.prime(raw, stream)
            body = self.stream_events(req, rid, created, params, first, stream, mode)
            return AbortingStreamingResponse(body, media_type="text/event-stream")
        (final,) = await self.collect(raw, stream, 1)
        return json_response(self.response_json(req, rid, created, final, mode))

    @staticmethod
    def _token_in(req: ChatCompletionRequest) -> list[int]:
        """vLLM's token-in chat: ``prompt_token_ids`` is the rendered prompt, so messages
        must be empty and no template option may be sent (each would be ignored)."""
        if req.messages:
            raise bad_request("give messages or prompt_token_ids, not both (prompt_token_ids "
                              "is an already rendered conversation)", "prompt_token_ids")
        sent = [f for f in TEMPLATE_FIELDS if f in req.model_fields_set]
        if sent:
            raise bad_request(f"{sent[0]} shapes the chat template, which prompt_token_ids "
                              "skips; leave it out", sent[0])
        return list(req.prompt_token_ids or [])

    def _echo_prefix(self, req: ChatCompletionRequest) -> str:
        """vLLM's chat ``echo``: the last message's content when it is the assistant's."""
        if not req.echo or not req.messages or req.messages[-1].role != "assistant":
            return ""
        return self._message_dict(len(req.messages) - 1, req.messages[-1])["content"]

    def _logprobs(self, comp: CompletionOutput, t0: int, t1: int, num: int,
                  as_ids: bool = False) -> dict:
        content = []
        for tid, entry in zip(comp.token_ids[t0:t1], (comp.logprobs or [])[t0:t1]):
            lp = entry[tid]
            item = _token_entry(token_name(tid, lp.decoded_token, as_ids), lp.logprob)
            item["top_logprobs"] = [_token_entry(token_name(t, x.decoded_token, as_ids),
                                                 x.logprob)
                                    for t, x in ranked_ids(entry, num)]
            content.append(item)
        return {"content": content}

    def _message(self, req: ChatCompletionRequest, text: str, mode: str
                 ) -> tuple[dict, bool]:
        """The assistant message of a finished output and whether it called tools."""
        reasoning = None
        if self.options.reasoning_parser:
            reasoning, text = split_reasoning(text, self.options.reasoning_parser, final=True)
        content: str | None = text
        calls: list[ToolCall] = []
        if mode == "named":
            calls, content = [ToolCall(named_choice(req.tool_choice) or "", text)], None
        elif mode == "required":
            calls = parse_required(text)
            content = None if calls else text
        elif mode == "auto":
            content, calls = parse_tool_calls(text, self.options.tool_call_parser or "hermes")
        if calls and req.parallel_tool_calls is False:
            calls = calls[:1]
        msg: dict[str, Any] = {"role": "assistant", "content": content,
                               "tool_calls": [c.to_json() for c in calls]}
        if self.options.reasoning_parser and req.include_reasoning:
            msg["reasoning_content"] = reasoning
        return msg, bool(calls) and mode != "named"

    def response_json(self, req: ChatCompletionRequest, rid: str, created: int,
                      out: RequestOutput, mode: str = "none") -> dict:
        choices = []
        echo = self._echo_prefix(req)
        as_ids = self.as_token_ids(req)
        for comp in out.outputs:
            lps = None
            if req.logprobs:
                lps = self._logprobs(comp, 0, len(comp.token_ids),
                                     self.shown_logprobs(req, req.top_logprobs or 0), as_ids)
            msg, called = self._message(req, comp.text, mode)
            if echo and msg["content"] is not None:
                msg["content"] = echo + msg["content"]
            choice = {"index": comp.index, "message": msg, "logprobs": lps,
                      "finish_reason": "tool_calls" if called else comp.finish_reason,
                      "stop_reason": comp.stop_reason, "token_ids": None}
            if req.return_token_ids:
                choice["token_ids"] = list(comp.token_ids)
            choices.append(choice)
        body = {
            "id": rid, "object": "chat.completion", "created": created,
            "model": self.served_model_name, "choices": choices,
            "usage": usage(len(out.prompt_token_ids), completion_tokens([out]),
                           out.num_cached_tokens),
            "prompt_logprobs": None, "prompt_token_ids": None,  # vLLM's keys, null unless asked
        }
        if out.kv_transfer_params is not None:
            body["kv_transfer_params"] = out.kv_transfer_params
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(out)
        if req.return_token_ids:
            body["prompt_token_ids"] = list(out.prompt_token_ids)
        return body

    async def stream_events(self, req: ChatCompletionRequest, rid: str, created: int,
                            params: SamplingParams, first: tuple[int, RequestOutput],
                            stream: AsyncIterator[tuple[int, RequestOutput]],
                            mode: str = "none") -> AsyncIterator[str]:
        include_usage, continuous = stream_usage(self.options, req.stream_options)
        as_ids = self.as_token_ids(req)
        head = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": self.served_model_name}
        prompt_len = [len(first[1].prompt_token_ids)]  # the role chunks' usage too
        # return_token_ids: the first chunk carries the prompt ids, each chunk its new ids.
        prompt_ids = [list(first[1].prompt_token_ids)] if req.return_token_ids else []

        def chunk(index: int, delta: dict, lps: dict | None = None, finish: str | None = None,
                  stop_reason: Any = None, num_tokens: int = 0,
                  ids: list[int] | None = None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = stop_reason
            if req.return_token_ids:
                choice["token_ids"] = ids or []
            data = dict(head, choices=[choice])
            if prompt_ids:
                data["prompt_token_ids"] = prompt_ids.pop()
            if continuous:
                data["usage"] = usage(prompt_len[0], num_tokens, 0)
            elif include_usage:
                data["usage"] = None
            return sse(data)

        cursors = [StreamCursor() for _ in range(params.n)]
        views = [ChatStreamView(self.options, mode, named_choice(req.tool_choice)
                                if mode == "named" else None, req)
                 for _ in range(params.n)]
        final: RequestOutput | None = None
        try:
            echo = self._echo_prefix(req)
            for j in range(params.n):
                yield chunk(j, {"role": "assistant", "content": echo})
            item: tuple[int, RequestOutput] | None = first
            while item is not None:
                out = item[1]
                prompt_len[0] = len(out.prompt_token_ids)
                if out.finished:
                    final = out
                for comp in out.outputs:
                    cur = cursors[comp.index]
                    if cur.finished:
                        continue  # this choice ended earlier; its siblings go on
                    delta_text, t0, t1 = cur.advance(comp, params.stop)
                    lps = (self._logprobs(comp, t0, t1,
                                          self.shown_logprobs(req, req.top_logprobs or 0), as_ids)
                           if req.logprobs else None)
                    deltas, called = views[comp.index].feed(delta_text, cur.finished)
                    n_tok = len(comp.token_ids)
                    ids = list(comp.token_ids[t0:t1])  # sent once, with the logprobs
                    if cur.finished:
                        reason = "tool_calls" if called else comp.finish_reason
                        for d in deltas[:-1]:
                            yield chunk(comp.index, d, lps, num_tokens=n_tok, ids=ids)
                            lps, ids = None, None
                        yield chunk(comp.index, deltas[-1] if deltas else {}, lps, reason,
                                    comp.stop_reason, n_tok, ids)
                    elif deltas or t1 > t0:
                        for d in deltas or [{}]:
                            yield chunk(comp.index, d, lps, num_tokens=n_tok, ids=ids)
                            lps, ids = None, None
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


class ChatStreamView:
    """Turns one choice's stream of text deltas into chat deltas: ``reasoning_content``
    (with a reasoning parser), ``content``, and ``tool_calls`` as OpenAI streams them (see
    :mod:`~pagefold.entrypoints.openai.tool_stream`: a header delta with id, type, name and
    arguments ``""`` per call, then argument pieces).

    Named tool choice: the whole output is the arguments. ``required``: the output is a JSON
    array of ``{"name", "parameters"}`` objects, streamed call by call as it is generated.
    ``auto``: the content before the parser's first call marker streams as content; calls
    stream as they are generated for the ``hermes`` / ``qwen`` (``<tool_call>`` blocks) and
    ``json`` parsers, and arrive whole at the end for ``pythonic``."""

    def __init__(self, options, mode: str, name: str | None, req) -> None:
        self.options = options
        self.mode = mode
        self.name = name
        self.req = req
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0
        self.tools = ToolCallStream(1 if req.parallel_tool_calls is False else None)

    def _blocks(self, content: str, parser: str) -> list[str]:
        """The call blocks of an ``auto`` output so far (each one JSON value)."""
        if parser in ("hermes", "qwen"):
            parts = content.split("<tool_call>")[1:]
            return [p.split("</tool_call>")[0] for p in parts]
        if parser == "pythonic":
            return []
        s = content.lstrip()
        return [s] if s[:1] in ("{", "[") else []

    def feed(self, delta_text: str, finished: bool) -> tuple[list[dict], bool]:
        """The deltas to send for ``delta_text`` (in order; each one chunk) and whether the
        choice called tools (its finish reason is then ``tool_calls``)."""
        self.text += delta_text
        out: dict[str, Any] = {}
        reasoning, content = None, self.text
        parser = self.options.reasoning_parser
        if parser:
            reasoning, content = split_reasoning(self.text, parser, final=finished)
            if reasoning is not None and len(reasoning) > self.sent_reasoning:
                if self.req.include_reasoning:
                    out["reasoning_content"] = reasoning[self.sent_reasoning:]
                self.sent_reasoning = len(reasoning)
        calls: list[dict] = []
        if self.mode == "named":
            calls = self.tools.named(self.name or "", content)
        elif self.mode in ("required", "auto"):
            visible, rest, final = "", None, []
            tool_parser = self.options.tool_call_parser or "hermes"
            if self.mode == "required":
                calls = self.tools.feed([content])
                if finished:
                    final = parse_required(content)
            else:
                marker = tool_start_marker(tool_parser)
                cut = content.find(marker)
                visible = content if cut < 0 else content[:cut]
                if cut < 0 and not finished:
                    visible = visible[:len(visible) - partial_suffix(visible, marker)]
                if marker in ("[", "{") and not content.lstrip()[:1] == marker:
                    visible = content  # no call at the start: plain content
                calls = self.tools.feed(self._blocks(content, tool_parser))
                if finished:
                    rest, final = parse_tool_calls(content, tool_parser)
            if finished:
                calls += self.tools.finish(final)
                if self.tools.started:
                    visible = (rest or "") if final else content[:self.sent_content]
                    visible = visible if visible.startswith(
                        content[:self.sent_content]) else content[:self.sent_content]
                else:
                    visible = content
            if len(visible) > self.sent_content:
                out["content"] = visible[self.sent_content:]
                self.sent_content = len(visible)
        else:
            if len(content) > self.sent_content:
                out["content"] = content[self.sent_content:]
                self.sent_content = len(content)
        deltas = ([out] if out else []) + [{"tool_calls": [c]} for c in calls]
        return deltas, self.tools.started and self.mode != "named"
