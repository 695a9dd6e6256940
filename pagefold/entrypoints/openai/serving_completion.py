"""``POST /v1/completions`` and the request plumbing shared with chat (:class:`OpenAIServing`).

Shared rules (chat follows them too):

* everything that can be checked in the API process is checked before the engine sees the
  request (model name, prompt length against ``max_model_len``, token id range, sampling
  fields); the core's own ``ValueError``\\ s come back as :class:`RequestRejectedError` and are
  answered 400 as well; a dead engine core is 503;
* a client that disconnects (streaming or not) cancels its generation, which aborts the
  engine request, so its blocks are freed on the core's next step;
* a stream is *primed*: the first engine output is awaited before the 200 and its headers go
  out, so a rejected request or a dead core still gets a real status code;
* ``n`` > 1 (parallel sampling) is one engine request per prompt whose ``RequestOutput`` has
  ``outputs[j]`` per sample; choice ``index`` is ``prompt_index * n + j`` (OpenAI's order).
  Streams send per-choice deltas, each choice finishing on its own; usage counts the
  completion tokens of every returned choice. ``best_of`` (completions only) generates
  ``best_of >= n`` samples and returns the ``n`` with the highest cumulative logprob, so it
  cannot be streamed when ``best_of > n`` (400, as OpenAI).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from pagefold.engine.client import AsyncEngineClient, EngineDeadError, RequestRejectedError
from pagefold.entrypoints.openai.beam import beam_completion
from pagefold.entrypoints.openai.engine_calls import (
    engine_error,
    merge_generations,
    race_disconnect,
)
from pagefold.entrypoints.openai.errors import APIError, bad_request, error_body
from pagefold.entrypoints.openai.fields import refuse_unsupported, structured_outputs
from pagefold.entrypoints.openai.logprobs import (
    completion_logprobs,
    echo_logprobs,
    prompt_logprobs_json,
)
from pagefold.entrypoints.openai.memory import json_response
from pagefold.entrypoints.openai.options import ServeOptions, log_request, stream_usage
from pagefold.entrypoints.openai.protocol import (
    SSE_DONE,
    AbortingStreamingResponse,
    CompletionRequest,
    SamplingRequest,
    held_back,
    sse,
    usage,
)
from pagefold.entrypoints.openai.tokenizing import TokenizerPool
from pagefold.lora.request import LoRARequest
from pagefold.multimodal.inputs import MultiModalInputs
from pagefold.outputs import CompletionOutput, RequestOutput
from pagefold.sampling_params import SamplingParams

T = TypeVar("T")
# Most samples one prompt may ask for (n and best_of): each is a running engine request.
MAX_SAMPLES = 128
# "Every entry" for logprobs display (logprob_token_ids).
MAX_SHOWN = 1 << 30
# Default cap on samples x max_tokens x (1 + logprobs) of one prompt (see ``bound_output``).
DEFAULT_MAX_REQUEST_OUTPUT_TOKENS = 2**18


def refuse_beam_lora(lora: LoRARequest | None) -> None:
    """Beam search runs on the base model only: a LoRA adapter with it is a 400."""
    if lora is not None:
        raise bad_request(f"use_beam_search with the LoRA adapter `{lora.lora_name}` is not "
                          f"supported", "use_beam_search")


class OpenAIServing:
    """What both endpoints need: engine handle, tokenizer, model name and validation."""

    def __init__(self, client: AsyncEngineClient, tokenizer, served_model_name: str, *,
                 extra_eos_ids: list[int] | None = None,
                 options: ServeOptions | None = None,
                 tokens: TokenizerPool | None = None,
                 max_request_output_tokens: int = DEFAULT_MAX_REQUEST_OUTPUT_TOKENS) -> None:
        self.client = client
        self.tokenizer = tokenizer
        # Tokenizer work runs here, off the event loop (shared by every endpoint).
        self.tokens = tokens if tokens is not None else TokenizerPool(tokenizer)
        self.max_request_output_tokens = max_request_output_tokens
        self.served_model_name = served_model_name
        self.extra_eos_ids = list(extra_eos_ids or [])
        self.options = options or ServeOptions()
        # Sampling fields a request leaves out take these (generation_config.json defaults).
        self.defaults: dict[str, Any] = dict(self.options.default_sampling)

    @property
    def allowed_fields(self) -> tuple[str, ...]:
        """Fields ``fields.REFUSED`` lists that this server honours after all."""
        return ("kv_transfer_params",) if self.options.kv_transfer else ()

    @property
    def max_model_len(self) -> int:
        return self.client.info.max_model_len

    def check_model(self, model: str | None) -> LoRARequest | None:
        """An unknown model is a 404; no model (or ``""``) means the served one, as vLLM; a
        LoRA adapter's name (``--enable-lora``) gives its LoRARequest."""
        names = self.options.served_model_names or [self.served_model_name]
        if not model or model == self.served_model_name or model in names:
            return None
        lora = self.options.lora.get(model) if self.options.lora is not None else None
        if lora is not None:
            return lora
        raise APIError(404, f"The model `{model}` does not exist; this server serves "
                       f"`{self.served_model_name}`.", param="model",
                       code="model_not_found")

    def check_text_fits(self, num_chars: int, param: str = "prompt") -> None:
        """Refuse, before tokenizing, a text too long to ever fit (see ``tokenizing``)."""
        if self.tokens.cannot_fit(num_chars, self.max_model_len - 1):
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens; a text "
                f"of {num_chars} characters cannot fit (no token is longer than "
                f"{self.tokens.max_token_chars} characters). Please reduce the {param}.",
                param, code="context_length_exceeded")

    def check_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        """Reject what the core would: empty, too long, ids outside the vocabulary."""
        if not ids:
            raise bad_request("the prompt is empty; give at least one token", param)
        if len(ids) >= self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens, but the "
                f"prompt has {len(ids)} tokens; the prompt must be shorter than "
                f"{self.max_model_len} tokens to leave room for one output token.", param,
                code="context_length_exceeded")
        vocab = self.client.info.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"prompt token ids out of range [0, {vocab}): {bad[:5]}", param)
        return ids

    def sampling_params(self, req: SamplingRequest, *, max_tokens: int | None,
                        max_tokens_param: str, logprobs: int | None,
                        prompt_len: int, logprobs_param: str = "logprobs") -> SamplingParams:
        """SamplingParams for one prompt; every problem is a 400 naming the field."""
        self._check_samples(req)
        refuse_unsupported(req, self.allowed_fields)
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              "stream_options")
        constraint = structured_outputs(req)
        room = self.max_model_len - prompt_len
        if max_tokens is None and "max_tokens" in self.defaults:
            max_tokens = min(int(self.defaults["max_tokens"]), room)
        if max_tokens is not None and max_tokens > room:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} for the completion). Please reduce the prompt or "
                f"{max_tokens_param}.", max_tokens_param, code="context_length_exceeded")
        max_tokens = self.bound_output(req, max_tokens, room, logprobs, max_tokens_param,
                                       logprobs_param)
        stop_ids = self._token_ids(list(req.stop_token_ids or []), "stop_token_ids") or []
        if self.extra_eos_ids and not req.ignore_eos:
            stop_ids = sorted(set(stop_ids) | set(self.extra_eos_ids))
        d = self.defaults

        def pick(name: str, neutral: Any) -> Any:
            value = getattr(req, name)
            return d.get(name, neutral) if value is None else value

        kw: dict[str, Any] = dict(
            temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0), min_p=pick("min_p", 0.0),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            n=1 if req.n is None else req.n, best_of=req.best_of,
            seed=req.seed, stop=req.stop, stop_token_ids=stop_ids, ignore_eos=req.ignore_eos,
            max_tokens=max_tokens, min_tokens=req.min_tokens,
            logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            structured_outputs=constraint, logit_bias=self._logit_bias(req.logit_bias),
            allowed_token_ids=self._token_ids(req.allowed_token_ids, "allowed_token_ids"),
            bad_words=req.bad_words or None, prompt_logprobs=req.prompt_logprobs)
        if req.kv_transfer_params:  # accepted only with a kv_transfer_config (fields.py)
            kw["extra_args"] = {"kv_transfer_params": dict(req.kv_transfer_params)}
        if req.prompt_logprobs_temperature is not None:
            kw["prompt_logprobs_temperature"] = req.prompt_logprobs_temperature
        if req.logprob_token_ids is not None:
            if logprobs is None:
                raise bad_request(f"logprob_token_ids needs {logprobs_param} (the ids' logprobs "
                                  "are returned in its place)", "logprob_token_ids")
            kw["logprob_token_ids"] = self._token_ids(req.logprob_token_ids,
                                                      "logprob_token_ids")
        try:
            sp = SamplingParams(**kw)
            sp.update_from_tokenizer(self.tokenizer)
            self._check_logprobs(sp)
            return sp
        except ValueError as e:
            # SamplingParams' messages start with the field name: point ``param`` at it.
            field = str(e).split(" ", 1)[0]
            renamed = {"max_tokens": max_tokens_param, "logprobs": logprobs_param}
            param = renamed.get(field, field if field in kw else None)
            raise bad_request(str(e), param) from None

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        if not bias:
            return None
        out = {}
        for k, v in bias.items():
            try:
                tid = int(k)
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {k!r}",
                                  "logit_bias") from None
            out[tid] = v
        self._token_ids(list(out), "logit_bias")
        return out

    def _token_ids(self, ids: list[int] | None, param: str) -> list[int] | None:
        if ids is None:
            return None
        vocab = self.client.info.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"{param}: token ids out of range [0, {vocab}): {bad[:5]}", param)
        return ids

    @staticmethod
    def shown_logprobs(req: SamplingRequest, num: int) -> int:
        """Entries shown per token: the top ``num``, or every one with ``logprob_token_ids``
        (the asked ids and the sampled token)."""
        return MAX_SHOWN if req.logprob_token_ids else num

    def as_token_ids(self, req: SamplingRequest) -> bool:
        """Whether logprobs name tokens ``token_id:N`` (the request, else the server flag)."""
        if req.return_tokens_as_token_ids is not None:
            return req.return_tokens_as_token_ids
        return self.options.return_tokens_as_token_ids

    def _check_logprobs(self, sp: SamplingParams) -> None:
        """``prompt_logprobs`` within ``--max-logprobs`` (``logprobs`` is bounded with the
        output in :meth:`bound_output`)."""
        limit, k = self.client.config.max_logprobs, sp.prompt_logprobs
        if k is not None and k > limit:
            raise ValueError(f"prompt_logprobs must be at most {limit} (--max-logprobs), got {k}")

    def prepare_prompt(self, req: SamplingRequest, ids: list[int]) -> list[int]:
        """Apply ``truncate_prompt_tokens`` / ``truncation_side`` to a tokenized prompt."""
        k = req.truncate_prompt_tokens
        if k is None:
            return ids
        if k < -1 or k == 0:
            raise bad_request(f"truncate_prompt_tokens must be -1 or >= 1, got {k}",
                              "truncate_prompt_tokens")
        keep = self.max_model_len - 1 if k == -1 else k
        if len(ids) <= keep:
            return ids
        return list(ids[:keep]) if req.truncation_side == "right" else list(ids[-keep:])

    def bound_output(self, req: SamplingRequest, max_tokens: int | None, room: int,
                     logprobs: int | None, max_tokens_param: str, logprobs_param: str) -> int:
        """The max_tokens to run with, within the output memory bounds of one request.

        Everything a non-streaming request generates is held until the response goes out:
        each sampled token and each logprob entry. So ``logprobs`` is at most the engine's
        ``max_logprobs``, and samples x max_tokens x (1 + logprobs) at most
        ``max_request_output_tokens``: over it is a 400 naming the limit; an unset
        max_tokens (up to the context) is lowered to fit instead."""
        limit = self.client.config.max_logprobs
        if logprobs is not None and logprobs > limit:
            raise bad_request(f"{logprobs_param} must be at most {limit} on this server "
                              f"(--max-logprobs), got {logprobs}", logprobs_param)
        samples = max(req.n or 1, req.best_of or 1, 1)
        per_token = samples * (1 + (logprobs or 0))
        cap = self.max_request_output_tokens
        if max_tokens is None:
            fit = cap // per_token
            if fit < 1:
                raise bad_request(f"n={samples} with logprobs={logprobs} exceeds this server's "
                                  f"limit of {cap} output tokens per request "
                                  "(--max-request-output-tokens)", "n")
            return min(room, fit)
        if max_tokens * per_token > cap:
            what = f"{samples} sample(s) x {max_tokens_param}={max_tokens}"
            if logprobs:
                what += f" x (1 + {logprobs_param}={logprobs})"
            raise bad_request(
                f"{what} = {max_tokens * per_token} exceeds this server's limit of {cap} output "
                f"tokens per request (--max-request-output-tokens); lower {max_tokens_param}, "
                f"n or {logprobs_param}", max_tokens_param, code="output_too_large")
        return max_tokens

    def _check_samples(self, req: SamplingRequest) -> None:
        """``n`` / ``best_of`` bounds the API enforces (SamplingParams checks ``>= 1`` and
        ``best_of >= n``): at most :data:`MAX_SAMPLES`, and a family must be able to fit the
        pool at all -- each sample holds at least one block of every cache group of its own."""
        info = self.client.info
        for name in ("n", "best_of"):
            value = getattr(req, name)
            if value is None or value < 1:
                continue
            if value > MAX_SAMPLES:
                raise bad_request(f"{name} must be at most {MAX_SAMPLES}, got {value}", name)
            need = value * max(len(info.groups), 1)
            if need > info.num_usable_blocks:
                raise bad_request(
                    f"{name}={value}: {value} samples need at least {need} cache blocks, but "
                    f"the pool has {info.num_usable_blocks}; lower {name}", name)

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    def start(self, ids: list[str], prompts: list[tuple[str | None, list[int]]],
              params: list[SamplingParams], priority: int, cache_salt: str | None = None,
              lora_request: LoRARequest | None = None,
              mm_inputs: MultiModalInputs | None = None
              ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Generations of every prompt, merged as ``(index, output)``; ``mm_inputs``: the
        images of a single prompt (the chat endpoint's)."""
        if cache_salt is not None and not cache_salt:
            raise bad_request("cache_salt must be a non-empty string", "cache_salt")
        self.client.check_alive()
        for rid, (text, pids), sp in zip(ids, prompts, params):
            log_request(self.options, rid, text, pids, sp)
        extra = {"mm_inputs": mm_inputs} if mm_inputs is not None else {}
        gens = [self.client.generate(text, pids, sp, request_id=rid, priority=priority,
                                     cache_salt=cache_salt, lora_request=lora_request,
                                     **extra)
                for rid, (text, pids), sp in zip(ids, prompts, params)]
        return merge_generations(gens)

    async def collect(self, raw: Request, stream: AsyncIterator[tuple[int, RequestOutput]],
                      n: int) -> list[RequestOutput]:
        """The final output of each prompt (cancelled if the client disconnects)."""

        async def run() -> list[RequestOutput]:
            last: dict[int, RequestOutput] = {}
            async for i, out in stream:
                last[i] = out
            return [last[i] for i in range(n)]

        try:
            return await race_disconnect(raw, run())
        except (RequestRejectedError, EngineDeadError) as e:
            raise engine_error(e) from None

    async def prime(self, raw: Request, stream: AsyncIterator[tuple[int, RequestOutput]]
                    ) -> tuple[int, RequestOutput]:
        """The first output of a stream (errors become statuses before the 200 goes out)."""
        try:
            return await race_disconnect(raw, stream.__anext__())
        except (RequestRejectedError, EngineDeadError) as e:
            await stream.aclose()
            raise engine_error(e) from None
        except BaseException:
            await stream.aclose()
            raise

    @staticmethod
    def stream_error_event(e: Exception) -> str:
        if isinstance(e, RequestRejectedError | EngineDeadError):
            err = engine_error(e)
            return sse(error_body(err.message, err.type, err.param, err.code))
        return sse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"))


class StreamCursor:
    """What a stream has sent of one choice: text characters, tokens, text offset.

    A choice is finished once its ``CompletionOutput`` has a finish reason (a sample of a
    parallel-sampling request may finish before its siblings); nothing is sent after that."""

    __slots__ = ("text", "tokens", "offset", "started", "finished")

    def __init__(self) -> None:
        self.text = 0
        self.tokens = 0
        self.offset = 0
        self.started = False
        self.finished = False

    def advance(self, comp: CompletionOutput, stops: list[str]) -> tuple[str, int, int]:
        """``(new text, first new token, end token)``; holds back a possible stop string."""
        done = comp.finish_reason is not None
        end = len(comp.text)
        if not done:
            end -= held_back(comp.text, stops)
        end = max(end, self.text)
        delta = comp.text[self.text:end]
        self.text = end
        t0, self.tokens = self.tokens, len(comp.token_ids)
        self.finished = done
        return delta, t0, self.tokens


def choice_outputs(out: RequestOutput, n: int, prompt_index: int = 0
                   ) -> list[tuple[int, CompletionOutput]]:
    """``(choice index, output)`` of every sample of one prompt's output."""
    return [(prompt_index * n + c.index, c) for c in out.outputs]


def completion_tokens(outs: list[RequestOutput]) -> int:
    """Completion tokens over every returned choice of every prompt."""
    return sum(len(c.token_ids) for o in outs for c in o.outputs)


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, raw: Request, req: CompletionRequest) -> Response:
        lora = self.check_model(req.model)
        refuse_unsupported(req, self.allowed_fields)
        if req.prompt is None:
            raise bad_request("prompt is required", "prompt")
        prompts = await self._prompts(req.prompt, req)
        if req.kv_transfer_params and len(prompts) > 1:
            raise bad_request("kv_transfer_params names one request: send one prompt",
                              "kv_transfer_params")
        params = [self.sampling_params(req, max_tokens=req.max_tokens,
                                       max_tokens_param="max_tokens", logprobs=req.logprobs,
                                       prompt_len=len(ids)) for _, ids in prompts]
        if req.echo and req.logprobs is not None:
            # echo + logprobs scores the prompt too (lm-eval's log-likelihood): the prompt's
            # logprobs come with the output, as many alternatives as the output's.
            for sp in params:
                sp.prompt_logprobs = max(sp.prompt_logprobs or 0, req.logprobs)
        if req.stream and params[0].best_of > params[0].n:
            raise bad_request(f"best_of={req.best_of} with n={params[0].n} cannot be streamed "
                              "(the best samples are only known at the end); drop stream or "
                              "best_of", "best_of")
        base = f"cmpl-{req.request_id}" if req.request_id else self.new_id("cmpl")
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        created = int(time.time())
        if req.use_beam_search:
            refuse_beam_lora(lora)
            return await beam_completion(self, raw, req, prompts, params, base, created)
        stream = self.start(ids, prompts, params, req.priority, req.cache_salt, lora)
        if req.stream:
            first = await self.prime(raw, stream)
            body = self.stream_events(req, base, created, prompts, params, first, stream)
            return AbortingStreamingResponse(body, media_type="text/event-stream")
        finals = await self.collect(raw, stream, len(prompts))
        return json_response(self.response_json(req, base, created, prompts, params[0].n, finals))

    async def _prompts(self, prompt, req: CompletionRequest | None = None
                       ) -> list[tuple[str | None, list[int]]]:
        """``(text or None, token ids)`` per prompt of a string / list / token-id batch;
        every text is bounded first, then tokenized off the event loop."""
        if isinstance(prompt, str):
            items: list = [prompt]
        elif prompt and isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise bad_request("prompt is an empty list; give at least one prompt", "prompt")
        for p in items:
            if isinstance(p, str):
                self.check_text_fits(len(p))
        out = []
        for p in items:
            if isinstance(p, str):
                add = True if req is None or req.add_special_tokens is None else (
                    req.add_special_tokens)
                ids = await self.tokens.encode(p, add_special_tokens=add)
                if req is not None and req.truncate_prompt_tokens is not None:
                    ids2 = self.prepare_prompt(req, ids)
                    p, ids = (p if ids2 == ids else None), ids2
                out.append((p, self.check_ids(ids)))
            else:
                ids = list(p) if req is None else self.prepare_prompt(req, list(p))
                out.append((None, self.check_ids(ids)))
        return out

    def _prompt_text(self, text: str | None, ids: list[int]) -> str:
        return text if text is not None else self.tokenizer.decode(ids)

    def response_json(self, req: CompletionRequest, rid: str, created: int,
                      prompts: list, n: int, finals: list[RequestOutput]) -> dict:
        choices, n_prompt, n_cached = [], 0, 0
        as_ids = self.as_token_ids(req)
        for i, ((text, ids), out) in enumerate(zip(prompts, finals)):
            prefix = self._prompt_text(text, ids) if req.echo else ""
            for index, comp in choice_outputs(out, n, i):
                lps = None
                if req.logprobs is not None:
                    lps = completion_logprobs(comp, 0, len(comp.token_ids),
                                              self.shown_logprobs(req, req.logprobs),
                                              len(prefix), as_ids)
                    if req.echo:
                        lps = echo_logprobs(self.tokenizer, out, req.logprobs, lps, as_ids)
                # vLLM's choice always has these keys (null unless asked for).
                choice = {"index": index, "text": prefix + comp.text, "logprobs": lps,
                          "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason,
                          "prompt_logprobs": None, "token_ids": None, "prompt_token_ids": None}
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(out)
                if req.return_token_ids:
                    choice["token_ids"] = list(comp.token_ids)
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
                choices.append(choice)
            n_prompt += len(ids)
            n_cached += out.num_cached_tokens
        choices.sort(key=lambda c: c["index"])
        body = {"id": rid, "object": "text_completion", "created": created,
                "model": self.served_model_name, "choices": choices,
                "usage": usage(n_prompt, completion_tokens(finals), n_cached)}
        if finals and finals[0].kv_transfer_params is not None:
            body["kv_transfer_params"] = finals[0].kv_transfer_params  # vLLM's key
        return body

    async def stream_events(self, req: CompletionRequest, rid: str, created: int, prompts: list,
                            params: list[SamplingParams], first: tuple[int, RequestOutput],
                            stream: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
        include_usage, continuous = stream_usage(self.options, req.stream_options)
        as_ids = self.as_token_ids(req)
        n = params[0].n
        cursors: dict[int, StreamCursor] = {}
        finals: dict[int, RequestOutput] = {}
        head = {"id": rid, "object": "text_completion", "created": created,
                "model": self.served_model_name}

        def chunk(i: int, index: int, comp: CompletionOutput) -> str | None:
            cur = cursors.setdefault(index, StreamCursor())
            if cur.finished:
                return None  # this sample ended earlier; its siblings go on
            prefix = ""
            first_of_choice = not cur.started
            if not cur.started and req.echo:
                prefix = self._prompt_text(*prompts[i])
                cur.offset = len(prefix)
            cur.started = True
            delta, t0, t1 = cur.advance(comp, params[i].stop)
            if not (prefix or delta or t1 > t0 or cur.finished):
                return None
            lps = None
            if req.logprobs is not None:
                lps = completion_logprobs(comp, t0, t1, self.shown_logprobs(req, req.logprobs),
                                          cur.offset, as_ids)
                if prefix:
                    lps = echo_logprobs(self.tokenizer, out_of[i], req.logprobs, lps, as_ids)
            cur.offset += len(delta)
            choice = {"index": index, "text": prefix + delta, "logprobs": lps,
                      "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason}
            if req.return_token_ids:
                # Each chunk: the ids it adds; a choice's first chunk: the prompt's too.
                choice["token_ids"] = list(comp.token_ids[t0:t1])
                if first_of_choice:
                    choice["prompt_token_ids"] = list(out_of[i].prompt_token_ids)
            data = dict(head, choices=[choice])
            if continuous:
                data["usage"] = usage(len(prompts[i][1]), t1, 0)
            elif include_usage:
                data["usage"] = None
            return sse(data)

        try:
            item: tuple[int, RequestOutput] | None = first
            out_of: dict[int, RequestOutput] = {}
            while item is not None:
                i, out = item
                out_of[i] = out
                if out.finished:
                    finals[i] = out
                for index, comp in choice_outputs(out, n, i):
                    text = chunk(i, index, comp)
                    if text is not None:
                        yield text
                item = await anext(stream, None)
            if include_usage:
                outs = [finals[i] for i in range(len(prompts))]
                yield sse(dict(head, choices=[], usage=usage(
                    sum(len(o.prompt_token_ids) for o in outs), completion_tokens(outs),
                    sum(o.num_cached_tokens for o in outs))))
            yield SSE_DONE
        except Exception as e:  # noqa: BLE001 - headers are out: report in-band
            yield self.stream_error_event(e)
            yield SSE_DONE
        finally:
            await stream.aclose()
