"""Turns EngineCore token outputs into RequestOutputs: detokenize, stop strings, logprobs.

Runs on the API side (in the server's API process, or in-process for the offline LLM), so
detokenizing step n can overlap computing step n+1.

A request with ``n > 1`` (or ``best_of > n``) is a *family*: the core runs its children as
requests ``rid`` (index 0) and ``rid#i``; here each child has its own detokenizer, and the
family's RequestOutput lists them by index. With ``best_of``, the ``n`` children with the
highest cumulative logprob are returned once all have finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagefold.engine.core import EngineCoreOutput
from pagefold.engine.detokenizer import IncrementalDetokenizer
from pagefold.outputs import CompletionOutput, Logprob, RequestOutput
from pagefold.sampling_params import SamplingParams


def child_id(request_id: str, index: int) -> str:
    return request_id if index == 0 else f"{request_id}#{index}"


@dataclass
class SeqState:
    family: str
    index: int
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class Family:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SeqState]
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.families: dict[str, Family] = {}
        self._seqs: dict[str, SeqState] = {}  # engine request id -> its sequence

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        total = max(params.n, params.best_of or 1)
        seqs = []
        for i in range(total):
            detok = None
            if params.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                    params.include_stop_str_in_output)
            st = SeqState(request_id, i, detok,
                          logprobs=[] if params.logprobs is not None else None)
            seqs.append(st)
            self._seqs[child_id(request_id, i)] = st
        self.families[request_id] = Family(request_id, prompt, prompt_token_ids, params, seqs)

    def abort(self, request_id: str) -> None:
        fam = self.families.pop(request_id, None)
        if fam is not None:
            for s in fam.seqs:
                self._seqs.pop(child_id(request_id, s.index), None)

    def _decode_token(self, tok: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([tok])

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns (outputs for requests that made progress, engine ids the core must abort)."""
        touched: dict[str, Family] = {}
        to_abort = []
        for out in outputs:
            st = self._seqs.get(out.request_id)
            if st is None:
                continue  # aborted on this side already
            fam = self.families[st.family]
            fam.num_cached_tokens = max(fam.num_cached_tokens, out.num_cached_tokens)
            if out.prompt_logprobs is not None and fam.prompt_logprobs is None:
                fam.prompt_logprobs = [None] + [self._entry(*e) for e in out.prompt_logprobs]
            if out.kv_transfer_params is not None:
                fam.kv_transfer_params = out.kv_transfer_params
            if self._update(st, out):
                to_abort.append(out.request_id)
            touched[fam.request_id] = fam
        results = []
        for fam in touched.values():
            results.append(self._make_output(fam))
            if fam.finished:
                self.abort(fam.request_id)
        return results, to_abort

    def _entry(self, ids: list[int], lps: list[float], rank: int) -> dict[int, Logprob]:
        """A position's logprob dict: the chosen token (its true rank), then the top-k."""
        entry = {ids[0]: Logprob(lps[0], rank, self._decode_token(ids[0]))}
        for j in range(1, len(ids)):
            if ids[j] not in entry:
                entry[ids[j]] = Logprob(lps[j], j, self._decode_token(ids[j]))
        return entry

    def _update(self, st: SeqState, out: EngineCoreOutput) -> bool:
        """Apply one core output; True when a stop string ended a sequence the core still runs."""
        new_ids = out.new_token_ids
        stop_str = None
        if st.detok is not None:
            stop_str = st.detok.update(new_ids)
            if stop_str is not None:
                new_ids = new_ids[: st.detok.num_output_tokens - len(st.token_ids)]
        st.token_ids.extend(new_ids)
        for ids, lps, rank in out.new_logprobs[: len(new_ids)]:
            st.cumulative_logprob += lps[0]
            if st.logprobs is not None:
                entry = {ids[0]: Logprob(lps[0], rank, self._decode_token(ids[0]))}
                for j in range(1, len(ids)):
                    if ids[j] not in entry:
                        entry[ids[j]] = Logprob(lps[j], j, self._decode_token(ids[j]))
                st.logprobs.append(entry)
        if stop_str is not None:
            st.finish_reason, st.stop_reason = "stop", stop_str
            return out.finish_reason is None
        if out.finish_reason is not None:
            st.finish_reason, st.stop_reason = out.finish_reason, out.stop_reason
        return False

    def _completion(self, st: SeqState, index: int, with_cumulative: bool) -> CompletionOutput:
        if st.detok is not None and st.finish_reason is not None and st.stop_reason is None:
            st.detok.get_delta(finished=True)  # flush a trailing partial character
        text = st.detok.output_text if st.detok is not None else ""
        return CompletionOutput(
            index=index, text=text, token_ids=list(st.token_ids),
            cumulative_logprob=st.cumulative_logprob if with_cumulative else None,
            logprobs=list(st.logprobs) if st.logprobs is not None else None,
            finish_reason=st.finish_reason, stop_reason=st.stop_reason)

    def _make_output(self, fam: Family) -> RequestOutput:
        p = fam.params
        seqs = fam.seqs
        ranked = (p.best_of or 1) > p.n
        if ranked and fam.finished:
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: p.n]
        with_cum = ranked or p.logprobs is not None
        comps = [self._completion(s, i if ranked else s.index, with_cum)
                 for i, s in enumerate(seqs)]
        return RequestOutput(fam.request_id, fam.prompt, fam.prompt_token_ids, comps,
                             finished=fam.finished, num_cached_tokens=fam.num_cached_tokens,
                             prompt_logprobs=fam.prompt_logprobs,
                             kv_transfer_params=fam.kv_transfer_params)
