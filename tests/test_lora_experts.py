"""LoRA on routed MoE experts (PEFT ``target_parameters`` on the stacked ``gate_up_proj`` /
``down_proj``; Jamba shares Qwen's ``MoEExperts`` and was checked the same way by hand; gpt-oss
has its own interleaved, biased stacks, bf16 or MXFP4): a batch mixing the base model and two
or three adapters gives, per row, the greedy float32 tokens of transformers + peft with that
adapter; the prefix cache stays keyed by adapter; bad expert adapters are clear errors; the
expert-level terms equal a per-row definition (each routed row with its own token's adapter,
base rows untouched).

The oracle is peft itself (``pagefold.testing.lora_adapters``); the per-row definition below
merges ``W_e + B_e @ A_e`` per token, as PEFT's ``ParamWrapper`` does for a whole batch.
"""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from pagefold import LLM, LoRARequest, SamplingParams
from pagefold.distributed.parallel_state import set_tensor_parallel
from pagefold.layers.linear import load_into
from pagefold.layers.lora_experts import ExpertsLayout, LoRAExperts
from pagefold.layers.lora_linear import LoRAStep
from pagefold.layers.moe import MoEExperts
from pagefold.lora.layout import experts_layouts, lora_layout
from pagefold.models.gpt_oss import GptOssExperts
from pagefold.testing.lora_adapters import make_adapter, peft_greedy

pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="peft not installed")

NEW = 5
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
# (rank, target_modules, target_parameters): experts + attention, experts only, and (where
# listed) a third mixing one expert product with the model's linears (Qwen3-Next: PEFT
# itself turns the v4 names gate_proj / up_proj / down_proj into the expert stacks'
# parameters, gate_up at rank 2r through rank_pattern / alpha_pattern).
THIRD = {
    "qwen3_next": (4, ["gate_proj", "up_proj", "down_proj", "in_proj_qkvz"], None),
    "qwen3_5_moe": (16, ["gate_proj", "down_proj", "in_proj_qkv"], ["experts.down_proj"]),
    # Granite-4.0-H: its own expert class (``GraniteMoE``), transformers' ``experts`` below it.
    "granitemoehybrid": (16, ["in_proj", "q_proj", "input_linear"], ["experts.down_proj"]),
}
PROMPTS = [[5, 17, 42, 9, 77, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [100, 200, 300],
           [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]]


@pytest.fixture(scope="module")
def adapters(tiny_model_factory, tmp_path_factory):
    """arch -> (base dir, [adapter dirs]) built once per module."""
    root = tmp_path_factory.mktemp("lora_experts")
    made = {}

    def get(arch: str):
        if arch not in made:
            base = tiny_model_factory(arch)
            specs = [(8, ["q_proj", "o_proj"], EXPERTS), (4, [], EXPERTS)]
            specs += [THIRD[arch]] if arch in THIRD else []
            made[arch] = (base, [make_adapter(base, root / f"{arch}-{i}", rank=r,
                                              target_modules=t, target_parameters=p,
                                              seed=20 + i)
                                 for i, (r, t, p) in enumerate(specs)])
        return made[arch]

    return get


_oracle: dict[tuple, list[int]] = {}


def _peft(adapter_dir, base, prompt) -> list[int]:
    """peft's greedy tokens, each (adapter, prompt) decoded once per module."""
    key = (str(adapter_dir), str(base), tuple(prompt))
    if key not in _oracle:
        _oracle[key] = peft_greedy(adapter_dir, base, [prompt], NEW)[0]
    return _oracle[key]


def _requests(dirs) -> list[LoRARequest]:
    return [LoRARequest(f"adapter{i}", i + 1, str(d)) for i, d in enumerate(dirs)]


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe", "granitemoehybrid", "gpt_oss"])
def test_expert_adapters_mixed_batch_match_peft(adapters, arch):
    base, dirs = adapters(arch)
    loras = [None, *_requests(dirs)]
    want = [_peft(d, base, p) for d, p in zip([None, *dirs], PROMPTS)]
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16,
              kv_cache_memory=1 << 23, max_num_batched_tokens=23, warm_up=False)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:len(loras)]]
    outs = llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    assert _ids(outs) == want
    llm.engine.kv.check_whole()
    assert llm.engine.runner.lora.loads == len(dirs)
    # Every adapter matters (its rows are not the base model's; base rows checked above).
    plain = _ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert plain[0] == want[0] and all(p != w for p, w in zip(plain[1:], want[1:]))


@pytest.fixture(scope="module")
def mxfp4_lora(tiny_model_factory, tmp_path_factory):
    """gpt-oss whose experts are stored MXFP4 (``tests/test_mxfp4.py``'s checkpoint, 4 experts
    so that two expert-parallel ranks hold 2 each), two expert adapters made on its dequantized
    twin, and peft's tokens for the base row and each adapter's row: (MXFP4 dir, dirs, want)."""
    from tests.test_mxfp4 import CONFIG, write_mxfp4

    root = tmp_path_factory.mktemp("lora_mxfp4")
    q, ref = root / "q", root / "ref"
    write_mxfp4(tiny_model_factory("gpt_oss", **CONFIG, num_local_experts=4), q, ref)
    dirs = [make_adapter(ref, root / f"a{i}", rank=r, target_modules=t,
                         target_parameters=EXPERTS, seed=30 + i)
            for i, (r, t) in enumerate([(8, ["q_proj", "o_proj"]), (4, [])])]
    return q, dirs, [_peft(d, ref, p) for d, p in zip([None, *dirs], PROMPTS)]


def test_mxfp4_expert_adapters_mixed_batch_match_peft(mxfp4_lora):
    """MXFP4 experts: their products stay the MXFP4 kernel's and each adapter row adds its
    terms; a batch of the base model and two adapters gives, per row, transformers + peft's
    tokens with that adapter on the same experts dequantized (the quantized model's own
    function)."""
    q, dirs, want = mxfp4_lora
    llm = LLM(str(q), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              kv_cache_memory=1 << 23, max_num_batched_tokens=23, warm_up=False)
    experts = llm.engine.model.model.layers[0].mlp.experts
    assert experts.gate_up_proj is None and experts.down_proj_blocks.dtype == torch.uint8
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    outs = llm.generate(prompts, GREEDY, lora_request=[None, *_requests(dirs)], use_tqdm=False)
    assert _ids(outs) == want
    assert experts.lora is not None and llm.engine.runner.lora.loads == 2
    plain = _ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert plain[0] == want[0] and all(p != w for p, w in zip(plain[1:], want[1:]))


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
def test_mxfp4_expert_adapters_two_ranks_match_peft(mxfp4_lora, ep):
    """The same MXFP4 batch under two ranks: tensor parallelism (each rank its gate/up block
    rows and down blocks of 32 of the 64 intermediate channels, the adapters' B / A cut to
    match, the down term a partial sum) or expert parallelism (each rank 2 whole experts and
    their adapters); the tokens are still peft's (the one-process oracle, reused)."""
    q, dirs, want = mxfp4_lora
    llm = LLM(str(q), dtype="float32", tensor_parallel_size=2, enable_expert_parallel=ep,
              enable_lora=True, max_loras=2, max_lora_rank=8, kv_cache_memory=1 << 22,
              max_num_batched_tokens=23, threads_per_rank=1, warm_up=False)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], GREEDY,
                            lora_request=[None, *_requests(dirs)], use_tqdm=False)
        assert _ids(outs) == want
        llm.engine.kv.check_whole()
    finally:
        llm.engine.shutdown()


def test_expert_adapters_prefix_cache_keyed_by_adapter(adapters):
    """One prompt (a full block and more) under two expert adapters and the base model,
    twice: no hit across adapters in the first round (blocks and GDN state checkpoints are
    per adapter), each its own prefix in the second with the same tokens; the first
    adapter's are peft's (the mixed-batch test's oracle run, reused)."""
    base, dirs = adapters("qwen3_5_moe")
    prompt = PROMPTS[3]
    reqs = _requests(dirs)
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              kv_cache_memory=1 << 23, warm_up=False)
    got = []
    for rnd in range(2):
        for lora in (reqs[2], reqs[1], None):
            out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, lora_request=lora,
                               use_tqdm=False)[0]
            got.append(out.outputs[0].token_ids)
            assert out.num_cached_tokens == (0 if rnd == 0 else 16)
            llm.engine.kv.check_whole()
    assert got[:3] == got[3:] and len({tuple(g) for g in got[:3]}) == 3
    assert got[0] == _peft(dirs[2], base, prompt)


def _rewrite(src, dst, edit) -> None:
    """Copy adapter ``src`` to ``dst`` with ``edit(key, tensor) -> tensor`` on its tensors."""
    shutil.copytree(src, dst)
    f = dst / "adapter_model.safetensors"
    save_file({k: edit(k, t).contiguous() for k, t in load_file(str(f)).items()}, str(f))


def test_bad_expert_adapters_name_the_problem(adapters, llama_dir, tmp_path):
    base, dirs = adapters("qwen3_next")
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8,
              kv_cache_memory=1 << 22, warm_up=False)
    prompt = [{"prompt_token_ids": PROMPTS[0]}]

    def refused(path, match, lora_id, on=llm):
        with pytest.raises(ValueError, match=match):
            on.generate(prompt, GREEDY, lora_request=LoRARequest(f"bad{lora_id}", lora_id,
                                                                  str(path)))

    # Three experts' pairs where the model has four (rank 4: A (12, in), B (out, 12)).
    refused_dir = tmp_path / "count"
    _rewrite(dirs[1], refused_dir,
             lambda k, t: t[:12] if ".lora_A." in k else t[:, :12])
    refused(refused_dir, r"'bad1' does not fit the base model at "
            r"model\.layers\.\d\.mlp\.experts\.(gate_up|down)_proj.*hold 3 experts of rank 4, "
            r"the model has 4 experts", 1)
    # Expert inputs of another width (down_proj's A: 30 columns, the experts' width is 32).
    width = tmp_path / "width"
    _rewrite(dirs[1], width, lambda k, t: t[:, :30] if k.endswith("experts.lora_A.weight")
             else t)
    refused(width, r"'bad2' does not fit.*experts\.down_proj.*takes 32 inputs", 2)
    # A target parameter that is not a routed expert product.
    other = tmp_path / "other"
    shutil.copytree(dirs[1], other)
    cfg = json.loads((other / "adapter_config.json").read_text())
    cfg["target_parameters"] = ["experts.gate_up_proj", "experts.gate_up_proj_bias"]
    (other / "adapter_config.json").write_text(json.dumps(cfg))
    refused(other, r"'bad3'.*target parameters \['experts\.gate_up_proj_bias'\] are not "
            r"supported", 3)
    # transformers 4's per-expert linears' tensors (not PEFT's stacked-expert format).
    v4 = tmp_path / "v4"
    _rewrite(dirs[1], v4, lambda k, t: t)
    tensors = load_file(str(v4 / "adapter_model.safetensors"))
    save_file({k.replace(".mlp.experts.", ".mlp.experts.0.down_proj.", 1)
               .replace(".base_layer.", ".", 1): t for k, t in tensors.items()},
              str(v4 / "adapter_model.safetensors"))
    refused(v4, r"'bad5': per-expert LoRA tensors \(model\.layers\.\d\.mlp\.experts\.0\.down_proj"
            r".*not served", 5)
    llm.engine.kv.check_whole()
    # Expert targets on a model without experts.
    dense = LLM(str(llama_dir), dtype="float32", enable_lora=True, max_loras=1,
                max_lora_rank=8, kv_cache_memory=1 << 22, warm_up=False)
    refused(dirs[1], r"'bad4'.*model\.layers\.0\.mlp\.experts'?: this model has no routed "
            r"expert stack there to adapt \(experts quantized per expert take no adapters; "
            r"expert stacks: none\)", 4, on=dense)


def _definition(x, gu, dn, top_idx, top_w, slot_of_row, pairs):
    """Per token: its experts with ``W_e + B_e A_e`` of its own adapter (none for -1)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    inter = dn.shape[2]
    for i in range(x.shape[0]):
        s = int(slot_of_row[i])
        for j in range(top_idx.shape[1]):
            e = int(top_idx[i, j])
            w_gu, w_dn = gu[e].double(), dn[e].double()
            if s >= 0:
                (a1, b1), (a2, b2) = pairs[s]
                w_gu = w_gu + b1[e].double() @ a1[e].double()
                w_dn = w_dn + b2[e].double() @ a2[e].double()
            h = w_gu @ x[i].double()
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[i] += float(top_w[i, j]) * (w_dn @ act)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_terms_follow_each_rows_adapter(dtype):
    """MoEExperts with two resident adapters (different ranks) and base rows: every token's
    routed rows use its own slot; bf16 decode-sized steps (which take the GEMV / native
    path without adapters) get the terms too."""
    g = torch.Generator().manual_seed(3)
    n_exp, hidden, inter, t, k = 4, 24, 12, 5 if dtype == torch.float32 else 3, 2
    experts = MoEExperts(n_exp, hidden, inter)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(n_exp, 2 * inter, hidden, generator=g) * 0.2)
        experts.down_proj.copy_(torch.randn(n_exp, hidden, inter, generator=g) * 0.2)
    experts.to(dtype)
    step = LoRAStep()
    lora = LoRAExperts(experts, *experts.lora_stack()[1:], step, num_slots=2, max_rank=8)
    pairs = []
    for slot, r in enumerate((8, 3)):
        pair = []
        for part, (d_in, d_out) in (("gate_up_proj", (hidden, 2 * inter)),
                                    ("down_proj", (inter, hidden))):
            a = torch.randn(n_exp, r, d_in, generator=g) * 0.3
            b = torch.randn(n_exp, d_out, r, generator=g) * 0.3
            lora.set_part(slot, part, a, b)
            pair.append((a, b))
        pairs.append(pair)
    x = torch.randn(t, hidden, generator=g).to(dtype)
    top_idx = torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(t)])
    top_w = torch.rand(t, k, generator=g).to(dtype)
    experts.use_gemv = False  # bf16 decode sizes: F.linear's products, the general path's bits
    plain = experts(x, top_idx, top_w).clone()
    slot_of_row = torch.tensor([1, -1, 0, 0, 1][:t])
    step.idx = slot_of_row
    got = experts(x, top_idx, top_w)
    want = _definition(x, experts.gate_up_proj.data, experts.down_proj.data, top_idx, top_w,
                       slot_of_row, pairs)
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    base = slot_of_row < 0
    assert torch.equal(got[base], plain[base])  # base rows keep their bits
    assert (got[~base].double() - plain[~base].double()).abs().max() > 20 * tol



def test_tensor_parallel_cuts_sum_to_the_whole_term():
    """Two ranks' expert shards (intermediate dimension split), each with the adapters cut
    as its weights are: their partial outputs sum to the one-rank definition (the MoE block's
    all-reduce). Built in one process (``set_tensor_parallel``: the shard each rank builds)."""
    g = torch.Generator().manual_seed(5)
    n_exp, hidden, inter, t, k, r = 4, 16, 12, 6, 2, 4
    gu = torch.randn(n_exp, 2 * inter, hidden, generator=g) * 0.2
    dn = torch.randn(n_exp, hidden, inter, generator=g) * 0.2
    pair = [(torch.randn(n_exp, r, d_in, generator=g) * 0.3,
             torch.randn(n_exp, d_out, r, generator=g) * 0.3)
            for d_in, d_out in ((hidden, 2 * inter), (inter, hidden))]
    x = torch.randn(t, hidden, generator=g)
    top_idx = torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(t)])
    top_w = torch.rand(t, k, generator=g)
    slot_of_row = torch.tensor([0, -1, 0, 0, -1, 0])
    total = torch.zeros(t, hidden, dtype=torch.float64)
    try:
        for rank in range(2):
            set_tensor_parallel(rank, 2)
            experts = MoEExperts(n_exp, hidden, inter)
            for e in range(n_exp):
                experts.load_expert(e, "gate_proj", gu[e, :inter])
                experts.load_expert(e, "up_proj", gu[e, inter:])
                experts.load_expert(e, "down_proj", dn[e])
            step = LoRAStep(idx=slot_of_row)
            lora = LoRAExperts(experts, *experts.lora_stack()[1:], step, num_slots=1,
                                max_rank=r)
            for part, (a, b) in zip(("gate_up_proj", "down_proj"), pair):
                lora.set_part(0, part, a, b)
            total += experts(x, top_idx, top_w).double()
    finally:
        set_tensor_parallel(0, 1)
    want = _definition(x, gu, dn, top_idx, top_w, slot_of_row, [pair])
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)


def _gpt_oss_definition(x, w, top_idx, top_w, slot_of_row, pair, limit=7.0, alpha=1.702):
    """gpt-oss's experts per token in float64, ``W_e + (B_e A_e)^T`` on its (in, out) weights
    for adapter rows: gate_up's outputs 2j / 2j+1 are channel j's gate / up."""
    gu, gu_b, dn, dn_b = (t.double() for t in w)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for i in range(x.shape[0]):
        for j in range(top_idx.shape[1]):
            e = int(top_idx[i, j])
            w_gu, w_dn = gu[e], dn[e]
            if slot_of_row[i] >= 0:
                (a1, b1), (a2, b2) = pair
                w_gu = w_gu + (b1[e].double() @ a1[e].double()).T
                w_dn = w_dn + (b2[e].double() @ a2[e].double()).T
            h = x[i].double() @ w_gu + gu_b[e]
            gate, up = h[0::2].clamp(max=limit), h[1::2].clamp(-limit, limit)
            act = (up + 1) * gate * torch.sigmoid(alpha * gate)
            out[i] += float(top_w[i, j]) * (act @ w_dn + dn_b[e])
    return out


@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16", "mxfp4"])
def test_gpt_oss_expert_terms_under_tensor_parallel_cuts(mxfp4):
    """gpt-oss's interleaved gate/up stacks with one adapter, on one rank and as two ranks'
    intermediate shards (a contiguous run of interleaved columns each, built in one process):
    adapter rows follow the definition, base rows keep their bits, the shards sum to it. MXFP4:
    the stacks loaded as blocks and scales (each rank its gate/up rows and whole down blocks),
    the definition on their dequantized weights."""
    g = torch.Generator().manual_seed(7)
    n_exp, hidden, inter, t, k, r = (4, 32, 64, 6, 2, 4) if mxfp4 else (4, 16, 12, 6, 2, 4)
    cfg = type("Cfg", (), dict(num_local_experts=n_exp, hidden_size=hidden,
                               intermediate_size=inter))()
    w = [torch.randn(n_exp, hidden, 2 * inter, generator=g) * 0.3,
         torch.randn(n_exp, 2 * inter, generator=g) * 0.1,
         torch.randn(n_exp, inter, hidden, generator=g) * 0.3,
         torch.randn(n_exp, hidden, generator=g) * 0.1]
    names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    stored = {}
    if mxfp4:
        from tests.test_mxfp4 import mxfp4_quantize

        for i in (0, 2):  # blocks run along each product's inputs: (E, out, in) rows
            blocks, scales, deq = mxfp4_quantize(w[i].transpose(1, 2))
            stored[names[i]] = (blocks, scales)
            w[i] = deq.transpose(1, 2).contiguous()
    pair = [(torch.randn(n_exp, r, d_in, generator=g) * 0.4,
             torch.randn(n_exp, d_out, r, generator=g) * 0.4)
            for d_in, d_out in ((hidden, 2 * inter), (inter, hidden))]
    x = torch.randn(t, hidden, generator=g)
    top_idx = torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(t)])
    top_w = torch.rand(t, k, generator=g)
    slot_of_row = torch.tensor([0, -1, 0, 0, -1, 0])
    want = _gpt_oss_definition(x, w, top_idx, top_w, slot_of_row, pair)
    total = torch.zeros(t, hidden, dtype=torch.float64)
    try:
        for size in (1, 2):
            for rank in range(size):
                set_tensor_parallel(rank, size)
                experts = GptOssExperts(cfg)
                load_into(experts, [(n, v) for n, v in zip(names, w) if n not in stored])
                for proj, (blocks, scales) in stored.items():
                    experts.load_mxfp4(proj, "blocks", blocks, proj)
                    experts.load_mxfp4(proj, "scales", scales, proj)
                assert (experts.gate_up_proj is None) == mxfp4
                plain = experts(x, top_idx, top_w)
                step = LoRAStep(idx=slot_of_row)
                lora = LoRAExperts(experts, *experts.lora_stack()[1:], step, num_slots=1,
                                    max_rank=r)
                for part, (a, b) in zip(("gate_up_proj", "down_proj"), pair):
                    lora.set_part(0, part, a, b)
                got = experts(x, top_idx, top_w)
                base = slot_of_row < 0
                assert torch.equal(got[base], plain[base])
                if size == 1:
                    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
                else:
                    total += got.double()
    finally:
        set_tensor_parallel(0, 1)
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)


def test_tp2_granite_expert_and_shared_mlp_adapters_match_peft(adapters):
    """Granite-4.0-H under two tensor-parallel ranks: expert adapters cut on the intermediate
    dimension, and the third adapter's shared-MLP ``input_linear`` (cut by the model's own
    loader, gate | up rows) cut as its rows."""
    base, dirs = adapters("granitemoehybrid")
    loras = [None, *_requests(dirs)]
    want = [_peft(d, base, p) for d, p in zip([None, *dirs], PROMPTS)]
    llm = LLM(str(base), dtype="float32", tensor_parallel_size=2, enable_lora=True,
              max_loras=3, max_lora_rank=16, kv_cache_memory=1 << 22, threads_per_rank=1,
              warm_up=False)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                            lora_request=loras, use_tqdm=False)
        assert _ids(outs) == want
        llm.engine.kv.check_whole()
    finally:
        llm.engine.shutdown()


def test_ep2_expert_adapters_match_peft(adapters):
    """Two ranks under expert parallelism: each rank holds its own experts' adapters whole
    (the intermediate-dimension split is checked above without processes)."""
    base, dirs = adapters("qwen3_5_moe")
    loras = [None, *_requests(dirs)]
    want = [_peft(d, base, p) for d, p in zip([None, *dirs], PROMPTS)]
    llm = LLM(str(base), dtype="float32", tensor_parallel_size=2, enable_lora=True,
              enable_expert_parallel=True, max_loras=3, max_lora_rank=16,
              kv_cache_memory=1 << 22, threads_per_rank=1, warm_up=False)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                            lora_request=loras, use_tqdm=False)
        assert _ids(outs) == want
        llm.engine.kv.check_whole()
    finally:
        llm.engine.shutdown()


def test_layout_takes_stacks_not_routed_per_expert_linears():
    """Routed experts kept as per-expert linears (Nemotron-H's ``experts.{e}``, called on their
    routed rows only) get no per-row hook (the step's slot index does not follow those rows);
    a shared expert, called on every row, keeps its adapters; expert stacks are taken."""
    layer = nn.Module()
    layer.experts = nn.ModuleList(nn.ModuleDict({"up_proj": nn.Linear(8, 16)})
                                  for _ in range(2))
    layer.shared_experts = nn.ModuleDict({"up_proj": nn.Linear(8, 16)})
    layer.mlp = nn.Module()
    layer.mlp.experts = MoEExperts(6, 8, 4)
    model = nn.Module()
    model.layers = nn.ModuleList([layer])
    assert set(lora_layout(model)) == {"layers.0.shared_experts.up_proj"}
    stacks = experts_layouts(model)
    assert list(stacks) == ["layers.0.mlp.experts"]
    assert stacks["layers.0.mlp.experts"][1] == ExpertsLayout(6, 0, 6, 8, 4, 4)
