"""The scheduler's structured-output paths without a model (issue 44: mutmut's survivors in
``Scheduler.schedule`` / ``update_from_output``). A real ``Scheduler`` and a real
``StructuredOutputManager`` whose grammar is a stand-in: the compiler turns a regex such as
``"5 40"`` into the token sequence ``(5, 40)``, and the matcher accepts exactly that sequence,
then is terminated, recording every call. Each expected bitmask row is worked out by hand:
vocabulary 64, so a row is two little-endian int32 words, token ``t`` is bit ``t % 32`` of
word ``t // 32``; the manager's stop token is 33 and the requests' EOS is 2."""

from __future__ import annotations

import struct

import pytest
import torch
import xgrammar

from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import FullAttentionSpec
from pagefold.core.sched_output import SampledToken
from pagefold.core.scheduler import Scheduler
from pagefold.request import Request, RequestStatus
from pagefold.sampling_params import SamplingParams
from pagefold.structured_output import manager as manager_mod
from pagefold.structured_output.manager import StructuredOutputManager
from pagefold.structured_output.params import StructuredOutputsParams

BS = 4
ATTN = FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32)
VOCAB, STOP, EOS = 64, 33, 2


def row(word0: int, word1: int) -> bytes:
    return struct.pack("<2i", word0, word1)


class StandInCompiler:
    """The compile step of a regex of token ids: ``"5 40"`` -> ``(5, 40)``."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size

    def compile(self, params: StructuredOutputsParams) -> tuple[int, ...]:
        return tuple(int(t) for t in params.regex.split())


class StandInMatcher:
    """Accepts its grammar's tokens in order, then is terminated; ``calls`` records every
    question asked of it, ``made`` every matcher created."""

    made: list[StandInMatcher] = []

    def __init__(self, grammar, override_stop_tokens=None, max_rollback_tokens=0) -> None:
        self.grammar, self.stops, self.pos = grammar, override_stop_tokens, 0
        self.calls: list[tuple] = []
        StandInMatcher.made.append(self)

    def accept_token(self, t: int) -> bool:
        self.calls.append(("accept", t))
        ok = self.pos < len(self.grammar) and self.grammar[self.pos] == t
        self.pos += ok
        return ok

    def is_terminated(self) -> bool:
        self.calls.append(("terminated",))
        return self.pos == len(self.grammar)

    def fill_next_token_bitmask(self, mask: torch.Tensor, i: int) -> None:
        self.calls.append(("fill", i))
        t = self.grammar[self.pos]
        mask[i].zero_()
        mask[i, t // 32] |= 1 << (t % 32)


@pytest.fixture
def sched(monkeypatch):
    StandInMatcher.made = []
    monkeypatch.setattr(manager_mod, "GrammarCompiler", StandInCompiler)
    monkeypatch.setattr(xgrammar, "GrammarMatcher", StandInMatcher)

    def make(budget: int = 64) -> Scheduler:
        kv = KVCacheManager(plan_pagefold({"a": ATTN}, BS, 33 * ATTN.page_bytes(BS)),
                            enable_prefix_caching=False)
        s = Scheduler(kv, max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=64)
        s.structured = StructuredOutputManager(lambda: None, VOCAB, [STOP])
        return s
    return make


def _req(rid: str, prompt, grammar: str | None = None) -> Request:
    so = StructuredOutputsParams(regex=grammar) if grammar is not None else None
    return Request(rid, list(prompt), SamplingParams(max_tokens=8, structured_outputs=so),
                   eos_token_id=EOS)


def test_a_constrained_request_walks_its_grammar_to_the_stop_row(sched):
    """Steps 1 and 2 allow only the grammar's next token (5: word 0 bit 5 = 32; 40: word 1 bit
    8 = 256), each sampled token advances the matcher, the finished grammar allows only the
    stop token and EOS (bits 33 and 2: words 4 and 2), and EOS ends the request and its
    matcher. The unconstrained request gets no row and no matcher."""
    s = sched()
    s.add_request(_req("g", range(3), "5 40"))
    s.add_request(_req("u", range(10, 13)))
    rows = []
    for tok in (5, 40, EOS):
        out = s.schedule()
        rows.append(out.grammar_bitmask)
        assert s.structured.num_matchers == 1
        outs = s.update_from_output(out, {"g": SampledToken(tok), "u": SampledToken(9)})
    assert rows == [{"g": row(32, 0)}, {"g": row(0, 256)}, {"g": row(4, 2)}]
    (m,) = StandInMatcher.made
    assert m.grammar == (5, 40) and m.stops == [EOS, STOP]
    assert m.calls == [("terminated",), ("fill", 0), ("terminated",), ("accept", 5),
                       ("terminated",), ("fill", 0), ("terminated",), ("accept", 40),
                       ("terminated",), ("terminated",)]
    assert [(o.request_id, o.finish_reason) for o in outs] == [("g", "stop"), ("u", None)]
    assert "g" not in s.requests and s.structured.num_matchers == 0


def test_only_a_step_that_samples_gets_a_row(sched):
    """Budget 4. ``b``'s prompt of 6 comes in while ``a`` decodes: its first chunk (3 tokens)
    samples nothing, so no row and no matcher; the second (3 tokens) reaches the prompt's end
    and gets its first token's row (40: word 1 bit 8). The row index is the request's place
    among the step's constrained samplers (1: after ``a``, whose grammar is finished)."""
    s = sched(budget=4)
    s.add_request(_req("a", range(3), "7 8"))
    out = s.schedule()
    assert out.num_scheduled == {"a": 3} and out.grammar_bitmask == {"a": row(128, 0)}
    s.update_from_output(out, {"a": SampledToken(7)})
    s.add_request(_req("b", range(20, 26), "40"))
    out = s.schedule()
    assert out.num_scheduled == {"a": 1, "b": 3} and out.grammar_bitmask == {"a": row(256, 0)}
    assert len(StandInMatcher.made) == 1
    s.update_from_output(out, {"a": SampledToken(8)})
    out = s.schedule()
    assert out.num_scheduled == {"a": 1, "b": 3}
    assert out.grammar_bitmask == {"a": row(4, 2), "b": row(0, 256)}
    assert StandInMatcher.made[1].calls == [("terminated",), ("fill", 1)]


def test_no_constrained_request_no_bitmask(sched):
    s = sched()
    s.add_request(_req("u", range(3)))
    out = s.schedule()
    assert out.grammar_bitmask == {} and StandInMatcher.made == []
    s.update_from_output(out, {"u": SampledToken(9)})
    assert s.requests["u"].output_token_ids == [9] and StandInMatcher.made == []


def test_an_aborted_request_loses_its_matcher_at_the_next_applied_step(sched):
    """Two constrained requests; ``a`` is aborted between steps: the next applied step keeps
    only ``b``'s matcher, which goes on accepting ``b``'s tokens."""
    s = sched()
    s.add_request(_req("a", range(3), "5 6"))
    s.add_request(_req("b", range(10, 13), "9 10"))
    out = s.schedule()
    assert out.grammar_bitmask == {"a": row(32, 0), "b": row(512, 0)}
    s.update_from_output(out, {"a": SampledToken(5), "b": SampledToken(9)})
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert s.structured.num_matchers == 2
    out = s.schedule()
    assert out.grammar_bitmask == {"b": row(1024, 0)}
    s.update_from_output(out, {"b": SampledToken(10)})
    assert s.structured.num_matchers == 1
    a, b = StandInMatcher.made
    assert [c for c in a.calls if c[0] == "accept"] == [("accept", 5)]
    assert [c for c in b.calls if c[0] == "accept"] == [("accept", 9), ("accept", 10)]
