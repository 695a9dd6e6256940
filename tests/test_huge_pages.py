"""Weights on transparent huge pages: same values, same parameter objects, tied weights still
one tensor, on a mapping the kernel may back with 2 MiB pages; an engine run with every
weight moved gives the tokens and logprobs of a run without."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagefold import LLM, SamplingParams
from pagefold.executor import huge_pages, model_runner
from pagefold.testing.tiny_models import random_prompts


def _smaps_entry(ptr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding address ``ptr``."""
    entry, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = lo <= ptr < hi
        elif inside:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
    return entry


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[")[1].split("]")[0]


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Linear(1024, 768, bias=False)  # 3 MiB float32
        self.emb = torch.nn.Embedding(1000, 600)  # 2.3 MiB
        self.head = torch.nn.Linear(600, 1000, bias=False)
        self.head.weight = self.emb.weight
        self.small = torch.nn.Linear(8, 8)


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux only")
def test_large_weights_move_values_and_ties_kept(monkeypatch):
    monkeypatch.delenv("PAGEFOLD_HUGE_PAGES", raising=False)
    m = _Tied()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    objects = {n: p for n, p in m.named_parameters()}
    small_ptr = m.small.weight.data_ptr()
    moved = huge_pages.weights_on_huge_pages(m)
    assert moved >= (1024 * 768 + 1000 * 600) * 4
    for n, p in m.named_parameters():
        assert p is objects[n] and torch.equal(p, before[n]), n
    assert m.head.weight is m.emb.weight
    assert m.small.weight.data_ptr() == small_ptr  # under min_bytes: untouched
    ptr = m.big.weight.data_ptr()
    assert ptr != before["big.weight"].data_ptr()
    assert abs(m.emb.weight.data_ptr() - ptr) < moved  # one arena
    smaps = _smaps_entry(ptr)
    assert smaps, "the weight's mapping is not in /proc/self/smaps"
    if _thp_mode() in ("always", "madvise") and "THPeligible" in smaps:
        assert smaps["THPeligible"] == "1"
    out = m.big(torch.ones(2, 1024))
    assert torch.equal(out, torch.ones(2, 1024) @ before["big.weight"].T)


def test_opt_out(monkeypatch):
    monkeypatch.setenv("PAGEFOLD_HUGE_PAGES", "0")
    m = _Tied()
    ptr = m.big.weight.data_ptr()
    assert huge_pages.weights_on_huge_pages(m) == 0
    assert m.big.weight.data_ptr() == ptr


def test_engine_tokens_unchanged_with_every_weight_moved(tiny_model_factory, monkeypatch):
    """Tiny weights are under the 2 MiB floor: lowered to 1 byte so every weight moves."""
    model = str(tiny_model_factory("qwen3_5"))
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 5, 30, 400, seed=2)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    moved = []

    def everything(model):
        moved.append(huge_pages.weights_on_huge_pages(model, min_bytes=1))
        return moved[-1]

    def run():
        llm = LLM(model, dtype="bfloat16", max_model_len=128, kv_cache_memory="8MiB")
        outs = llm.generate(prompts, sp, use_tqdm=False)
        llm.engine.kv.check_whole()
        return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs])
                for o in outs]

    monkeypatch.setenv("PAGEFOLD_HUGE_PAGES", "0")
    plain = run()
    monkeypatch.setenv("PAGEFOLD_HUGE_PAGES", "1")
    monkeypatch.setattr(model_runner, "weights_on_huge_pages", everything)
    moved_run = run()
    assert moved and moved[-1] > 0
    assert moved_run == plain


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux only")
def test_cache_bytes_zeroed_on_huge_pages(monkeypatch):
    monkeypatch.delenv("PAGEFOLD_HUGE_PAGES", raising=False)
    t = huge_pages.zeros(8, 1 << 20)
    assert t.shape == (8, 1 << 20) and t.dtype == torch.uint8 and not t.any()
    smaps = _smaps_entry(t.data_ptr())
    if _thp_mode() in ("always", "madvise") and "THPeligible" in smaps:
        assert smaps["THPeligible"] == "1"
    monkeypatch.setenv("PAGEFOLD_HUGE_PAGES", "0")
    small = huge_pages.zeros(8, 1 << 20)
    assert not small.any() and small.shape == (8, 1 << 20)
