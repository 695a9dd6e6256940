"""Per-request sampling parameters (vLLM/OpenAI-compatible names and defaults).

A ``SamplingParams`` is validated once, at construction: every later stage (scheduler, sampler,
detokenizer) may rely on these invariants after ``__post_init__``:

* ``stop`` is a ``list[str]`` of non-empty strings, ``stop_token_ids`` a ``list[int]``;
* ``top_k`` is ``0`` when top-k is off (``-1`` is accepted on input and mapped to ``0``);
* ``temperature``, ``top_p``, ``min_p`` and the penalties are Python ``float``;
* ``best_of`` is an ``int >= n`` (``None`` on input means ``n``);
* ``min_tokens <= max_tokens`` when ``max_tokens`` is set.

Errors are ``ValueError`` whose message names the field, the bad value and the allowed range,
so an API layer can forward the message to the client unchanged.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

from pagefold.structured_output.params import StructuredOutputsParams

# Temperatures below this are treated as greedy (argmax), as in vLLM.
SAMPLING_EPS = 1e-5
# The most top-logprobs a request may ask for (OpenAI's limit).
MAX_LOGPROBS = 20
# Seeds are 64-bit signed (a child of a parallel-sampling family uses seed + index).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1 - 4096
# Token ids travel as signed 64-bit integers.
TOKEN_ID_MAX = 2**63 - 1


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """How to sample the output tokens of one request.

    Attributes:
        n: number of output sequences returned.
        best_of: number of sequences generated, of which the ``n`` best are returned
            (``None`` = ``n``).
        temperature: softmax temperature; ``< 1e-5`` means greedy.
        top_p: nucleus sampling mass in ``(0, 1]``; 1 = off.
        top_k: keep the ``k`` most likely tokens; ``0`` (or ``-1`` on input) = off.
        min_p: drop tokens whose probability is below ``min_p * max_prob``; 0 = off.
        seed: per-request seed; the same seed gives the same tokens whatever the batch.
        presence_penalty: subtracted once from the logit of each token already in the output.
        frequency_penalty: subtracted per occurrence in the output.
        repetition_penalty: divides positive / multiplies negative logits of tokens seen in the
            prompt or the output; 1 = off.
        stop: strings that end generation; the match is cut from the text unless
            ``include_stop_str_in_output``.
        stop_token_ids: token ids that end generation (in addition to EOS).
        ignore_eos: keep generating after EOS.
        max_tokens: most output tokens (``None`` = up to the model's context length).
        min_tokens: EOS and ``stop_token_ids`` are banned until this many tokens are produced.
        logprobs: number of top logprobs returned per output token (plus the sampled one).
        prompt_logprobs: number of top logprobs returned per prompt token.
        logprob_token_ids: the logprobs of these token ids (and the sampled one) are
            returned per output token, instead of the top ``logprobs`` (vLLM's field; their
            entries rank by position among them).
        prompt_logprobs_temperature: the prompt logprobs are of ``softmax(logits / t)``
            (``> 0``; 1 = the raw distribution), as vLLM's field.
        skip_special_tokens: drop special tokens from the detokenized text.
        detokenize: produce text at all (token ids only when False).
        structured_outputs: constrain the output (JSON schema, regex, choice, grammar); see
            :mod:`pagefold.structured_output`.
        logit_bias: token id -> value added to its logit (clamped to [-100, 100]) before
            sampling.
        allowed_token_ids: only these tokens may be sampled.
        bad_words: words never generated: the last token of a word is banned whenever the
            tokens before it were just generated. Needs ``bad_words_token_ids`` (filled from
            a tokenizer by :meth:`update_from_tokenizer`; the LLM and the server do it).
        truncate_prompt_tokens: keep only the last ``k`` prompt tokens (``-1``: the last
            ``max_model_len - 1``); applied where the prompt is tokenized.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_temperature: float = 1.0
    logprob_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    truncate_prompt_tokens: int | None = None
    # vLLM's extra_args: free-form per-request arguments; "kv_transfer_params" (prefill/decode
    # disaggregation, see pagefold.transfer) is the one the engine reads.
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self._normalize()
        self._validate()

    # ------------------------------------------------------------------ normalisation
    def _normalize(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if not _is_number(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
            try:
                value = float(value)
            except OverflowError:
                raise ValueError(f"{name} must be a finite number, got {value!r}") from None
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
            setattr(self, name, value)

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        self._check_int("n", self.n, allow_none=False)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        self._check_int("best_of", self.best_of, allow_none=True)
        if self.best_of is None:
            self.best_of = self.n
        elif self.best_of < self.n:
            raise ValueError(
                f"best_of must be greater than or equal to n ({self.n}), got {self.best_of}"
            )
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self._check_int("top_k", self.top_k, allow_none=False)
        if self.top_k < 0:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain only non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative ints, got {t!r}")
            if t > TOKEN_ID_MAX:
                raise ValueError(f"stop_token_ids must be at most {TOKEN_ID_MAX}, got {t}")
        self._check_int("max_tokens", self.max_tokens, allow_none=True)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        self._check_int("min_tokens", self.min_tokens, allow_none=False)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        t = self.prompt_logprobs_temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t < float("inf"):
            raise ValueError(f"prompt_logprobs_temperature must be a number > 0, got {t!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            self._check_int(name, value, allow_none=True)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        self._validate_token_controls()

    def _validate_token_controls(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.logit_bias is not None:
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    tid = int(k)
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
                if tid < 0 or not _is_number(v):
                    raise ValueError(f"logit_bias must map token ids >= 0 to numbers, got "
                                     f"{k!r}: {v!r}")
                bias[tid] = max(-100.0, min(100.0, float(v)))
            self.logit_bias = bias or None
        if self.logprob_token_ids is not None:
            ids = list(dict.fromkeys(self.logprob_token_ids))  # order kept, repeats dropped
            if not ids or not all(_is_int(t) and 0 <= t <= TOKEN_ID_MAX for t in ids):
                raise ValueError("logprob_token_ids must be a non-empty list of token ids >= 0, "
                                 f"got {self.logprob_token_ids!r}")
            self.logprob_token_ids = ids
        if self.allowed_token_ids is not None:
            ids = list(self.allowed_token_ids)
            if not ids or not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids >= 0, "
                                 f"got {self.allowed_token_ids!r}")
            self.allowed_token_ids = ids
        if self.bad_words is not None:
            if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be non-empty strings, got {self.bad_words!r}")
            self.bad_words = list(self.bad_words)
        if self.truncate_prompt_tokens is not None:
            t = self.truncate_prompt_tokens
            if not _is_int(t) or (t < 1 and t != -1):
                raise ValueError(f"truncate_prompt_tokens must be -1 or >= 1, got {t!r}")

    @staticmethod
    def _check_int(name: str, value: object, *, allow_none: bool) -> None:
        if value is None and allow_none:
            return
        if not _is_int(value):
            kind = "an int or None" if allow_none else "an int"
            raise ValueError(f"{name} must be {kind}, got {value!r}")

    # ------------------------------------------------------------------ helpers
    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax token (temperature below 1e-5)."""
        return self.temperature < SAMPLING_EPS

    @property
    def uses_penalties(self) -> bool:
        """True when any of presence / frequency / repetition penalty is active."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def all_stop_token_ids(self, eos_token_id: int | None) -> set[int]:
        """Token ids that finish this request: ``stop_token_ids`` plus EOS unless ignored."""
        ids = set(self.stop_token_ids)
        if eos_token_id is not None and not self.ignore_eos:
            ids.add(eos_token_id)
        return ids

    def update_from_tokenizer(self, tokenizer) -> None:
        """Fill ``bad_words_token_ids`` from ``bad_words`` (each word as written and with a
        leading space, as it tokenizes mid-text)."""
        if not self.bad_words or self.bad_words_token_ids is not None:
            return
        seqs: list[list[int]] = []
        for word in self.bad_words:
            for text in (word, " " + word.lstrip()):
                ids = list(tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in seqs:
                    seqs.append(ids)
        self.bad_words_token_ids = seqs

    @property
    def uses_token_controls(self) -> bool:
        """True when logit_bias, allowed_token_ids or bad words change the logits."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    def clone(self) -> SamplingParams:
        """A deep copy (lists are not shared), e.g. for the ``n`` children of a request."""
        return copy.deepcopy(self)
