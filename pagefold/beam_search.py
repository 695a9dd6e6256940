"""Beam search over the engine, with vLLM's semantics and pagefold's forking.

Each step every live beam computes one token and returns its top ``2 * beam_width`` raw
logprobs. Candidates (beam + token) are ranked by ``cum_logprob / len ** length_penalty``
(``len`` counts the prompt, and not a final EOS); candidates ending in EOS move to the
completed list, the best ``beam_width`` others survive. A surviving candidate continues its
parent's engine request: the first child of a parent takes the parent's request over (its
newest token is swapped: it is not computed yet, so the cache is untouched), the others fork
it (attention blocks shared copy-on-write, states copied), and parents without survivors are
aborted on that step, returning their blocks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagefold.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagefold.engine.core import EngineCore


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_score(tokens: list[int], cum_logprob: float, eos: int | None, length_penalty: float):
    n = len(tokens) - (1 if eos is not None and tokens and tokens[-1] == eos else 0)
    return cum_logprob / (n**length_penalty)


@dataclass
class _Beam:
    engine_id: str
    seq: BeamSearchSequence


@dataclass
class _Instance:
    beams: list[_Beam]
    completed: list[BeamSearchSequence] = field(default_factory=list)


def beam_search(engine: EngineCore, tokenizer, prompts: list[list[int]],
                params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Beam search over ``engine`` (idle of other requests while it runs); ``tokenizer``
    (may be None) decodes the finished sequences' text."""
    eos = engine.eos_token_id
    bw = params.beam_width
    sp = SamplingParams(temperature=0, logprobs=2 * bw, max_tokens=params.max_tokens + 1,
                        ignore_eos=True, detokenize=False)
    ids = itertools.count()
    instances = []
    for p in prompts:
        rid = f"beam-{next(ids)}"
        engine.add_request(rid, p, sp)
        instances.append(_Instance([_Beam(rid, BeamSearchSequence(list(p)))]))
    try:
        with engine.single_steps():  # each beam's next token is read before the one after
            for _ in range(params.max_tokens):
                live = [b for inst in instances for b in inst.beams]
                if not live:
                    break
                cands = _step_until_all(engine, {b.engine_id for b in live})
                for inst in instances:
                    _select(engine, inst, cands, eos, bw, params, ids)
    finally:
        engine.abort([b.engine_id for inst in instances for b in inst.beams])
        engine.flush()
    tok = tokenizer
    outs = []
    for inst in instances:
        inst.completed.extend(b.seq for b in inst.beams)
        best = best_sequences(inst.completed, eos, bw, params.length_penalty)
        for s in best:
            s.text = tok.decode(s.tokens) if tok is not None else None
        outs.append(BeamSearchOutput(best))
    return outs


def _step_until_all(engine, waiting: set[str]) -> dict[str, tuple]:
    """Step the engine until every live beam produced its next token; returns candidates."""
    got: dict[str, tuple] = {}
    while waiting - got.keys():
        for out in engine.step():
            if out.request_id in waiting and out.new_logprobs:
                ids, lps, _ = out.new_logprobs[-1]
                got[out.request_id] = (dict(zip(ids, lps)), out.finish_reason)
                if out.finish_reason is None:
                    # Beams of other prompts may still be prefilling: hold this one until
                    # selection, so it cannot run ahead of the driver.
                    engine.set_paused(out.request_id, True)
    return got


def expand(beams: list[BeamSearchSequence], cands: list[tuple[dict[int, float], str | None]],
           eos: int | None, beam_width: int, ignore_eos: bool, length_penalty: float
           ) -> tuple[list[BeamSearchSequence], list[tuple[int, BeamSearchSequence]]]:
    """One beam step, shared by the offline driver and the server's (``openai/beam.py``).

    ``cands[i]`` is beam ``i``'s next-token candidates (token -> raw logprob, in the engine's
    order: the sampled token, then the top-k) and the finish reason of the step that made them.
    Returns ``(completed, survivors)``: candidates ending in EOS (unless ``ignore_eos``) or cut
    by the engine's length limit are completed; of the others the best ``beam_width`` by
    :func:`beam_score` survive as ``(parent index, sequence)``, best first (ties keep the
    candidates' order: parent order, then the engine's order).
    """
    completed: list[BeamSearchSequence] = []
    scored: list[tuple[int, BeamSearchSequence]] = []
    for i, (beam, (top, finish)) in enumerate(zip(beams, cands, strict=True)):
        for tok, lp in top.items():
            seq = BeamSearchSequence(beam.tokens + [tok], beam.cum_logprob + lp)
            if (tok == eos and not ignore_eos) or finish == "length":
                seq.finish_reason = "stop" if tok == eos and not ignore_eos else "length"
                completed.append(seq)
            else:
                scored.append((i, seq))
    scored.sort(key=lambda x: beam_score(x[1].tokens, x[1].cum_logprob, eos, length_penalty),
                reverse=True)
    return completed, scored[:beam_width]


def best_sequences(completed: list[BeamSearchSequence], eos: int | None, beam_width: int,
                   length_penalty: float) -> list[BeamSearchSequence]:
    """The final answer: the best ``beam_width`` of the completed and still-live beams."""
    return sorted(completed, reverse=True,
                  key=lambda s: beam_score(s.tokens, s.cum_logprob, eos, length_penalty)
                  )[:beam_width]


def _select(engine, inst: _Instance, cands, eos, bw: int, params: BeamSearchParams, ids) -> None:
    done, survivors = expand([b.seq for b in inst.beams],
                             [cands[b.engine_id] for b in inst.beams], eos, bw,
                             params.ignore_eos, params.length_penalty)
    inst.completed.extend(done)
    by_parent: dict[str, list[BeamSearchSequence]] = {}
    for parent, seq in survivors:
        by_parent.setdefault(inst.beams[parent].engine_id, []).append(seq)
    new_beams = []
    for beam in inst.beams:
        kids = by_parent.get(beam.engine_id)
        if not kids:
            engine.abort([beam.engine_id])  # a dead beam returns its blocks now
            continue
        for seq in kids[1:]:  # fork before the parent's newest token is swapped
            cid = f"beam-{next(ids)}"
            engine.fork_request(beam.engine_id, cid)
            engine.replace_last_token(cid, seq.tokens[-1])
            new_beams.append(_Beam(cid, seq))
        engine.replace_last_token(beam.engine_id, kids[0].tokens[-1])
        new_beams.append(_Beam(beam.engine_id, kids[0]))
    for b in new_beams:
        engine.set_paused(b.engine_id, False)
    inst.beams = new_beams
