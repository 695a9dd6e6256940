"""Beam search against references that share nothing with pagefold's (issue 44).

* A reference beam search written here, over transformers' float32 logits, following vLLM's
  documented rules: each live beam offers its top ``2 * beam_width`` tokens; a candidate ending
  in EOS (unless ``ignore_eos``) or reaching ``max_model_len`` is completed; the others are
  ranked by ``cumulative logprob / length ** length_penalty`` (the length counts the prompt
  and not a final EOS) and the best ``beam_width`` live on; the answer is the best
  ``beam_width`` of the completed and live beams. Same beams, same order, same scores.
* transformers' own ``generate(num_beams=...)`` where the two define the same search: EOS
  never special (``ignore_eos`` / ``eos_token_id=None``), so every beam has the same length at
  every step and the length penalty cannot reorder them.
* Ties, EOS and length-capped candidates on hand-made candidate lists, where ties are exact.

Nothing here imports pagefold's scoring: a wrong length normalisation changes only one side.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagefold import LLM, BeamSearchParams
from pagefold.beam_search import BeamSearchSequence, best_sequences, expand
from pagefold.testing.oracle import load_hf_model
from pagefold.testing.tiny_models import random_prompts

EOS = 2  # <|eos|> of the tiny models
# Prompts 13 and 15 reach EOS within 12 tokens on the tiny qwen3, prompt 0 does not.
PROMPTS = [random_prompts(40, 4, 12, 512, seed=3)[i] for i in (13, 15, 0)]
STEPS = 8


def _score(tokens: list[int], cum: float, length_penalty: float) -> float:
    n = len(tokens) - (1 if tokens[-1] == EOS else 0)
    return cum / n**length_penalty


def _ref_beam_search(model, prompt, width, steps, *, length_penalty=1.0, ignore_eos=False,
                     max_model_len=10**9):
    """``[(tokens, cum_logprob, finish_reason)]``, best first."""
    beams, done = [(list(prompt), 0.0)], []
    for _ in range(steps):
        if not beams:
            break
        live = []
        for toks, cum in beams:
            with torch.no_grad():
                logits = model(torch.tensor([toks])).logits[0, -1].float()
            top = torch.topk(torch.log_softmax(logits, -1), 2 * width)
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                seq = (toks + [t], cum + v)
                if t == EOS and not ignore_eos:
                    done.append((*seq, "stop"))
                elif len(seq[0]) >= max_model_len:
                    done.append((*seq, "length"))
                else:
                    live.append(seq)
        live.sort(key=lambda s: _score(s[0], s[1], length_penalty), reverse=True)
        beams = live[:width]
    done += [(*b, None) for b in beams]
    done.sort(key=lambda s: _score(s[0], s[1], length_penalty), reverse=True)
    return done[:width]


@pytest.fixture(scope="module")
def qwen3(qwen3_dir):
    return qwen3_dir, LLM(str(qwen3_dir), max_model_len=256, kv_cache_memory="8MiB",
                          warm_up=False), load_hf_model(qwen3_dir)


def _check(got, want):
    assert [(s.tokens, s.finish_reason) for s in got] == [(t, f) for t, _, f in want]
    for s, (_, cum, _) in zip(got, want):
        assert s.cum_logprob == pytest.approx(cum, abs=2e-4)


@pytest.mark.parametrize("width,length_penalty,ignore_eos", [
    (2, 1.0, False), (3, 1.0, False), (3, 2.0, False), (3, 3.0, False), (2, 1.0, True)])
def test_offline_beam_search_equals_the_reference(qwen3, width, length_penalty, ignore_eos):
    _, llm, model = qwen3
    params = BeamSearchParams(beam_width=width, max_tokens=STEPS, ignore_eos=ignore_eos,
                              length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    finishes = set()
    for p, o in zip(PROMPTS, outs):
        want = _ref_beam_search(model, p, width, STEPS, length_penalty=length_penalty,
                                ignore_eos=ignore_eos)
        _check(o.sequences, want)
        finishes |= {f for _, _, f in want}
    # Both endings occur, so the EOS path is exercised (or never, with ignore_eos); a strong
    # length penalty favours the long live beams over these prompts' early EOS.
    assert finishes == ({None} if ignore_eos or length_penalty > 2 else {"stop", None})
    llm.engine.kv.check_whole()


def test_the_length_penalties_above_are_different_searches(qwen3):
    """Else a driver that ignores ``length_penalty`` would pass the test above."""
    _, _, model = qwen3
    runs = [[[t for t, _, _ in _ref_beam_search(model, p, 3, STEPS, length_penalty=lp)]
             for p in PROMPTS] for lp in (1.0, 2.0, 3.0)]
    assert runs[0] != runs[1] and runs[1] != runs[2] and runs[0] != runs[2]


def test_length_capped_beams_end_with_length(qwen3_dir):
    """max_model_len a few tokens past the prompt: candidates that reach it are completed
    with finish reason ``length``, exactly as the reference cuts them."""
    model = load_hf_model(qwen3_dir)
    p = PROMPTS[2]
    cap = len(p) + 5
    llm = LLM(str(qwen3_dir), max_model_len=cap, kv_cache_memory="8MiB", warm_up=False)
    (o,) = llm.beam_search([{"prompt_token_ids": p}],
                           BeamSearchParams(beam_width=3, max_tokens=12))
    want = _ref_beam_search(model, p, 3, 12, max_model_len=cap)
    _check(o.sequences, want)
    assert {f for _, _, f in want} == {"length"}
    assert all(len(s.tokens) == cap for s in o.sequences)
    llm.engine.kv.check_whole()


@pytest.mark.parametrize("width,length_penalty,prompts", [
    (3, 0.0, PROMPTS[0::2]), (4, 0.0, PROMPTS[0::2]), (2, 1.0, PROMPTS[0::2]),
    (3, 1.7, PROMPTS[0::2])])
def test_equals_transformers_generate_without_eos(qwen3, width, length_penalty, prompts):
    """transformers' beam search with no EOS: same beams, order and scores (its sequence
    score is the cumulative logprob over ``generated ** length_penalty``). The two searches
    agree while no candidate ends in token EOS: vLLM's score still shortens such a sequence
    by one even with ``ignore_eos``, and transformers stops generating early on PROMPTS[1]
    (whose best beams repeat token 2) even with ``eos_token_id=None``; that prompt is left
    to the reference above."""
    from transformers import GenerationConfig

    _, llm, model = qwen3
    steps = 6
    params = BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True,
                              length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    # A fresh config: the model's own names EOS ids, which would end beams early.
    config = GenerationConfig(num_beams=width, num_return_sequences=width, do_sample=False,
                              max_new_tokens=steps, length_penalty=length_penalty,
                              early_stopping=False, pad_token_id=0, eos_token_id=None,
                              bos_token_id=None, output_scores=True,
                              return_dict_in_generate=True)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            hf = model.generate(torch.tensor([p]), generation_config=config)
        assert [s.tokens for s in o.sequences] == hf.sequences.tolist()
        cums = [float(x) * steps**length_penalty for x in hf.sequences_scores]
        for s, c in zip(o.sequences, cums):
            assert s.cum_logprob == pytest.approx(c, abs=2e-4)


# ----------------------------------------------------------------------------- hand-made steps
def _seq(tokens, cum):
    return BeamSearchSequence(list(tokens), cum)


def test_ties_keep_parent_then_candidate_order():
    """Exact ties: Python's stable sort, as vLLM's ``sorted``; parent order first, then each
    parent's candidate order (sampled token first, then top-k)."""
    beams = [_seq([9, 9, 1], -1.0), _seq([9, 9, 2], -1.0)]
    cands = [({10: -0.5, 11: -0.5, EOS: -0.1, 12: -2.0}, None),
             ({13: -0.5, 14: -0.25, 15: -0.5}, None)]
    done, live = expand(beams, cands, EOS, 3, False, 1.0)
    # Reference: cumulative -1.5 ties four ways; -1.25 is best; EOS completes (not ranked).
    assert [(p, s.tokens[-1], s.cum_logprob) for p, s in live] == [
        (1, 14, -1.25), (0, 10, -1.5), (0, 11, -1.5)]
    assert [(s.tokens, s.finish_reason) for s in done] == [([9, 9, 1, EOS], "stop")]
    # The completed EOS beam's length excludes the EOS: -1.1 / 3 against -1.25 / 4.
    final = best_sequences(done + [s for _, s in live], EOS, 2, 1.0)
    want = sorted([(-1.1 / 3, EOS), (-1.25 / 4, 14), (-1.5 / 4, 10), (-1.5 / 4, 11)],
                  reverse=True)
    assert [s.tokens[-1] for s in final] == [t for _, t in want[:2]] == [14, EOS]


@pytest.mark.parametrize("length_penalty", [0.0, 0.5, 1.0, 3.0])
def test_eos_length_excludes_the_eos_at_every_penalty(length_penalty):
    """A finished beam [p, a, EOS] (cum -2.0) against a live [p, b, c] (cum -2.4): vLLM
    scores the first over 2 tokens, the second over 3."""
    fin = _seq([5, 6, EOS], -2.0)
    fin.finish_reason = "stop"
    live = _seq([5, 7, 8], -2.4)
    got = best_sequences([live, fin], EOS, 1, length_penalty)
    a, b = -2.0 / 2**length_penalty, -2.4 / 3**length_penalty
    assert got[0] is (fin if a > b else live)
    assert not math.isclose(a, b)


def test_length_finish_completes_and_eos_under_ignore_eos_lives():
    beams = [_seq([1, 2], -0.5)]
    done, live = expand(beams, [({EOS: -0.1, 3: -0.2}, "length")], EOS, 2, False, 1.0)
    assert [(s.tokens[-1], s.finish_reason) for s in done] == [(EOS, "stop"), (3, "length")]
    assert live == []
    done, live = expand(beams, [({EOS: -0.1, 3: -0.2}, None)], EOS, 2, True, 1.0)
    # With ignore_eos an EOS-ended sequence lives on, and its EOS is still left out of its
    # length (vLLM scores by the last token, not by how the beam ended): -0.6 / 2 ranks
    # below -0.7 / 3.
    assert done == [] and [s.tokens[-1] for _, s in live] == [3, EOS]
    assert -0.7 / 3 > -0.6 / 2
