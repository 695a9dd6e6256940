"""Tokenization and detokenization off the event loop, with a cheap bound in front.

A 10 MB prompt takes seconds to tokenize; done on the event loop it stalls every other
request, ``/health`` included. Here:

* work runs in a small thread pool (:class:`TokenizerPool`); with a Rust ("fast") tokenizer
  the batch entry points (``encode_batch`` / ``decode_batch``) release the GIL for the whole
  call, so the loop keeps answering while a worker tokenizes;
* :meth:`TokenizerPool.check_fits` refuses a text that *cannot* fit ``max_model_len`` tokens
  before any tokenization: no token decodes to more than ``max_token_chars`` characters (the
  longest vocabulary entry), so a text of more than ``max_model_len * max_token_chars``
  characters has more than ``max_model_len`` tokens. (A normalizer that deletes characters
  could break the bound; the byte-level and sentencepiece tokenizers served here do not.)
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class TokenizerPool:
    """Runs tokenizer calls in ``workers`` threads; see the module docstring."""

    def __init__(self, tokenizer, *, workers: int = 2) -> None:
        self.tokenizer = tokenizer
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenize")
        self._backend = getattr(tokenizer, "_tokenizer", None)  # tokenizers.Tokenizer if fast
        self._max_token_chars: int | None = None

    @property
    def max_token_chars(self) -> int:
        """Most characters one token can stand for (longest vocabulary or added token)."""
        if self._max_token_chars is None:
            longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
            added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
            longest = max([longest] + [len(str(t)) for t in added.values()])
            self._max_token_chars = max(longest, 1)
        return self._max_token_chars

    def cannot_fit(self, num_chars: int, max_tokens: int) -> bool:
        """True when a text of ``num_chars`` characters surely has over ``max_tokens`` tokens."""
        return num_chars > max_tokens * self.max_token_chars

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    # ------------------------------------------------------------------ blocking forms
    def encode_sync(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._backend is not None and hasattr(self._backend, "encode_batch"):
            (enc,) = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
            return enc.ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode_sync(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if self._backend is not None and hasattr(self._backend, "decode_batch"):
            (text,) = self._backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)
            return text
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ async forms
    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.run(self.encode_sync, text, add_special_tokens)

    async def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return await self.run(self.decode_sync, ids, skip_special_tokens)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
