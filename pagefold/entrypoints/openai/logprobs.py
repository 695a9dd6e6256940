"""Logprobs in the OpenAI wire formats (completions' ``tokens`` / ``token_logprobs`` /
``top_logprobs`` / ``text_offset``, vLLM's ``prompt_logprobs``), shared by both endpoints.

Tokens are named by their text, or ``token_id:N`` with vLLM's ``return_tokens_as_token_ids``;
text offsets always count characters of the text.
"""

from __future__ import annotations

from pagefold.outputs import CompletionOutput, Logprob, RequestOutput

# Logprobs of -inf do not survive JSON; report them as this (as vLLM does).
_MIN_LOGPROB = -9999.0


def clamp_logprob(lp: float) -> float:
    return lp if lp > _MIN_LOGPROB else _MIN_LOGPROB


def ranked_ids(entry: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    """The ``n`` most likely of a position's logprob entries with their token ids, best
    first."""
    return sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:n]


def token_name(tid: int, text: str | None, as_ids: bool) -> str:
    """How a logprobs entry names its token: the text, or ``token_id:N`` (vLLM's
    ``return_tokens_as_token_ids``, for tokens whose text is not unique or not valid UTF-8)."""
    return f"token_id:{tid}" if as_ids else (text or "")


def prompt_logprobs_json(out: RequestOutput) -> list | None:
    """vLLM's ``prompt_logprobs`` field: per prompt token None or {id: {logprob, rank,
    decoded_token}}."""
    if out.prompt_logprobs is None:
        return None
    return [None if e is None else {
        str(t): {"logprob": clamp_logprob(x.logprob), "rank": x.rank,
                 "decoded_token": x.decoded_token}
        for t, x in e.items()} for e in out.prompt_logprobs]


def completion_logprobs(comp: CompletionOutput, t0: int, t1: int, num: int, offset: int,
                        as_ids: bool = False) -> dict:
    """Completions logprobs of output tokens ``t0:t1``; text offsets count characters
    of the text even when tokens are named by id (``as_ids``)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(comp.token_ids[t0:t1], (comp.logprobs or [])[t0:t1]):
        lp = entry[tid]
        s = lp.decoded_token or ""
        name = token_name(tid, s, as_ids)
        tokens.append(name)
        token_lps.append(clamp_logprob(lp.logprob))
        offsets.append(offset)
        offset += len(s)
        top = {token_name(t, x.decoded_token, as_ids): clamp_logprob(x.logprob)
               for t, x in ranked_ids(entry, num)}
        top.setdefault(name, clamp_logprob(lp.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def echo_logprobs(tokenizer, out: RequestOutput, num: int, after: dict | None,
                  as_ids: bool = False) -> dict:
    """Completions logprobs of the prompt (first token: None, as OpenAI), then ``after``
    (the output's, whose text offsets already start after the prompt)."""
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    for tid, entry in zip(out.prompt_token_ids, entries):
        s = tokenizer.decode([tid])
        tokens.append(token_name(tid, s, as_ids))
        offsets.append(offset)
        offset += len(s)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        lp = entry[tid]
        token_lps.append(clamp_logprob(lp.logprob))
        top = {token_name(t, x.decoded_token, as_ids): clamp_logprob(x.logprob)
               for t, x in ranked_ids(entry, num)}
        top.setdefault(tokens[-1], clamp_logprob(lp.logprob))
        tops.append(top)
    after = after or {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                      "text_offset": []}
    return {"tokens": tokens + after["tokens"],
            "token_logprobs": token_lps + after["token_logprobs"],
            "top_logprobs": tops + after["top_logprobs"],
            "text_offset": offsets + after["text_offset"]}
