"""Incremental detokenization with stop strings, one instance per request.

Text is produced by decoding a short window of tokens twice -- once without and once with the
tokens not yet shown -- and keeping the difference (the prefix_offset / read_offset scheme):

* ``ids[prefix_offset:read_offset]`` is context that was already turned into text; decoding it
  along with the new tokens gives sentencepiece-style tokenizers the neighbour they need to
  render a leading ``"▁"`` as a space (decoded alone, a sequence's first space is stripped);
* when the window's text ends in U+FFFD, the new tokens end inside a multi-byte UTF-8
  character: nothing is emitted and the tokens wait for the rest of their bytes. Text already
  emitted is never revised.

Invariants (for a prompt that ends on a character boundary):

* ``output_text`` never contains a U+FFFD that comes from an incomplete character at the end;
* when no stop string matched, ``output_text`` equals the text that ``prompt + output`` decodes
  to minus the prompt's text (for byte-level BPE simply ``decode(output_ids)``) whenever the
  output ends on a character boundary;
* the concatenation of all :meth:`IncrementalDetokenizer.get_delta` results, the last one with
  ``finished=True``, equals the final ``output_text``.

Stop strings are searched only in the window where a match can end in the new text. A matched
stop string and everything after it are cut (the stop string itself is kept when
``include_stop_str_in_output``). While streaming, a tail of the text that could still be the
beginning of a stop string is held back from :meth:`get_delta`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

# Prompt tokens kept as decoding context for the first output tokens (as vLLM).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


def _make_decode(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """A ``decode(ids) -> str`` for a ``transformers`` tokenizer or a ``tokenizers.Tokenizer``.

    ``transformers`` tokenizers get ``clean_up_tokenization_spaces=False``: the clean-up
    rewrites text around punctuation depending on what follows, which would make the text of
    a window differ from the same text inside a longer window.
    """
    try:
        from transformers import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover - transformers is a hard dependency
        PreTrainedTokenizerBase = ()  # type: ignore[assignment,misc]  # noqa: N806
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        backend = _plain_backend(tokenizer)
        if backend is not None:
            # Same text as tokenizer.decode (checked below), without transformers' per-call
            # Python (argument conversion, kwargs): two decodes per token add up.
            def decode_backend(ids: list[int]) -> str:
                return backend.decode(ids, skip_special_tokens=skip_special_tokens)

            return decode_backend

        def decode_hf(ids: list[int]) -> str:
            return tokenizer.decode(
                ids,
                skip_special_tokens=skip_special_tokens,
                clean_up_tokenization_spaces=False,
            )

        return decode_hf

    def decode_raw(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    return decode_raw


def _plain_backend(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` behind a fast ``transformers`` tokenizer whose ``decode``
    (with ``clean_up_tokenization_spaces=False``) is exactly the backend's decode: its class
    overrides neither ``decode`` nor ``_decode``. ``None`` for anything else."""
    try:
        from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover
        return None
    cls = type(tokenizer)
    if (not isinstance(tokenizer, PreTrainedTokenizerFast)
            or cls.decode is not PreTrainedTokenizerBase.decode
            or cls._decode is not PreTrainedTokenizerFast._decode):
        return None
    return getattr(tokenizer, "_tokenizer", None)


class IncrementalDetokenizer:
    """Turns one request's output tokens into text as they arrive.

    Args:
        tokenizer: a ``transformers`` tokenizer or a ``tokenizers.Tokenizer``.
        prompt_token_ids: the prompt; only its last few tokens are kept, as context.
        skip_special_tokens: drop special tokens from the text.
        stop: stop strings (non-empty).
        include_stop_str_in_output: keep the matched stop string at the end of the text.

    Attributes:
        token_ids: output tokens consumed so far (tokens given after a stop match are not).
        finished: a stop string matched; later tokens are ignored.
        stop_reason: the stop string that matched, or ``None``.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._decode = _make_decode(tokenizer, skip_special_tokens)
        self.stop: list[str] = list(stop or [])
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # Window of tokens used for decoding: prompt context followed by all output tokens.
        # Only ``_ids[_prefix_offset:]`` is ever decoded, so old entries cost memory only.
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_context = len(context)

        self._text = ""  # decoded output text (cut at a stop match)
        self._sent = 0  # characters of ``_text`` already returned by get_delta
        self.finished = False
        self.stop_reason: str | None = None

    # ------------------------------------------------------------------ public API
    @property
    def token_ids(self) -> list[int]:
        return self._ids[self._num_context :]

    @property
    def num_output_tokens(self) -> int:
        return len(self._ids) - self._num_context

    @property
    def output_text(self) -> str:
        """The output text so far (without any pending incomplete character)."""
        return self._text

    def update(self, new_token_ids: Iterable[int]) -> str | None:
        """Append tokens; return the stop string that matched in this call, else ``None``.

        Tokens are consumed one at a time, so with several new tokens (speculative decoding)
        consumption stops right after the token that completed a stop string. After a match,
        further calls are ignored and return ``None``.
        """
        if self.finished:
            return None
        for tok in new_token_ids:
            self._ids.append(int(tok))
            delta = self._decode_new()
            if delta and self._append(delta):
                return self.stop_reason
        return None

    def get_delta(self, finished: bool = False) -> str:
        """New text since the previous call, for streaming.

        With ``finished=False`` a tail that could still grow into a stop string is held back.
        With ``finished=True`` (the request ends: EOS, length, abort) everything is released,
        including the bytes of a trailing incomplete character (rendered as the tokenizer
        renders them, usually U+FFFD), so that the text matches a one-shot decode.
        """
        if finished and not self.finished:
            self._flush()
        end = len(self._text)
        if not (finished or self.finished):
            end -= self._held_back()
        end = max(end, self._sent)
        delta = self._text[self._sent : end]
        self._sent = end
        return delta

    # ------------------------------------------------------------------ decoding
    def _decode_new(self) -> str:
        """Text added by the unread tokens, or ``""`` while they end mid-character."""
        window = self._ids[self._prefix_offset :]
        n_prefix = self._read_offset - self._prefix_offset
        prefix_text = self._decode(window[:n_prefix]) if n_prefix else ""
        new_text = self._decode(window)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            # Nothing new yet (e.g. a skipped special token) or an incomplete character.
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def _flush(self) -> None:
        """Emit unread tokens even if they end mid-character (the request is over)."""
        if self._read_offset == len(self._ids):
            return
        window = self._ids[self._prefix_offset :]
        n_prefix = self._read_offset - self._prefix_offset
        prefix_text = self._decode(window[:n_prefix]) if n_prefix else ""
        new_text = self._decode(window)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if len(new_text) > len(prefix_text):
            self._append(new_text[len(prefix_text) :])

    # ------------------------------------------------------------------ stop strings
    def _append(self, delta: str) -> bool:
        """Append decoded text and look for a stop string ending in it; True on a match."""
        old_len = len(self._text)
        self._text += delta
        if not self.stop:
            return False
        best: tuple[int, str] | None = None
        for s in self.stop:
            # A match not seen before must end in ``delta``: start the search there.
            start = max(0, old_len - len(s) + 1)
            idx = self._text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return False
        idx, s = best
        self._text = self._text[: idx + len(s) if self.include_stop_str_in_output else idx]
        self.finished = True
        self.stop_reason = s
        return True

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        held = 0
        text = self._text
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:n]):
                    held = n
                    break
        return held
