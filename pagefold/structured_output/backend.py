"""Compiling constraints with xgrammar, cached per constraint."""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict

from pagefold.structured_output.params import StructuredOutputsParams

logger = logging.getLogger("pagefold")

# Compiled grammars kept (a JSON schema compiles in milliseconds to a second; reuse is common).
CACHE_SIZE = 256


def _ebnf_literal(s: str) -> str:
    """``s`` as an EBNF string literal (JSON escaping is what xgrammar's EBNF reads)."""
    return json.dumps(s, ensure_ascii=False)


class GrammarCompiler:
    """Compiles :class:`StructuredOutputsParams` against one vocabulary.

    ``tokenizer``: the model's Hugging Face tokenizer; ``vocab_size``: the model's logits
    width (may exceed the tokenizer's length: padded rows are never allowed).
    ``num_compiles`` counts real compilations (cache misses), for tests.

    Thread-safe: the cache is guarded by a lock, which is not held while xgrammar compiles
    (it releases the GIL), so cached constraints stay available to the step loop meanwhile.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0
        self._json_safe = None

    def is_cached(self, params: StructuredOutputsParams) -> bool:
        with self._lock:
            return params.key() in self._cache

    def json_safe_mask(self):
        """Packed int32 bitmask ``(ceil(V/32),)`` of tokens without raw control characters
        (bytes 0x00-0x1f). xgrammar's JSON string rule admits them, but JSON parsers (Python's
        ``json.loads``) refuse them; compact JSON never needs one (escapes are ``\\n``...)."""
        if self._json_safe is None:
            import torch

            width = (self.vocab_size + 31) // 32
            bits = torch.ones(width * 32, dtype=torch.int64)
            for i, b in enumerate(self.info.decoded_vocab[:self.vocab_size]):
                if any(c < 0x20 for c in b):
                    bits[i] = 0
            bits[self.vocab_size:] = 0
            weights = torch.tensor([1 << k for k in range(32)], dtype=torch.int64)
            packed = (bits.view(width, 32) * weights).sum(1)
            self._json_safe = torch.where(packed >= 1 << 31, packed - (1 << 32),
                                          packed).to(torch.int32)
        return self._json_safe

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of ``params`` (cached). Raises ValueError naming the field
        and xgrammar's reason when it cannot be compiled."""
        key = params.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        kind, value, compact = key
        c = self._compiler
        try:
            if kind == "json":
                ws = dict(any_whitespace=False) if compact else {}
                compiled = c.compile_json_schema(value, strict_mode=True, **ws)
            elif kind == "json_object":
                if compact:
                    compiled = c.compile_json_schema(
                        json.dumps({"type": "object"}), any_whitespace=False, strict_mode=False)
                else:
                    compiled = c.compile_builtin_json_grammar()
            elif kind == "regex":
                compiled = c.compile_regex(value)
            elif kind == "choice":
                alts = " | ".join(_ebnf_literal(s) for s in json.loads(value))
                compiled = c.compile_grammar(f"root ::= {alts}")
            elif kind == "grammar":
                compiled = c.compile_grammar(value)
            else:  # structural_tag
                compiled = c.compile_structural_tag(value)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/...
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            reason = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", reason)  # xgrammar's log prefix
            raise ValueError(f"structured output ({kind}) cannot be compiled: {reason}") from None
        with self._lock:
            self.num_compiles += 1
            self._cache[key] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled
