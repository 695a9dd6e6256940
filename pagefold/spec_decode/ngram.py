"""N-gram (prompt lookup) proposer: drafts the tokens that followed the last occurrence of the
sequence's own suffix.

For a sequence ``x[0..L-1]`` the proposer looks for the longest ``n`` in
``[prompt_lookup_min, prompt_lookup_max]`` such that the suffix ``x[L-n..L-1]`` also occurs
earlier, ending at some ``e < L-1``; among the occurrences of that longest ``n`` it takes the
most recent one and drafts ``x[e+1 .. e+k]`` (fewer when the context ends first). No match:
no draft. Drafts are a deterministic function of the tokens, so the draft distribution is
one-hot (what rejection sampling needs to know).

Cost: one vectorised comparison to find the earlier positions equal to the last token, then
``prompt_lookup_max - 1`` vectorised comparisons over those candidates only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["NgramProposer", "ngram_propose", "ngram_propose_naive"]


def ngram_propose(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Draft up to ``k`` tokens for one sequence (int64 array, possibly empty)."""
    length = tokens.shape[0]
    if k <= 0 or length < min_n + 1:
        return tokens[:0]
    # Candidate ends: earlier positions holding the last token (the suffix's last element).
    cand = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    if cand.size == 0:
        return tokens[:0]
    alive = np.ones(cand.shape[0], dtype=bool)
    match = np.ones(cand.shape[0], dtype=np.int64)  # matched suffix length per candidate
    for m in range(1, max_n):
        if length - 1 - m < 0:
            break
        prev = cand - m
        ok = prev >= 0
        ok[ok] = tokens[prev[ok]] == tokens[length - 1 - m]
        alive &= ok
        if not alive.any():
            break
        match += alive
    best = int(match.max())
    if best < min_n:
        return tokens[:0]
    end = int(cand[np.flatnonzero(match == best)[-1]])
    return tokens[end + 1 : min(end + 1 + k, length)]


def ngram_propose_naive(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, as plain loops; the reference :func:`ngram_propose` is tested against."""
    t = list(tokens)
    n_len = len(t)
    for n in range(min(max_n, n_len - 1), min_n - 1, -1):
        suffix = t[n_len - n:]
        for e in range(n_len - 2, n - 2, -1):  # most recent earlier end first
            if t[e - n + 1 : e + 1] == suffix:
                return t[e + 1 : e + 1 + k]
    return []


class NgramProposer:
    """Batched wrapper: one draft per sequence, from its full token history."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, histories: Sequence[np.ndarray | Sequence[int]],
                max_tokens: Sequence[int] | None = None) -> list[list[int]]:
        """Per sequence, up to ``min(k, max_tokens[i])`` drafted token ids."""
        out: list[list[int]] = []
        for i, h in enumerate(histories):
            k = self.k if max_tokens is None else min(self.k, max_tokens[i])
            arr = h if isinstance(h, np.ndarray) else np.asarray(h, dtype=np.int64)
            out.append(ngram_propose(arr, k, self.min_n, self.max_n).tolist())
        return out
