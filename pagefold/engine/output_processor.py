"""Turns EngineCore token outputs into RequestOutputs: detokenize, stop strings, logprobs.

Runs on the API side (in the server's API process, or in-process for the offline LLM), so
detokenizing step n can overlap computing step n+1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagefold.engine.core import EngineCoreOutput
from pagefold.engine.detokenizer import IncrementalDetokenizer
from pagefold.outputs import CompletionOutput, Logprob, RequestOutput
from pagefold.sampling_params import SamplingParams


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        detok = None
        if params.detokenize and self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                params.include_stop_str_in_output)
        self.states[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, detok,
            logprobs=[] if params.logprobs is not None else None)

    def abort(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def _decode_token(self, tok: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([tok])

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns (outputs for requests that made progress, ids the core must abort)."""
        results, to_abort = [], []
        for out in outputs:
            st = self.states.get(out.request_id)
            if st is None:
                continue  # aborted on this side already
            st.num_cached_tokens = out.num_cached_tokens
            new_ids = out.new_token_ids
            stop_str = None
            if st.detok is not None:
                stop_str = st.detok.update(new_ids)
                if stop_str is not None:
                    new_ids = new_ids[: st.detok.num_output_tokens - len(st.token_ids)]
            st.token_ids.extend(new_ids)
            if st.logprobs is not None:
                for ids, lps, rank in out.new_logprobs[: len(new_ids)]:
                    entry = {ids[0]: Logprob(lps[0], rank, self._decode_token(ids[0]))}
                    for j in range(1, len(ids)):
                        if ids[j] not in entry:
                            entry[ids[j]] = Logprob(lps[j], j, self._decode_token(ids[j]))
                    st.logprobs.append(entry)
                    st.cumulative_logprob += lps[0]
            if stop_str is not None:
                st.finish_reason, st.stop_reason = "stop", stop_str
                if out.finish_reason is None:
                    to_abort.append(out.request_id)
            elif out.finish_reason is not None:
                st.finish_reason, st.stop_reason = out.finish_reason, out.stop_reason
            results.append(self._make_output(st))
            if st.finish_reason is not None:
                del self.states[out.request_id]
        return results, to_abort

    def _make_output(self, st: RequestState) -> RequestOutput:
        text = st.detok.output_text if st.detok is not None else ""
        if st.detok is not None and st.finish_reason is not None and st.stop_reason is None:
            st.detok.get_delta(finished=True)  # flush a trailing partial character
            text = st.detok.output_text
        comp = CompletionOutput(
            index=0, text=text, token_ids=list(st.token_ids),
            cumulative_logprob=st.cumulative_logprob if st.logprobs is not None else None,
            logprobs=list(st.logprobs) if st.logprobs is not None else None,
            finish_reason=st.finish_reason, stop_reason=st.stop_reason)
        return RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, [comp],
                             finished=st.finish_reason is not None,
                             num_cached_tokens=st.num_cached_tokens)
