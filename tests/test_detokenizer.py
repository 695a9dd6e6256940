"""Incremental detokenizer: UTF-8 split across tokens, sentencepiece spaces, stop strings."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from pagefold.engine.detokenizer import IncrementalDetokenizer  # noqa: E402

FFFD = "\ufffd"
TEXT = "héllo wörld ✓ 你好 🙂 naïve café, stop ### here 🙂🙂 done"
CORPUS = [
    "héllo wörld ✓ 你好 🙂",
    "hello world, this is a small test.",
    "the quick brown fox jumps over the lazy dog",
    "naïve café señor",
    "stop here ### and there",
] * 3


@pytest.fixture(scope="module")
def bytelevel() -> PreTrainedTokenizerFast:
    """Byte-level BPE small enough that non-ASCII characters span several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module")
def metaspace() -> PreTrainedTokenizerFast:
    """Llama-style sentencepiece BPE: "▁" for spaces, byte fallback, first space stripped."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    # Trained on ASCII only, so every non-ASCII character falls back to <0xNN> byte tokens.
    ascii_corpus = [s for s in CORPUS if s.isascii()]
    tok.train_from_iterator(
        ascii_corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"])
    )
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    base = len(vocab)
    vocab.update({f"<0x{b:02X}>": base + b for b in range(256)})
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _decode(tok, ids: list[int], skip: bool = True) -> str:
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def _stream(det: IncrementalDetokenizer, ids: list[int]):
    """Feed one token at a time; yield (index, returned stop, delta) after each."""
    for i, t in enumerate(ids):
        stop = det.update([t])
        yield i, stop, det.get_delta()


@pytest.mark.parametrize("prompt_text", ["", "hello world,"])
def test_bytelevel_every_prefix_matches_decode(bytelevel, prompt_text: str) -> None:
    prompt = bytelevel.encode(prompt_text) if prompt_text else []
    ids = bytelevel.encode(TEXT)
    det = IncrementalDetokenizer(bytelevel, prompt, skip_special_tokens=True, stop=[])
    streamed = ""
    incomplete_prefixes = 0
    for i, stop, delta in _stream(det, ids):
        assert stop is None
        streamed += delta
        assert FFFD not in det.output_text and FFFD not in streamed
        assert streamed == det.output_text  # no stop strings: nothing is held back
        full = _decode(bytelevel, ids[: i + 1])
        if full.endswith(FFFD):
            incomplete_prefixes += 1
            assert full.startswith(det.output_text)
        else:
            assert det.output_text == full
    assert incomplete_prefixes >= 5  # the tokenizer really splits characters across tokens
    assert det.output_text == TEXT and det.get_delta(finished=True) == ""
    assert det.token_ids == ids and det.num_output_tokens == len(ids)


def test_raw_tokenizers_object_and_batched_update(bytelevel) -> None:
    raw = bytelevel.backend_tokenizer
    ids = bytelevel.encode(TEXT)
    det = IncrementalDetokenizer(raw, [], skip_special_tokens=True, stop=[])
    assert det.update(ids) is None
    assert det.output_text == TEXT == det.get_delta()


def test_metaspace_leading_spaces_and_byte_fallback(metaspace) -> None:
    prompt_text = "hello world"
    prompt = metaspace.encode(prompt_text)
    full_ids = metaspace.encode(prompt_text + " " + TEXT)
    assert full_ids[: len(prompt)] == prompt
    out_ids = full_ids[len(prompt) :]
    prompt_decoded = _decode(metaspace, prompt)
    det = IncrementalDetokenizer(metaspace, prompt, skip_special_tokens=True, stop=[])
    streamed = ""
    incomplete_prefixes = 0
    for i, _, delta in _stream(det, out_ids):
        streamed += delta
        assert FFFD not in streamed
        full = _decode(metaspace, prompt + out_ids[: i + 1])
        if full.endswith(FFFD):
            incomplete_prefixes += 1
        else:
            assert prompt_decoded + det.output_text == full
    assert incomplete_prefixes >= 5
    # The first output token is "▁h": with the prompt as context its space is kept, whereas
    # decoding the output alone would strip it.
    assert det.output_text == " " + TEXT == streamed
    assert _decode(metaspace, out_ids) == TEXT


def test_metaspace_without_prompt(metaspace) -> None:
    ids = metaspace.encode(TEXT)
    det = IncrementalDetokenizer(metaspace, [], stop=[])
    for i, _, _ in _stream(det, ids):
        full = _decode(metaspace, ids[: i + 1])
        if not full.endswith(FFFD):
            assert det.output_text == full
    assert det.output_text == TEXT


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(bytelevel, skip: bool) -> None:
    eos = bytelevel.eos_token_id
    ids = bytelevel.encode("你好") + [eos] + bytelevel.encode(" done")
    det = IncrementalDetokenizer(bytelevel, [], skip_special_tokens=skip, stop=[])
    for _ in _stream(det, ids):
        pass
    assert det.output_text == ("你好 done" if skip else "你好<eos> done")
    assert det.output_text == _decode(bytelevel, ids, skip)


def test_flush_incomplete_character_at_finish(bytelevel) -> None:
    ids = bytelevel.encode("ok 🙂")
    cut = ids[:-1]  # the emoji's last byte never arrives (e.g. max_tokens)
    assert _decode(bytelevel, cut).endswith(FFFD)
    det = IncrementalDetokenizer(bytelevel, [], stop=[])
    det.update(cut)
    assert det.output_text == "ok " and det.get_delta() == "ok "
    tail = det.get_delta(finished=True)
    assert tail.startswith(FFFD)
    assert det.output_text == _decode(bytelevel, cut)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens(bytelevel, include: bool) -> None:
    stop = "lo wö"  # spans "llo", " w" and the two bytes of "ö"
    ids = bytelevel.encode(TEXT)
    pieces = [_decode(bytelevel, [t]) for t in ids]
    assert not any(stop in p for p in pieces)
    det = IncrementalDetokenizer(
        bytelevel, [], stop=["zzz", stop], include_stop_str_in_output=include
    )
    streamed, matched_at = "", None
    for i, got, delta in _stream(det, ids):
        streamed += delta
        if got is not None:
            matched_at = i
            break
        # Before the match, the tail that may start the stop string is never streamed.
        assert "hél".startswith(streamed)
    expected = "hél" + (stop if include else "")
    assert det.output_text == expected == streamed
    assert det.finished and det.stop_reason == stop
    # The match completes exactly when the token holding the last byte of "ö" arrives.
    assert _decode(bytelevel, ids[: matched_at + 1]).endswith("wö")
    assert stop not in _decode(bytelevel, ids[:matched_at])
    assert det.update(ids[matched_at + 1 :]) is None  # ignored after the stop
    assert det.num_output_tokens == matched_at + 1


def test_stop_string_in_multibyte_text_batched(bytelevel) -> None:
    ids = bytelevel.encode(TEXT)
    det = IncrementalDetokenizer(bytelevel, [], stop=["你好"])
    assert det.update(ids) == "你好"  # all tokens in one call (speculative decoding)
    assert det.output_text == "héllo wörld ✓ "
    assert det.get_delta() == "héllo wörld ✓ "
    assert _decode(bytelevel, det.token_ids).endswith("你好")


def test_earliest_stop_wins_and_text_after_is_cut(bytelevel) -> None:
    ids = bytelevel.encode("stop here ### and there")
    det = IncrementalDetokenizer(bytelevel, [], stop=["there", "here", "###"])
    det.update(ids)
    assert det.stop_reason == "here" and det.output_text == "stop "


class CharTokenizer:
    """A tokenizer whose tokens are given strings; ``decode`` joins them."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)


def test_streaming_holds_back_possible_stop_prefix() -> None:
    pieces = ["a", "#", "#x", "b", "##", "#!", "tail"]
    tok = CharTokenizer(pieces)
    det = IncrementalDetokenizer(tok, [], stop=["###"])
    deltas = []
    for t in [0, 1]:
        det.update([t])
        deltas.append(det.get_delta())
    assert deltas == ["a", ""]  # "#" could start "###": held back
    det.update([2])
    assert det.get_delta() == "##x"  # "##x" cannot become "###": released
    det.update([3, 4])
    assert det.get_delta() == "b"  # "##" held back
    assert det.update([5, 6]) == "###"
    assert det.get_delta() == "" and det.output_text == "a##xb"
    assert det.token_ids == [0, 1, 2, 3, 4, 5]


def test_held_back_tail_released_at_finish() -> None:
    tok = CharTokenizer(["hi ", "#", "#"])
    det = IncrementalDetokenizer(tok, [], stop=["###", "#!"], include_stop_str_in_output=True)
    det.update([0, 1, 2])
    assert det.get_delta() == "hi "
    assert det.get_delta(finished=True) == "##"
    assert det.output_text == "hi ##" and not det.finished


def test_include_stop_str_streaming() -> None:
    tok = CharTokenizer(["x", "<", "/s", ">", "y"])
    det = IncrementalDetokenizer(tok, [], stop=["</s>"], include_stop_str_in_output=True)
    streamed, matches = "", []
    for i, stop, delta in _stream(det, [0, 1, 2, 3, 4]):
        streamed += delta
        if stop:
            matches.append((i, stop))
    assert matches == [(3, "</s>")]  # token 4 arrives after the stop and is ignored
    assert streamed == det.output_text == "x</s>"


def test_empty_stop_string_rejected() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(CharTokenizer([]), [], stop=[""])


@pytest.mark.parametrize("skip", [True, False])
def test_backend_fast_path_equals_transformers_decode(bytelevel, metaspace, skip: bool) -> None:
    """A plain fast tokenizer is decoded through its ``tokenizers`` backend (no transformers
    per-call overhead); the text equals ``tokenizer.decode`` for any ids, special ones
    included. A subclass that overrides ``_decode`` keeps transformers' path."""
    import random

    from pagefold.engine.detokenizer import _make_decode, _plain_backend

    rng = random.Random(0)
    for tok in (bytelevel, metaspace):
        assert _plain_backend(tok) is tok._tokenizer
        decode = _make_decode(tok, skip)
        assert decode.__name__ == "decode_backend"
        for _ in range(200):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 12))]
            assert decode(ids) == tok.decode(ids, skip_special_tokens=skip,
                                             clean_up_tokenization_spaces=False)

    class Custom(PreTrainedTokenizerFast):
        def _decode(self, token_ids, **kwargs):  # noqa: ANN001, ANN202
            return "custom"

    custom = Custom(tokenizer_object=bytelevel._tokenizer)
    assert _plain_backend(custom) is None
    assert _make_decode(custom, skip)([5, 6]) == "custom"


@pytest.mark.parametrize("stops", [["b!", "ab"], ["ab", "b!"]])
def test_two_stops_completed_by_one_token_earliest_wins(stops: list[str]) -> None:
    """One token can complete two stop strings at once: the one that starts first cuts."""
    tok = CharTokenizer(["x", "ab!", "tail"])
    det = IncrementalDetokenizer(tok, [], stop=stops)
    assert det.update([0, 1, 2]) == "ab"
    assert det.output_text == "x" and det.token_ids == [0, 1]
