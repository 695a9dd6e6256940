"""The compiled CPU kernels (pagefold.csrc.cpu_ops) against their torch references.

Each kernel replaces a torch formulation that stays in the code as the fallback; here both run
on the same inputs. bf16 kernels round at the same points as the torch ops, so they agree bit
for bit except where a float32 sum's order flips a rounding (allowed on a tiny fraction of
elements). The attention backend is also run end to end with the kernels switched off, so the
pure-torch path stays tested.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagefold.core.kv_cache_spec import StateComponent, StateSpec
from pagefold.csrc import cpu_ops, gemv_choice
from pagefold.executor.cache_tensors import StateView
from pagefold.layers.norm import RMSNorm
from pagefold.layers.rotary import RotaryEmbedding
from pagefold.layers.vocab import lm_head_linear
from pagefold.ops.attention import cpu as attn_cpu
from pagefold.ops.attention.reference import AttentionMetadata, decode_torch
from pagefold.ops.conv1d.reference import causal_conv1d_update
from pagefold.ops.elementwise import cpu as elementwise_cpu
from pagefold.ops.gdn import cpu as gdn_cpu
from pagefold.ops.gdn.reference import gdn_recurrent
from pagefold.ops.ssd import cpu as ssd_cpu

pytestmark = pytest.mark.skipif(cpu_ops.kernels() is None,
                                reason="no C++ compiler: the torch paths run instead")


@pytest.fixture
def kernels_off():
    cpu_ops.set_enabled(False)
    yield
    cpu_ops.set_enabled(True)


def _close_bits(got: torch.Tensor, ref: torch.Tensor, max_frac: float = 2e-3) -> None:
    """Equal, except a few elements one rounding step apart (float32 sum order)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    diff = got != ref
    assert diff.float().mean().item() <= max_frac, f"{int(diff.sum())} of {got.numel()} differ"
    if diff.any():
        scale = ref.float().abs()[diff] + 1e-6
        assert ((got.float() - ref.float()).abs()[diff] / scale).max() < 2e-2


def _paged_decode_case(b: int, h: int, kvh: int, d: int, bs: int, dtype, window: int | None,
                       seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 5 * bs, (b,), generator=g)
    width = int((lens.max() + bs - 1) // bs)
    num_blocks = b * width + 1
    cache = torch.full((num_blocks, bs, 2, kvh, d), float("nan"), dtype=dtype)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).view(b, width)
    keys = []
    for i in range(b):
        n = int(lens[i])
        kv = torch.randn(n, 2, kvh, d, generator=g).to(dtype)
        for p in range(n):  # only the slots a row owns are written; the rest stay NaN
            cache[perm[i, p // bs], p % bs] = kv[p]
        keys.append(kv)
    q = torch.randn(b, h, d, generator=g).to(dtype)
    starts = torch.clamp(lens - window, min=0) if window else None
    return q, cache, perm, lens, starts, keys


def _dense(q, keys, lens, starts, scale):
    out = []
    for i, kv in enumerate(keys):
        lo = int(starts[i]) if starts is not None else 0
        k = kv[lo:, 0].double()
        v = kv[lo:, 1].double()
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("hd,khd->hk", q[i].double(), k) * scale
        out.append(torch.einsum("hk,khd->hd", s.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,kvh,d,bs", [(4, 2, 64, 16), (9, 3, 64, 16), (6, 3, 32, 16),
                                        (8, 1, 128, 32), (4, 4, 24, 4)],
                         ids=["avx-gqa", "avx-g3", "avx-d32-generic", "avx-mqa-d128",
                              "generic-bs4"])
@pytest.mark.parametrize("window", [None, 7])
def test_decode_attention_matches_dense(dtype, h, kvh, d, bs, window):
    q, cache, tables, lens, starts, keys = _paged_decode_case(5, h, kvh, d, bs, dtype, window,
                                                              seed=h * d + bs)
    out = torch.full_like(q, float("nan"))
    scale = d**-0.5
    assert attn_cpu.decode_attention(q, None, cache, tables, lens, starts, scale, out)
    ref = _dense(q, keys, lens, starts, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    # The torch path on the same metadata agrees (it is the fallback).
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long),
                             decode_tok=torch.arange(5), decode_tables=tables,
                             decode_seq_lens=lens, decode_kv_start=starts, block_size=bs,
                             all_decode=True)
    torch.testing.assert_close(decode_torch(q, cache, meta, scale).double(), ref, atol=2e-2,
                               rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,kvh,d", [(4, 1, 128), (6, 6, 64)], ids=["gqa4-d128", "mha-d64"])
def test_decode_attention_shared_prefix_rows_are_each_rows_own(dtype, h, kvh, d):
    """Rows whose tables start with the same blocks (a shared prompt) are attended together
    over those blocks: each row's output is bit for bit what the kernel gives that row alone
    (at 1 and 2 threads), and matches the float64 reference. Rows: a group of six sharing 300
    keys (one diverging at key 160, so the group shares one 128-key tile less), rows with
    their own blocks, and a pair sharing less than a tile."""
    g = torch.Generator().manual_seed(3)
    bs = 16
    shared_blocks = 19  # 304 keys
    lens = [310, 305, 700, 420, 303, 500, 90, 260, 150, 150]
    firsts = [0, 0, 0, 0, 0, 0, None, None, 1, 1]  # None: own blocks; 1: a second pair
    num_blocks = 1 + shared_blocks + 8 + sum(-(-n // bs) for n in lens) + 1
    cache = torch.randn(num_blocks, bs, 2, kvh, d, generator=g).to(dtype)
    free = iter(range(1 + shared_blocks + 8, num_blocks))
    pair = list(range(1 + shared_blocks, 1 + shared_blocks + 8))  # the pair's 5 shared blocks
    width = -(-max(lens) // bs)
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    for i, (n, first) in enumerate(zip(lens, firsts)):
        own = [next(free) for _ in range(-(-n // bs))]
        if first == 0:
            own[:shared_blocks] = range(1, 1 + shared_blocks)
            if i == 3:
                own[10] = next(free)  # diverges at key 160
        elif first == 1:
            own[:5] = pair[:5]
        tables[i, : len(own)] = torch.tensor(own)
    lens_t = torch.tensor(lens)
    q = torch.randn(len(lens), h, d, generator=g).to(dtype)
    scale = d**-0.5
    keys = []
    for i, n in enumerate(lens):
        slots = tables[i].repeat_interleave(bs)[:n] * bs + torch.arange(n) % bs
        keys.append(cache.view(-1, 2, kvh, d)[slots])
    ref = _dense(q, keys, lens_t, None, scale)
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            out = torch.full_like(q, float("nan"))
            assert attn_cpu.decode_attention(q, None, cache, tables, lens_t, None, scale, out)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
            for i in range(len(lens)):
                one = torch.full_like(q[i : i + 1], float("nan"))
                assert attn_cpu.decode_attention(q[i : i + 1], None, cache, tables[i : i + 1],
                                                lens_t[i : i + 1], None, scale, one)
                assert torch.equal(one[0], out[i]), f"row {i} differs from itself alone"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("amx", [True, False], ids=["amx-tiles", "avx512"])
@pytest.mark.parametrize("h,kvh,d", [(8, 1, 128), (16, 1, 64), (10, 2, 64), (6, 2, 256),
                                     (12, 4, 128), (4, 2, 64)],
                         ids=["g8-d128", "g16-d64", "g5-d64", "g3-d256", "g3-d128", "g2-d64"])
@pytest.mark.parametrize("window", [None, 23])
def test_decode_attention_bf16_score_paths(h, kvh, d, window, amx):
    """bf16 caches with grouped query heads: the AMX tile path (scores and value sums, where
    this CPU has them; P rounded to bf16) and the AVX-512 loops both match the float64
    reference (NaN in every unowned cache slot, keys masked on both sides of sub-blocks by
    windows), a row's output is its own alone, and the path asked for is the one the kernel
    took."""
    lib = cpu_ops.kernels()
    if amx and not lib.pf_amx_ready():
        pytest.skip("this CPU has no AMX: no tile path")
    before = lib.pf_decode_attention_amx(int(amx))
    try:
        q, cache, tables, lens, starts, keys = _paged_decode_case(
            6, h, kvh, d, 16, torch.bfloat16, window, seed=h * d + kvh)
        scale = d**-0.5
        out = torch.full_like(q, float("nan"))
        assert attn_cpu.decode_attention(q, None, cache, tables, lens, starts, scale, out)
        ref = _dense(q, keys, lens, starts, scale)
        torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=1e-2)
        for i in (0, 3):
            one = torch.full_like(q[i : i + 1], float("nan"))
            assert attn_cpu.decode_attention(
                q[i : i + 1], None, cache, tables[i : i + 1], lens[i : i + 1],
                None if starts is None else starts[i : i + 1], scale, one)
            assert torch.equal(one[0], out[i])
        # The path asked for is the one taken (the kernel counts its AMX calls); two query
        # heads per kv head stay on the AVX-512 loops (the tiles were slower there).
        calls = lib.pf_decode_attention_amx_calls()
        assert attn_cpu.decode_attention(q, None, cache, tables, lens, starts, scale, out)
        assert lib.pf_decode_attention_amx_calls() - calls == int(amx and h // kvh >= 3)
    finally:
        lib.pf_decode_attention_amx(before)


def _has_prefill_kernel() -> bool:
    """The prefill kernel needs AVX-512 BF16; elsewhere it declines (SDPA runs instead)."""
    q = torch.zeros(1, 1, 2, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 2, 1, 2, dtype=torch.bfloat16)
    rows = torch.tensor([[0, 1, 0, 0, 0]])
    return attn_cpu.prefill_attention(q, cache, rows, torch.tensor([16]), None, 1.0,
                                     torch.empty_like(q))


def _skip_unless_prefill_kernel(kernel: str) -> None:
    """Skips where this CPU or build lacks ``kernel`` (attn_cpu.prefill_attention's names)."""
    if not _has_prefill_kernel():
        pytest.skip("this CPU has no AVX-512 BF16: prefill attention stays on SDPA")
    lib = cpu_ops.kernels()
    if kernel == "amx" and not lib.pf_amx_ready():
        pytest.skip("this CPU has no AMX: no tile kernel")
    if kernel == "blocked" and not lib.pf_prefill_blocked_ready():
        pytest.skip("this build has no blocked AVX512-BF16 prefill kernel")


@pytest.mark.parametrize("h,kvh,d", [(4, 2, 64), (8, 2, 24), (2, 1, 128), (8, 1, 32),
                                     (3, 3, 256)],
                         ids=["gqa-d64", "g4-d24", "d128", "g8-d32", "mha-d256"])
@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("kernel", ["amx", "blocked", "rows"])
def test_prefill_attention_matches_dense(h, kvh, d, window, kernel):
    """Chunks of a flat batch with and without cached context (chunked prefill, prefix hits),
    lengths that leave partial tiles and key blocks, keys scattered over pages whose unused
    slots are NaN; scores spread wide enough that the running maximum is raised mid-row. Each
    kernel: the blocked one on AMX tiles (where this CPU has them) and on AVX512-BF16 dot
    products, and the one-row-at-a-time AVX512-BF16 one."""
    _skip_unless_prefill_kernel(kernel)
    # (ctx_len, q_len): fresh prompts, later chunks, single tokens, a long chunk after context.
    chunks = [(0, 37), (5, 1), (40, 16), (100, 3), (0, 1), (17, 50), (0, 90), (70, 41)]
    q, cache, rows, slots, scale, ref = _prefill_case(h, kvh, d, window, chunks, seed=11)
    out = torch.zeros_like(q)
    blocked = kernel != "rows"
    if blocked and d % 32:  # head dims the blocked kernels decline
        assert not attn_cpu.prefill_attention(q, cache, rows, slots, window, scale, out,
                                             kernel=kernel)
        assert not out.any()
        return
    assert attn_cpu.prefill_attention(q, cache, rows, slots, window, scale, out, kernel=kernel)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    if blocked:  # the blocked kernel computed this, not the row kernel
        other = torch.zeros_like(q)
        assert attn_cpu.prefill_attention(q, cache, rows, slots, window, scale, other,
                                         kernel="rows")
        assert not torch.equal(out, other)


@pytest.mark.parametrize("h,kvh", [(2, 2), (4, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("kernel", ["amx", "blocked"])
def test_prefill_blocked_every_alignment(h, kvh, window, kernel):
    """The blocked kernels over random chunks: every alignment of a 32-lane tile's first and
    last query against the key blocks (the diagonal and window-edge blocks are the masked
    ones), each row checked against float64 with a tighter bound than a leaked or lost key
    allows. Rows of fewer than 8 query heads x tokens go to the row kernel: bitwise its
    output."""
    _skip_unless_prefill_kernel(kernel)
    rng = torch.Generator().manual_seed(5)
    chunks = [(int(torch.randint(0, 120, (1,), generator=rng)),
               int(torch.randint(1, 70, (1,), generator=rng))) for _ in range(24)]
    chunks += [(50, 1), (3, 2)]  # a token or two: small rows at one and two query heads
    q, cache, rows, slots, scale, ref = _prefill_case(h, kvh, 64, window, chunks, seed=6)
    out = torch.zeros_like(q)
    assert attn_cpu.prefill_attention(q, cache, rows, slots, window, scale, out, kernel=kernel)
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=1e-2)
    avx = torch.zeros_like(q)
    assert attn_cpu.prefill_attention(q, cache, rows, slots, window, scale, avx, kernel="rows")
    small = [r for r in rows.tolist() if r[1] * (h // kvh) < 8]
    assert len(small) < len(rows) and (small or h // kvh >= 8)
    for tok, n, *_ in small:
        assert torch.equal(out[tok : tok + n], avx[tok : tok + n])


def _prefill_case(h: int, kvh: int, d: int, window: int | None, chunks: list[tuple[int, int]],
                  seed: int) -> tuple:
    """A flat batch of prefill chunks ``(ctx_len, q_len)`` over a paged bf16 cache (pages
    shuffled, unused slots NaN) and the float64 reference: ``(q, cache, rows, slots, scale,
    ref)``. Keys grow in magnitude along each row, so later keys score far higher."""
    g = torch.Generator().manual_seed(seed)
    bs = 16
    total = sum(c + n for c, n in chunks)
    num_blocks = sum(-(-(c + n) // bs) for c, n in chunks) + 1
    cache = torch.full((num_blocks, bs, 2, kvh, d), float("nan"), dtype=torch.bfloat16)
    pages = torch.randperm(num_blocks - 1, generator=g) + 1
    q = torch.randn(sum(n for _, n in chunks), h, d, generator=g).to(torch.bfloat16)
    rows, slots, refs, tok, used = [], [], [], 0, 0
    scale = d**-0.5
    for ctx, n in chunks:
        length = ctx + n
        mine = pages[used : used + -(-length // bs)]
        used += mine.shape[0]
        pos_slots = mine.repeat_interleave(bs)[:length] * bs + torch.arange(length) % bs
        kv = torch.randn(length, 2, kvh, d, generator=g)
        kv[:, 0] *= 1 + torch.arange(length).view(-1, 1, 1) / 16  # later keys score far higher
        kv = kv.to(torch.bfloat16)
        cache.view(-1, 2, kvh, d)[pos_slots] = kv
        kv_start = max(0, ctx - window + 1) if window else 0
        rows.append((tok, n, ctx, kv_start, sum(x.shape[0] for x in slots)))
        slots.append(pos_slots[kv_start:])
        # Reference in float64: query i at position ctx + i sees keys lo..ctx + i.
        rep = h // kvh
        kk = kv[:, 0].double().repeat_interleave(rep, 1)
        vv = kv[:, 1].double().repeat_interleave(rep, 1)
        for i in range(n):
            pos = ctx + i
            lo = max(kv_start, pos - window + 1) if window else 0
            sc = torch.einsum("hd,khd->hk", q[tok + i].double(), kk[lo : pos + 1]) * scale
            refs.append(torch.einsum("hk,khd->hd", sc.softmax(-1), vv[lo : pos + 1]))
        tok += n
    assert used == num_blocks - 1 and total > 0
    return q, cache, torch.tensor(rows), torch.cat(slots), scale, torch.stack(refs)


def test_decode_attention_row_subset_leaves_other_rows():
    q, cache, tables, lens, _, keys = _paged_decode_case(4, 4, 2, 64, 16, torch.float32, None,
                                                         seed=1)
    big = torch.randn(7, 4, 64)
    rows = torch.tensor([5, 0, 3, 6])
    big[rows] = q
    out = torch.zeros_like(big)
    assert attn_cpu.decode_attention(big, rows, cache, tables, lens, None, 0.125, out)
    torch.testing.assert_close(out[rows].double(), _dense(q, keys, lens, None, 0.125),
                               atol=1e-5, rtol=1e-5)
    assert not out[[1, 2, 4]].any()


def test_unsupported_inputs_fall_back():
    q, cache, tables, lens, _, _ = _paged_decode_case(2, 4, 2, 64, 16, torch.float32, None, 0)
    out = torch.empty_like(q)
    assert not attn_cpu.decode_attention(q.half(), None, cache.half(), tables, lens, None, 1.0,
                                        out.half())
    assert elementwise_cpu.rms_norm(torch.ones(3, 8, dtype=torch.float16),
                            torch.ones(8, dtype=torch.float16), 1e-6, False) is None
    assert elementwise_cpu.silu_and_mul(torch.ones(3, 8, dtype=torch.float64)) is None


def test_disabled_kernels_return_nothing(kernels_off):
    q, cache, tables, lens, _, _ = _paged_decode_case(2, 4, 2, 64, 16, torch.float32, None, 0)
    assert not attn_cpu.decode_attention(q, None, cache, tables, lens, None, 1.0, q.clone())
    assert elementwise_cpu.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6, False) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv(dtype):
    cache = torch.zeros(6, 4, 2, 2, 16, dtype=dtype)
    kv = torch.randn(5, 3, 2, 16).to(dtype)  # a fused (k, v, extra) projection: strided views
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.tensor([3, 9, 17, 22, 4])
    assert attn_cpu.write_kv(cache, slots, k, v)
    flat = cache.view(-1, 2, 2, 16)
    assert torch.equal(flat[slots, 0], k) and torch.equal(flat[slots, 1], v)
    assert flat.abs().sum(dim=(1, 2, 3)).count_nonzero() == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered", [False, True])
# 200: a partial 16-lane chunk at the end; 203: partial 16- and 8-lane chunks (scalar tails)
@pytest.mark.parametrize("width", [192, 200, 203])
def test_rms_norm_and_fused_residual(dtype, zero_centered, width):
    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(width, 1e-6, zero_centered).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=g) * 0.2 + (0.0 if zero_centered else 1.0))
    x = (torch.randn(33, width, generator=g) * 3).to(dtype)
    res = (torch.randn(33, width, generator=g) * 3).to(dtype)
    check = _close_bits if dtype == torch.bfloat16 else (
        lambda a, b: torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5))
    with torch.no_grad():
        check(norm(x), norm.reference(x))
        summed = x + res
        out, new_res = norm(x, res.clone())
        assert torch.equal(new_res, summed)  # the add rounds exactly like torch's
        check(out, norm.reference(summed))
        # Per-head use (q/k norms): a 3-D input with strided rows.
        heads = torch.randn(5, 8, 2 * width, generator=g).to(dtype)[..., :width]
        check(norm(heads), norm.reference(heads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim,qk_norm", [(None, True), (16, True), (None, False)])
def test_qk_norm_rope_matches_torch(dtype, rotary_dim, qk_norm):
    class Cfg:
        rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}

    g = torch.Generator().manual_seed(4)
    h, kvh, d = 4, 2, 64
    rope = RotaryEmbedding(Cfg(), d, 512, rotary_dim=rotary_dim)
    qn, kn = RMSNorm(d).to(dtype), RMSNorm(d).to(dtype)
    with torch.no_grad():
        qn.weight.copy_(torch.randn(d, generator=g) * 0.1 + 1)
        kn.weight.copy_(torch.randn(d, generator=g) * 0.1 + 1)
    t = 9
    qkv = (torch.randn(t, (h + 2 * kvh) * d, generator=g) * 2).to(dtype)
    pos = torch.randint(0, 512, (t,), generator=g)
    got = elementwise_cpu.qk_norm_rope(qkv, pos, rope.cos, rope.sin, num_heads=h, num_kv_heads=kvh,
                               head_dim=d, q_off=0, q_head_stride=d, k_off=h * d,
                               q_weight=qn.weight if qk_norm else None,
                               k_weight=kn.weight if qk_norm else None, eps=1e-6,
                               zero_centered=False)
    assert got is not None
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
    with torch.no_grad():
        if qk_norm:
            q, k = qn.reference(q), kn.reference(k)
        rq, rk = rope(pos, q, k)
    check = _close_bits if dtype == torch.bfloat16 else (
        lambda a, b: torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5))
    check(got[0], rq)
    check(got[1], rk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,rotary_dim", [(128, 32), (256, 64), (40, 32), (48, None)])
def test_qk_norm_rope_gated_zero_centred(dtype, d, rotary_dim):
    """Qwen3.5's layout: zero-centred q/k norms, partial rotary, each query head followed by
    its gate in the fused projection (q_head_stride = 2 * head_dim); head dims 128 / 256 (the
    bf16 path that keeps a head row in registers), 40 (the same with a masked last chunk) and
    48 (three 16-lane chunks, rotary halves of 24: the general path)."""
    class Cfg:
        rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}

    g = torch.Generator().manual_seed(7)
    h, kvh, t = 3, 1, 11
    rope = RotaryEmbedding(Cfg(), d, 512, rotary_dim=rotary_dim)
    qn, kn = RMSNorm(d, zero_centered=True).to(dtype), RMSNorm(d, zero_centered=True).to(dtype)
    with torch.no_grad():
        qn.weight.copy_(torch.randn(d, generator=g) * 0.3)
        kn.weight.copy_(torch.randn(d, generator=g) * 0.3)
    qkv = (torch.randn(t, (2 * h + 2 * kvh) * d, generator=g) * 2).to(dtype)
    pos = torch.randint(0, 512, (t,), generator=g)
    got = elementwise_cpu.qk_norm_rope(qkv, pos, rope.cos, rope.sin, num_heads=h,
                                       num_kv_heads=kvh, head_dim=d, q_off=0,
                                       q_head_stride=2 * d, k_off=2 * h * d,
                                       q_weight=qn.weight, k_weight=kn.weight, eps=1e-6,
                                       zero_centered=True)
    assert got is not None
    q = qkv[:, : 2 * h * d].view(t, h, 2 * d)[..., :d]
    k = qkv[:, 2 * h * d : (2 * h + kvh) * d].view(t, kvh, d)
    with torch.no_grad():
        rq, rk = rope(pos, qn.reference(q), kn.reference(k))
    check = _close_bits if dtype == torch.bfloat16 else (
        lambda a, b: torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5))
    check(got[0], rq)
    check(got[1], rk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [96, 93])  # 93: the vector loops' scalar tail
def test_silu_and_mul(dtype, inter):
    gu = (torch.randn(17, 2 * inter, generator=torch.Generator().manual_seed(5)) * 6).to(dtype)
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # overflow edges of exp
    gu[1, inter - 3:inter] = torch.tensor([-100.0, 100.0, 3.0])  # the same in the tail
    got = elementwise_cpu.silu_and_mul(gu)
    ref = F.silu(gu[:, :inter]) * gu[:, inter:]
    if dtype == torch.bfloat16:
        _close_bits(got, ref)
    else:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_silu_and_mul_bf16_denormals():
    """bf16 results that are float32 denormals round like torch (to bf16 denormals, not to
    zero): the hardware bf16 conversion flushes them, so vectors holding one take the integer
    rounding. Denormal SiLU outputs (the first rounding) and denormal products (the store),
    each in a vector beside normal lanes and in a vector of its own."""
    inter = 48
    gu = torch.randn(4, 2 * inter, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    tiny = torch.tensor([1e-39, -3e-39, 4e-40, -3e-40], dtype=torch.bfloat16)
    assert (tiny.float().abs() < torch.finfo(torch.float32).tiny).all()  # bf16 denormals
    gu[0, 3:7] = tiny                        # silu(x) ~ x / 2: a denormal SiLU
    gu[1, :16] = tiny.repeat(4)              # a whole vector of them
    gu[2, 5:9] = 1.5
    gu[2, inter + 5 : inter + 9] = tiny      # up tiny: a denormal product
    gu[3, 16:32] = 0.75                      # silu(0.75) * 1e-39: denormal products only
    gu[3, inter + 16 : inter + 32] = 1e-39
    got = elementwise_cpu.silu_and_mul(gu)
    ref = F.silu(gu[:, :inter]) * gu[:, inter:]
    assert (ref[0, 3:7] != 0).all() and (ref[2, 5:9] != 0).all()  # the cases are denormal
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize("d", [64, 24, 21])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gated_matches_module(dtype, d):
    """The GDN output norm on (tokens, heads, dim) with a gate that is a strided slice of a
    wider projection, as Qwen3.5 passes it; a partial lane group when dim is 24."""
    from pagefold.models.qwen3_5 import RMSNormGated

    g = torch.Generator().manual_seed(9)
    t, h = 13, 3
    norm = RMSNormGated(d).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=g))
    x = torch.randn(t, h, d, generator=g).to(dtype)
    wide = (torch.randn(t, h * d + 5, generator=g) * 4).to(dtype)
    gate = wide[:, 5:].reshape(t, h, d)  # rows t*(h*d+5) apart
    gate[0, 0, :2] = torch.tensor([-100.0, 100.0])  # exp overflow edges
    got = elementwise_cpu.rms_norm_gated(x, gate, norm.weight, norm.eps)
    assert got is not None
    ref = norm.reference(x, gate)
    if dtype == torch.bfloat16:
        _close_bits(got, ref)
    else:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        assert torch.equal(norm(x, gate), got)  # the module takes the kernel
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    assert elementwise_cpu.rms_norm_gated(x, gate.to(other), norm.weight, norm.eps) is None  # mixed


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("k,n,bias", [(256, 96, False), (100, 77, True), (1024, 515, True)],
                         ids=["k32x", "k-tail-bias", "wide"])
def test_small_batch_linear_matches_torch(m, k, n, bias):
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, 2 * k, generator=g).bfloat16()[:, :k]  # strided rows
    w = (torch.randn(n, k, generator=g) * k**-0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    got = cpu_ops.linear(x, w, b)
    assert got is not None
    _close_bits(got, F.linear(x, w, b), max_frac=1e-2)


def test_linear_leaves_other_inputs_to_torch():
    w = torch.randn(8, 16).bfloat16()
    assert cpu_ops.linear(torch.randn(cpu_ops.gemv_max_rows() + 1, 16).bfloat16(), w,
                          None) is None
    assert cpu_ops.linear(torch.randn(2, 16), w.float(), None) is None
    lin = torch.nn.Linear(48, 40, dtype=torch.bfloat16)
    assert cpu_ops.use_fast_linears(torch.nn.Sequential(lin, torch.nn.ReLU())) == 1
    for rows in (1, 9, 300):  # the GEMV, then oneDNN on the pre-reordered weight
        x = torch.randn(rows, 96).bfloat16()[:, :48]
        with torch.no_grad():
            _close_bits(lin(x), F.linear(x, lin.weight, lin.bias), max_frac=1e-2)
            if rows > lin.pf_gemv[2].max_rows and lin.pf_packed_weight is not None:
                assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    lin32 = torch.nn.Linear(16, 8)  # float32 layers keep F.linear
    cpu_ops.use_fast_linears(lin32)
    x = torch.randn(5, 16)
    with torch.no_grad():
        assert lin32.pf_packed_weight is None and torch.equal(lin32(x), F.linear(x, lin32.weight,
                                                                                 lin32.bias))


def _fma_or_skip(x, w, b):
    y = cpu_ops.linear_fma(x, w, b)
    if y is None:
        pytest.skip("no AVX2 + FMA kernel on this CPU")
    return y


@pytest.mark.parametrize("k,n,bias", [(100, 77, True), (19, 5, False), (579, 130, True),
                                      (576, 64, False), (7, 3, True)],
                         ids=["k-tail-bias", "tiny", "k-tail-wide", "k8x", "k-under-8"])
def test_fma_kernel_matches_float32_product(k, n, bias):
    """Every M from 1 to 33 (all tile shapes and tails): the float32 product rounded once."""
    g = torch.Generator().manual_seed(k * 7 + n)
    x_all = torch.randn(33, 2 * k, generator=g).bfloat16()[:, :k]  # strided rows
    w = (torch.randn(n, k, generator=g) * k**-0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    for m in range(1, 34):
        x = x_all[:m]
        ref = x.float() @ w.float().t() + (b.float() if b is not None else 0.0)
        _close_bits(_fma_or_skip(x, w, b), ref.bfloat16(), max_frac=1e-2)


def test_fma_kernel_rows_independent_of_batch():
    """A row's output bits do not depend on M or on its place among the rows: a verify step
    of M rows computes exactly the M decode steps it stands for."""
    g = torch.Generator().manual_seed(5)
    k, n = 203, 41
    w = (torch.randn(n, k, generator=g) * k**-0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(33, k, generator=g).bfloat16()
    singles = torch.cat([_fma_or_skip(x[i:i + 1], w, b) for i in range(33)])
    for m in (2, 3, 4, 5, 7, 32, 33):
        assert torch.equal(_fma_or_skip(x[:m], w, b), singles[:m])
    perm = torch.randperm(33, generator=g)
    assert torch.equal(_fma_or_skip(x[perm], w, b), singles[perm])


def test_fma_kernel_bias_and_big_values():
    """The bias is added once per output; products far from 1 keep their magnitude."""
    w = torch.zeros(9, 13, dtype=torch.bfloat16)
    w[:, 12] = 1.0  # only the last (tail) column counts
    x = torch.arange(1, 40, dtype=torch.float32).view(3, 13).bfloat16() * 1024
    b = torch.arange(9, dtype=torch.float32).bfloat16()
    got = _fma_or_skip(x, w, b)
    assert torch.equal(got, (x[:, 12:13].float() + b.float()).bfloat16())
    assert torch.equal(_fma_or_skip(x, w, None), x[:, 12:13].expand(3, 9))


def test_flags_choice_follows_native_bf16(monkeypatch):
    """``PAGEFOLD_GEMV=flags`` (no timing): where the CPU lacks native bf16 GEMM, the AVX2
    kernel for up to 32 rows (a speculative verify step included) with its float32 twin;
    with native bf16, the AMX tiles for 32 rows where they run, else the dot-product GEMV for
    2 (oneDNN is as fast from 3 rows there)."""
    lib = cpu_ops.kernels()
    if lib is None or not lib.pf_gemv_kinds() & 2:
        pytest.skip("no AVX2 + FMA kernel on this CPU")
    monkeypatch.setenv("PAGEFOLD_GEMV", "flags")
    monkeypatch.setattr(cpu_ops, "_defaults", {})
    w = (torch.randn(96, 40) * 0.2).bfloat16()
    monkeypatch.setattr(cpu_ops.gemm, "cpu_has_fast_bf16", lambda: False)
    c = gemv_choice.base_choice(lib)
    assert (c.name, c.max_rows) == ("fma", 32) and c.f32 is lib.pf_linear_bf16_fma_f32out
    x = torch.randn(33, 40).bfloat16()
    assert torch.equal(cpu_ops.linear(x[:32], w, None, c), cpu_ops.linear_fma(x[:32], w, None))
    assert cpu_ops.linear(x, w, None, c) is None
    lin = torch.nn.Linear(40, 96, dtype=torch.bfloat16)
    cpu_ops.use_fast_linears(lin)
    with torch.no_grad():
        assert torch.equal(lin(x[:5]), cpu_ops.linear_fma(x[:5], lin.weight, lin.bias))
    monkeypatch.setattr(cpu_ops.gemm, "cpu_has_fast_bf16", lambda: True)
    c = gemv_choice.base_choice(lib)
    assert c.f32 is None  # native bf16: logits as oneDNN / the GEMV round them
    if lib.pf_amx_ready():
        assert (c.name, c.max_rows) == ("amx", 32) and c.fn is lib.pf_linear_bf16_amx
    elif lib.pf_gemv_kinds() & 1:
        assert (c.name, c.max_rows) == ("avx512bf16", 2)
        assert cpu_ops.linear(x[:3], w, None, c) is None


def test_float_logits_are_the_fma_sums_unrounded(monkeypatch):
    """Where the products are the AVX2 kernel's, an lm_head returns its float32 sums: the
    same sums the bf16 kernel rounds (so rounding them gives its bits), close to float64, rows
    independent of M; above the GEMV's rows the float32-upcast GEMM, also unrounded. Other
    linears of the model stay bf16."""
    lib = cpu_ops.kernels()
    if lib is None or not lib.pf_gemv_kinds() & 2:
        pytest.skip("no AVX2 + FMA kernel on this CPU")
    monkeypatch.setattr(cpu_ops.gemm, "cpu_has_fast_bf16", lambda: False)
    fma = gemv_choice.make_choice(lib, "fma", 32)
    g = torch.Generator().manual_seed(11)
    k, n = 203, 1000
    w = (torch.randn(n, k, generator=g) * k**-0.5).bfloat16()
    x = torch.randn(40, k, generator=g).bfloat16()
    few = fma.max_rows
    got = cpu_ops.float_logits(x[:few], w, None, fma)
    assert got.dtype == torch.float32
    assert torch.equal(got.bfloat16(), cpu_ops.linear_fma(x[:few], w, None))
    ref = x[:few].double() @ w.double().t()
    assert (got.double() - ref).abs().max().item() < 1e-5
    assert torch.equal(torch.cat([cpu_ops.float_logits(x[i:i + 1], w, None, fma)
                                  for i in range(few)]), got)
    many = cpu_ops.float_logits(x, w, None, fma)  # > the GEMV's rows: the upcast GEMM
    assert many.dtype == torch.float32
    assert (many.double() - (x.double() @ w.double().t())).abs().max().item() < 1e-5

    class Top(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(k, k, bias=False, dtype=torch.bfloat16)
            self.lm_head = lm_head_linear(k, n).bfloat16()

    top = Top()
    monkeypatch.setenv("PAGEFOLD_GEMV", "fma")
    cpu_ops.use_fast_linears(top)
    with torch.no_grad():
        assert top.lm_head(x[:3]).dtype == torch.float32
        assert top.proj(x[:3]).dtype == torch.bfloat16
    native = [c.name for c in gemv_choice.available(lib) if c.name in ("amx", "avx512bf16")]
    if native:  # a kernel without a float32 twin: bf16 logits
        monkeypatch.setenv("PAGEFOLD_GEMV", native[0])
        cpu_ops.use_fast_linears(top)
        assert cpu_ops.float_logits(x[:3], w, None, top.lm_head.pf_gemv[2]) is None
        with torch.no_grad():
            assert top.lm_head(x[:3]).dtype == torch.bfloat16


def _amx(x, w, b):
    lib = cpu_ops.kernels()
    if lib is None or not lib.pf_amx_ready():
        pytest.skip("no AMX on this CPU or in this build")
    m, k = x.shape
    n = w.shape[0]
    y = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    rc = lib.pf_linear_bf16_amx(x.data_ptr(), x.stride(0), w.data_ptr(),
                                b.data_ptr() if b is not None else None, y.data_ptr(), n, m,
                                n, k, 2)
    return y if rc == 0 else None


@pytest.mark.parametrize("m,n,k", [(1, 4096, 64), (5, 2100, 128), (16, 1200, 576),
                                   (3, 8209, 32), (7, 33, 40), (4, 64, 64), (17, 4100, 64),
                                   (24, 1200, 576), (32, 2051, 128), (33, 100, 64),
                                   (47, 48, 96), (64, 1200, 576), (100, 2051, 128),
                                   (40, 70, 40)])
def test_amx_product_matches_float32_and_is_row_independent(m, n, k):
    """The AMX tile product (gemv_amx.cpp): float32 sums rounded once (within bf16 rounding of
    the exact product), bias added, weight rows past the last whole tile (n % 16), K not a
    multiple of 32 and weights under 2^18 elements (both the dot-product GEMV), 17-32 rows
    (two x tiles) and past 32 (the blocked path: groups of 16, an odd count and a padded last
    group, an odd number of weight tiles) included; every row's bits equal that row computed
    alone, so a verify step equals its decode steps and an MoE run's rows their pieces'."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k + 3, generator=g).bfloat16()[:, :k]  # rows strided
    w = (torch.randn(n, k, generator=g) * 0.3).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    y = _amx(x, w, b)
    ref = x.float() @ w.float().T + b.float()
    assert torch.allclose(y.float(), ref, rtol=8e-3, atol=8e-3 * ref.abs().max().item())
    for i in range(m):
        assert torch.equal(_amx(x[i:i + 1].contiguous(), w, b)[0], y[i])
    assert torch.equal(_amx(x, w, None), _amx(x, w, torch.zeros(n).bfloat16()))


def test_amx_product_refuses_no_rows_and_takes_many():
    w = torch.randn(32, 64).bfloat16()
    assert _amx(torch.randn(300, 64).bfloat16(), w, None) is not None
    y = torch.zeros(1, 32, dtype=torch.bfloat16)
    assert cpu_ops.kernels().pf_linear_bf16_amx(y.data_ptr(), 64, w.data_ptr(), None,
                                                y.data_ptr(), 32, 0, 32, 64, 1) == -1


def _gdn_inputs(y, a, a_log, dt_bias, hk, hv, dk, dv):
    """The torch path's delta-rule inputs from the conv output ``y`` (T, C), as GatedDeltaNet
    builds them: q, k repeated to the value heads, v per value head, the float32 gate."""
    t = y.shape[0]
    q, k, v = y.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q = q.reshape(t, hk, dk).repeat_interleave(hv // hk, 1)
    k = k.reshape(t, hk, dk).repeat_interleave(hv // hk, 1)
    gg = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return q, k, v.reshape(t, hv, dv), gg


def _assert_gdn_matches(view, page_ids, o, o_ref, conv_new, ssm_new, ssm_dtype, tol):
    """The kernel's output and the states it left in the pages equal the torch path's (the
    conv window exactly: it holds inputs, not sums)."""
    assert o is not None
    after = view.gather(page_ids)
    torch.testing.assert_close(o.float(), o_ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(after["conv"].float(), conv_new.float(), atol=0, rtol=0)
    torch.testing.assert_close(after["ssm"].float(), ssm_new.to(ssm_dtype).float(), atol=tol,
                               rtol=tol)


@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_decode_in_place_matches_torch_path(dtype, ssm_dtype):
    g = torch.Generator().manual_seed(6)
    n, hk, hv, dk, dv, kernel = 3, 2, 4, 16, 32, 4
    c = 2 * hk * dk + hv * dv
    spec = StateSpec("gdn", (StateComponent("conv", (c, kernel - 1), dtype),
                             StateComponent("ssm", (hv, dk, dv), ssm_dtype)))
    # A state spans several non-adjacent pages, and the conv state (channels of 12 or 6 bytes)
    # crosses a page boundary in the middle of a channel.
    page_bytes = 1024
    pages = -(-spec.state_bytes // page_bytes)
    raw = torch.zeros(n * pages + 4, page_bytes, dtype=torch.uint8)
    view = StateView(raw, spec, pages)
    page_ids = (torch.randperm(raw.shape[0] - 1, generator=g)[: n * pages] + 1).view(n, pages)
    init = {"conv": torch.randn(n, c, kernel - 1, generator=g).to(dtype),
            "ssm": (torch.randn(n, hv, dk, dv, generator=g) * 0.3).to(ssm_dtype)}
    view.scatter(page_ids, init)
    fresh = torch.tensor([False, True, False])  # row 1 starts here: its pages are stale
    mixed = torch.randn(n, c, generator=g).to(dtype)
    ab = torch.randn(n, 2 * hv, generator=g).to(dtype)
    a, b = ab[:, :hv], ab[:, hv:]
    weight = (torch.randn(c, kernel, generator=g) * 0.5).to(dtype)
    a_log = torch.randn(hv, generator=g).to(dtype)
    dt_bias = torch.randn(hv, generator=g).to(dtype)

    # The torch path, as GatedDeltaNet runs it.
    states = view.gather(page_ids)
    for t in states.values():
        t[fresh] = 0
    y, conv_new = causal_conv1d_update(mixed, weight, None, states["conv"], "silu")
    q, k, v, gg = _gdn_inputs(y, a, a_log, dt_bias, hk, hv, dk, dv)
    o_ref, ssm_new = gdn_recurrent(q, k, v, gg, b.sigmoid(), states["ssm"],
                                   torch.arange(n + 1), use_qk_l2norm=True)

    o = gdn_cpu.gdn_layer(view, page_ids, ~fresh, torch.arange(n + 1), mixed, a, b, weight, a_log,
                    dt_bias, num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv)
    tol = 1e-5 if dtype == torch.float32 and ssm_dtype == torch.float32 else 2e-2
    _assert_gdn_matches(view, page_ids, o, o_ref, conv_new, ssm_new, ssm_dtype, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba2_decode_in_place_matches_torch_path(dtype):
    """The compiled Mamba-2 decode step: y and the states it leaves in the pages equal the
    torch path's (conv window exactly); a fresh row reads zeros; states span non-adjacent
    pages and SSM rows (24 floats) cross page boundaries."""
    from pagefold.ops.ssd.reference import ssd_recurrent

    g = torch.Generator().manual_seed(8)
    n, heads, hd, groups, ns, kernel = 3, 4, 8, 2, 24, 4
    inter = heads * hd
    c = inter + 2 * groups * ns
    spec = StateSpec("mamba", (StateComponent("conv", (c, kernel - 1), dtype),
                               StateComponent("ssm", (heads, hd, ns), torch.float32)))
    page_bytes = 1000
    pages = -(-spec.state_bytes // page_bytes)
    raw = torch.zeros(n * pages + 4, page_bytes, dtype=torch.uint8)
    view = StateView(raw, spec, pages)
    page_ids = (torch.randperm(raw.shape[0] - 1, generator=g)[: n * pages] + 1).view(n, pages)
    view.scatter(page_ids, {"conv": torch.randn(n, c, kernel - 1, generator=g).to(dtype),
                            "ssm": torch.randn(n, heads, hd, ns, generator=g) * 0.3})
    fresh = torch.tensor([False, True, False])
    proj = torch.randn(n, c + heads + 5, generator=g).to(dtype)  # rows strided, like a split
    xbc, dt = proj[:, :c], proj[:, c : c + heads]
    weight = (torch.randn(c, kernel, generator=g) * 0.5).to(dtype)
    bias = torch.randn(c, generator=g).to(dtype)
    a_log = torch.randn(heads, generator=g).to(dtype)
    dt_bias = torch.randn(heads, generator=g).to(dtype)
    d = torch.randn(heads, generator=g).to(dtype)

    states = view.gather(page_ids)  # the torch path, as Mamba2Mixer runs a decode step
    for t in states.values():
        t[fresh] = 0
    y_conv, conv_new = causal_conv1d_update(xbc, weight, bias, states["conv"], "silu")
    xs, bm, cm = y_conv.split([inter, groups * ns, groups * ns], dim=-1)
    y_ref, ssm_new = ssd_recurrent(
        xs.reshape(n, heads, hd), F.softplus(dt.float() + dt_bias.float()),
        -a_log.float().exp(), bm.reshape(n, groups, ns), cm.reshape(n, groups, ns), d,
        states["ssm"], torch.arange(n + 1), dt_bias=None, dt_softplus=False)

    y = ssd_cpu.mamba2_decode(view, page_ids, ~fresh, xbc, dt, weight, bias, dt_bias, a_log,
                              d, num_heads=heads, head_dim=hd, n_groups=groups, state_size=ns)
    assert y is not None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    after = view.gather(page_ids)
    torch.testing.assert_close(y.float(), y_ref.reshape(n, inter).float(), atol=tol, rtol=tol)
    torch.testing.assert_close(after["conv"], conv_new, atol=0, rtol=0)
    torch.testing.assert_close(after["ssm"], ssm_new, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model", ["qwen3_dir", "llama_dir", "qwen3_5_dir", "nemotron_h_dir"])
def test_engine_same_tokens_with_and_without_kernels(model, request, random_prompts):
    """End to end (float32, mixed prefill/decode steps, a fresh 1-token prompt): the torch
    fallback and the kernels give the same greedy tokens, and logprobs within float noise."""
    from pagefold import LLM, SamplingParams

    model_dir = request.getfixturevalue(model)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).get_text_config().vocab_size
    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, 1, 40, vocab, seed=2)]
    prompts.append({"prompt_token_ids": [7]})
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    results = []
    for on in (True, False):
        cpu_ops.set_enabled(on)
        try:
            llm = LLM(str(model_dir), max_num_batched_tokens=33, kv_cache_memory=1 << 22,
                      max_model_len=128)
            results.append(llm.generate(prompts, params, use_tqdm=False))
        finally:
            cpu_ops.set_enabled(True)
    for a, b in zip(*results):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs,
                             a.outputs[0].token_ids):
            assert abs(la[t].logprob - lb[t].logprob) < 1e-3


# (hk, hv, dk, dv, lens, page_bytes): the vector code works on blocks of up to 64 state
# columns, 16 per lane group: one partial lane group (24), several blocks with a partial one
# (136, whose rows cross page boundaries), and the real models' 128 x 128 heads. A float32 row
# inside one page is updated in place, others go through scratch.
GDN_SHAPES = [(1, 2, 16, 16, [5, 1, 12, 3], 512), (2, 4, 16, 24, [9, 1, 40], 384),
              (1, 2, 32, 136, [3, 17], 512), (2, 2, 128, 128, [2, 33], 1024)]


@pytest.mark.parametrize("shape", GDN_SHAPES, ids=lambda s: f"dk{s[2]}-dv{s[3]}")
@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_varlen_prefill_matches_chunked_torch_path(dtype, ssm_dtype, shape):
    """Prefill chunks of different lengths, continuing and fresh, as one flat batch."""
    from pagefold.ops.conv1d.reference import causal_conv1d_varlen
    from pagefold.ops.gdn.reference import gdn_chunked

    g = torch.Generator().manual_seed(7)
    hk, hv, dk, dv, lens, page_bytes = shape
    kernel = 4
    c = 2 * hk * dk + hv * dv
    n, t = len(lens), sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    spec = StateSpec("gdn", (StateComponent("conv", (c, kernel - 1), dtype),
                             StateComponent("ssm", (hv, dk, dv), ssm_dtype)))
    pages = -(-spec.state_bytes // page_bytes)
    raw = torch.zeros(n * pages + 2, page_bytes, dtype=torch.uint8)
    view = StateView(raw, spec, pages)
    page_ids = (torch.randperm(raw.shape[0] - 1, generator=g)[: n * pages] + 1).view(n, pages)
    view.scatter(page_ids, {"conv": torch.randn(n, c, kernel - 1, generator=g).to(dtype),
                            "ssm": (torch.randn(n, hv, dk, dv, generator=g) * 0.3).to(ssm_dtype)})
    has_init = torch.tensor([i % 2 == 0 for i in range(n)])
    mixed = torch.randn(t, c, generator=g).to(dtype)
    ab = torch.randn(t, 2 * hv, generator=g).to(dtype)
    a, b = ab[:, :hv], ab[:, hv:]
    weight = (torch.randn(c, kernel, generator=g) * 0.5).to(dtype)
    a_log, dt_bias = torch.randn(hv, generator=g).to(dtype), torch.randn(hv, generator=g).to(dtype)

    states = view.gather(page_ids)
    for s in states.values():
        s[~has_init] = 0
    y, conv_new = causal_conv1d_varlen(mixed, weight, None, states["conv"], cu, "silu")
    q, k, v, gg = _gdn_inputs(y, a, a_log, dt_bias, hk, hv, dk, dv)
    o_ref, ssm_new = gdn_chunked(q, k, v, gg, b.sigmoid(), states["ssm"], cu,
                                 use_qk_l2norm=True, chunk_size=4)

    o = gdn_cpu.gdn_layer(view, page_ids, has_init, cu, mixed, a, b, weight, a_log, dt_bias,
                    num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv)
    tol = 1e-4 if dtype == torch.float32 and ssm_dtype == torch.float32 else 3e-2
    _assert_gdn_matches(view, page_ids, o, o_ref, conv_new, ssm_new, ssm_dtype, tol)
