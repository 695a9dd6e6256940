"""Beam search for ``/v1/completions`` and ``/v1/chat/completions`` (``use_beam_search``),
driven from the API process.

The engine core runs in another process behind :class:`AsyncEngineClient`, so the offline
driver's forking (``pagefold/beam_search.py``) is not available here. As vLLM's server does,
each step sends one engine request per live beam: its prompt is the original prompt plus the
beam's tokens so far, ``max_tokens=1``, temperature 0, ``logprobs = 2 * beam_width``, no
detokenization. Prefix caching makes the shared prefixes cheap (each step recomputes only the
newest tokens of a beam). Candidates are ranked and selected by the *same* functions as the
offline driver (:func:`pagefold.beam_search.expand` / :func:`best_sequences`), so the server's
beams equal ``LLM.beam_search`` on the same model and prompts.

Semantics (vLLM's): beam width = ``n``; a candidate ending in EOS is completed (unless
``ignore_eos``); after ``max_tokens`` steps the live beams join the completed ones and the best
``n`` by ``cum_logprob / len ** length_penalty`` are the choices, best first. A choice's
``token_ids`` include a final EOS; its text leaves the EOS out unless
``include_stop_str_in_output``. ``finish_reason`` is ``stop`` (EOS) or ``length``.

Invariants: every engine request the driver starts finishes (``max_tokens=1``) or is aborted
when the driver is cancelled (client disconnect) or fails, so no request outlives the HTTP
request. Scores use the raw logprobs whatever the request's ``temperature`` (vLLM's too; its
only effect there is that a randomly sampled token may join the candidates, which pagefold does
not do: steps are greedy, the argmax is among the top ``2n`` anyway). Sampling-only fields
(``top_p``, penalties, ...) do not apply to beam search and are ignored, as vLLM does; fields
whose output beam search cannot produce here (``logprobs``, ``prompt_logprobs``, ``best_of``,
output constraints) are refused with a 400 naming them (:func:`check_beam_request`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable

from pagefold.beam_search import BeamSearchSequence, best_sequences, expand
from pagefold.engine.client import AsyncEngineClient, EngineDeadError, RequestRejectedError
from pagefold.entrypoints.openai.engine_calls import engine_error, race_disconnect
from pagefold.entrypoints.openai.errors import bad_request
from pagefold.entrypoints.openai.memory import json_response
from pagefold.entrypoints.openai.options import log_request
from pagefold.entrypoints.openai.protocol import (
    AbortingStreamingResponse,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
)
from pagefold.outputs import CompletionOutput, RequestOutput
from pagefold.sampling_params import SamplingParams

# Fields whose output a beam-search answer does not carry here: 400 instead of ignoring them.
_NOT_WITH_BEAMS = ("logprobs", "prompt_logprobs", "best_of", "response_format",
                   "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                   "guided_grammar", "logprob_token_ids", "top_logprobs")


def check_beam_request(req: SamplingRequest, max_logprobs: int) -> None:
    """400 naming the field for what beam search cannot honour (see the module docstring)."""
    n = 1 if req.n is None else req.n
    if n < 1:
        raise bad_request(f"n must be at least 1 (the beam width), got {n}", "n")
    if 2 * n > max_logprobs:
        # Each step asks the engine for the top 2n logprobs of every beam.
        raise bad_request(f"n={n} with use_beam_search needs 2n={2 * n} logprobs per step; "
                          f"this server allows {max_logprobs} (--max-logprobs)", "n")
    for name in _NOT_WITH_BEAMS:
        value = getattr(req, name, None)
        if value not in (None, False) and not (name == "best_of" and value == n) and not (
                name == "response_format" and getattr(value, "type", None) == "text"):
            raise bad_request(f"{name} cannot be combined with use_beam_search on pagefold",
                              name)


async def _one_step(client: AsyncEngineClient, rid: str, tokens: list[int],
                    sp: SamplingParams, priority: int, cache_salt: str | None) -> RequestOutput:
    last = None
    async for out in client.generate(None, tokens, sp, request_id=rid, priority=priority,
                                     cache_salt=cache_salt):
        last = out
    assert last is not None and last.finished
    return last


async def run_beam_search(
        client: AsyncEngineClient, decode: Callable[[list[int]], Awaitable[str]],
        prompts: list[list[int]], *, beam_width: int, max_tokens: list[int], ignore_eos: bool,
        length_penalty: float, include_stop_str_in_output: bool, base_id: str,
        priority: int = 0, cache_salt: str | None = None) -> list[RequestOutput]:
    """Beam search of every prompt (stepped together: one engine batch per step); one
    finished :class:`RequestOutput` per prompt with ``outputs[k]`` = the k-th best beam;
    prompt ``i`` takes at most ``max_tokens[i]`` steps."""
    eos = client.info.eos_token_id
    step_params = SamplingParams(temperature=0.0, logprobs=2 * beam_width, max_tokens=1,
                                 ignore_eos=True, detokenize=False)
    ids = itertools.count()
    live: list[list[BeamSearchSequence]] = [[BeamSearchSequence(list(p))] for p in prompts]
    completed: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    cached = [0] * len(prompts)
    for step in range(max(max_tokens)):
        for i in range(len(prompts)):
            if step == max_tokens[i]:  # this prompt's beams are done: they join the completed
                completed[i].extend(live[i])
                live[i] = []
        jobs = [(i, j) for i, beams in enumerate(live) for j in range(len(beams))]
        if not jobs:
            break
        tasks = {(i, j): asyncio.ensure_future(_one_step(
            client, f"{base_id}-{i}-{next(ids)}", live[i][j].tokens, step_params, priority,
            cache_salt)) for i, j in jobs}
        try:
            await asyncio.gather(*tasks.values())
        finally:
            # One step failed or this coroutine was cancelled (client gone): cancel the
            # others; each cancelled generate() aborts its engine request.
            for t in tasks.values():
                t.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        for i, beams in enumerate(live):
            if not beams:
                continue
            cands: list[tuple[dict[int, float], str | None]] = []
            for j in range(len(beams)):
                out = tasks[(i, j)].result()
                if step == 0:
                    cached[i] = out.num_cached_tokens
                entry = out.outputs[0].logprobs[-1]
                # The step's "length" finish is its max_tokens=1, not the beam's end: the
                # beam's own length was checked against the context before starting.
                cands.append(({t: lp.logprob for t, lp in entry.items()}, None))
            done, survivors = expand(beams, cands, eos, beam_width, ignore_eos, length_penalty)
            completed[i].extend(done)
            live[i] = [seq for _, seq in survivors]
    results = []
    for i, prompt in enumerate(prompts):
        best = best_sequences(completed[i] + live[i], eos, beam_width, length_penalty)
        outs = []
        for k, seq in enumerate(best):
            gen = seq.tokens[len(prompt):]
            stopped = seq.finish_reason == "stop"
            shown = gen[:-1] if stopped and not include_stop_str_in_output else gen
            outs.append(CompletionOutput(
                index=k, text=await decode(shown), token_ids=gen,
                cumulative_logprob=seq.cum_logprob,
                finish_reason="stop" if stopped else "length"))
        results.append(RequestOutput(f"{base_id}-{i}", None, list(prompt), outs, finished=True,
                                     num_cached_tokens=cached[i]))
    return results


async def _finals(serving, raw, req, prompts: list, params: list, base: str
                  ) -> list[RequestOutput]:
    """Run the beam search of every prompt, cancelled if the client disconnects."""
    check_beam_request(req, serving.client.config.max_logprobs)
    if req.cache_salt is not None and not req.cache_salt:
        raise bad_request("cache_salt must be a non-empty string", "cache_salt")
    serving.client.check_alive()
    for i, ((text, ids), sp) in enumerate(zip(prompts, params)):
        log_request(serving.options, f"{base}-{i}", text, ids, sp)
    run = run_beam_search(
        serving.client, serving.tokens.decode, [ids for _, ids in prompts],
        beam_width=params[0].n, max_tokens=[sp.max_tokens for sp in params],
        ignore_eos=req.ignore_eos, length_penalty=req.length_penalty,
        include_stop_str_in_output=req.include_stop_str_in_output, base_id=base,
        priority=req.priority, cache_salt=req.cache_salt)
    try:
        return await race_disconnect(raw, run)
    except (RequestRejectedError, EngineDeadError) as e:
        raise engine_error(e) from None


async def _after(finals: list[RequestOutput]):
    for item in enumerate(finals[1:], 1):
        yield item


async def beam_completion(serving, raw, req: CompletionRequest, prompts: list, params: list,
                          base: str, created: int):
    """The ``/v1/completions`` answer of a ``use_beam_search`` request: JSON, or, streamed,
    each choice whole in one chunk (its beams are only known at the end, as vLLM streams
    them) followed by usage when asked and ``[DONE]``."""

    finals = await _finals(serving, raw, req, prompts, params, base)
    if not req.stream:
        return json_response(serving.response_json(req, base, created, prompts, params[0].n,
                                                   finals))
    body = serving.stream_events(req, base, created, prompts, params, (0, finals[0]),
                                 _after(finals))
    return AbortingStreamingResponse(body, media_type="text/event-stream")


async def beam_chat(serving, raw, req: ChatCompletionRequest, prompt: tuple, params,
                    rid: str, created: int, mode: str):
    """The ``/v1/chat/completions`` answer of a ``use_beam_search`` request (as completions:
    the choices are the best beams; streamed, each whole in one chunk)."""

    if params.structured_outputs is not None:  # a tool_choice that forces a grammar
        raise bad_request("tool_choice required / named cannot be combined with "
                          "use_beam_search", "tool_choice")
    (final,) = await _finals(serving, raw, req, [prompt], [params], rid)
    if not req.stream:
        return json_response(serving.response_json(req, rid, created, final, mode))
    body = serving.stream_events(req, rid, created, params, (0, final), _after([final]), mode)
    return AbortingStreamingResponse(body, media_type="text/event-stream")
