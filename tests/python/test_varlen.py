"""Multi-token queries per sequence (decode_varlen) against float64 causal attention."""

import pytest
import torch

import turboquant as tq
from conftest import requires_cuda
from helpers import make_paged_batch, poison_next_allocations, rerun_tests_with
from reference import rel_err

PRESETS = list(tq.PRESETS)


def _causal_reference(query, keys, values, seq_lens, q_lens, scale):
    """float64: token i of sequence b sees positions < seq_len_b - q_len_b + 1 + i."""
    out, row = [], 0
    group = query.shape[1] // keys.shape[2]
    for b, (n, m) in enumerate(zip(seq_lens.tolist(), q_lens)):
        k = keys[b].double().repeat_interleave(group, dim=1)
        v = values[b].double().repeat_interleave(group, dim=1)
        for i in range(m):
            limit = max(n - m + 1 + i, 0)
            q = query[row].double()
            if limit == 0:
                out.append(torch.zeros_like(q))
            else:
                s = torch.einsum("hd,thd->ht", q, k[:limit]) * scale
                out.append(torch.einsum("ht,thd->hd", s.softmax(-1), v[:limit]))
            row += 1
    return torch.stack(out)


def _case(preset, device="cpu"):
    seq_lens, q_lens = [70, 5, 33, 128], [4, 5, 1, 16]  # chunk tokens are already in the cache
    cache, bt, sl, _, _ = make_paged_batch(seq_lens, 16, 2, 64, preset, seed=3)
    keys, values = tq.dequantize(cache, bt, sl, preset, torch.float32)
    starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    query = torch.randn(int(starts[-1]), 8, 64)
    return cache, bt, sl, keys, values, q_lens, starts, query


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_varlen_matches_causal_reference(preset, num_splits):
    cache, bt, sl, keys, values, q_lens, starts, query = _case(preset)
    out = tq.decode_varlen(query, cache, bt, sl, starts, preset, 0.125, num_splits)
    ref = _causal_reference(query, keys, values, sl, q_lens, 0.125)
    assert out.shape == query.shape
    assert rel_err(out, ref) < 1e-5


def test_decode_varlen_single_token_chunks_equal_decode():
    preset = "turboquant_4bit_nc"
    cache, bt, sl, _, _ = make_paged_batch([20, 40], 16, 2, 64, preset)
    q = torch.randn(2, 4, 64)
    one = tq.decode_varlen(q, cache, bt, sl, torch.tensor([0, 1, 2], dtype=torch.int32), preset, 0.1)
    torch.testing.assert_close(one, tq.decode(q, cache, bt, sl, preset, 0.1), rtol=0, atol=0)


@requires_cuda
@pytest.mark.parametrize("preset", PRESETS)
def test_decode_varlen_cuda_matches_cpu(preset):
    cache, bt, sl, _, _, _, starts, query = _case(preset)
    query = query.half().float()  # the reference sees the query the GPU gets
    ref = tq.decode_varlen(query, cache, bt, sl, starts, preset, 0.125)
    out = tq.decode_varlen(query.half().cuda(), cache.cuda(), bt.cuda(), sl.cuda(), starts.cuda(), preset, 0.125)
    assert rel_err(out.cpu(), ref) <= 2e-3


def test_decode_varlen_rows_outside_every_sequence_are_zero_and_short_contexts_mask():
    """Rows past query_start_loc[-1] are zeros; with seq_len < q_len the first rows see nothing."""
    preset = "turboquant_4bit_nc"
    cache, bt, sl, _, _ = make_paged_batch([3], 16, 2, 64, preset, seed=5)
    query = torch.randn(7, 4, 64)
    starts = torch.tensor([0, 5], dtype=torch.int32)  # 5 query tokens over 3 cached ones; rows 5, 6 unused
    out = tq.decode_varlen(query, cache, bt, sl, starts, preset, 0.125)
    k, v = tq.dequantize(cache, bt, sl, preset, torch.float32)
    ref = _causal_reference(query[:5], k, v, sl, [5], 0.125)
    assert rel_err(out[:5], ref) < 1e-5
    assert out[:2].abs().max() == 0  # limits 3 - 5 + 1 + i <= 0 for i = 0, 1
    assert out[5:].abs().max() == 0


@pytest.mark.parametrize("starts, match", [
    ([0, 2, 1], "non-decreasing"),
    ([-1, 2], r"query_start_loc\[0\] must be >= 0"),
    ([0, 9], "past the query's 4 rows"),
])
def test_decode_varlen_rejects_bad_query_start_loc(starts, match):
    preset = "turboquant_4bit_nc"
    batch = len(starts) - 1
    cache, bt, sl, _, _ = make_paged_batch([20] * batch, 16, 2, 64, preset)
    with pytest.raises(RuntimeError, match=match):
        tq.decode_varlen(torch.randn(4, 4, 64), cache, bt, sl, torch.tensor(starts, dtype=torch.int32), preset, 0.1)


def test_decode_varlen_rejects_bad_shapes():
    preset = "turboquant_4bit_nc"
    cache, bt, sl, _, _ = make_paged_batch([20, 30], 16, 2, 64, preset)
    q = torch.randn(4, 4, 64)
    with pytest.raises(RuntimeError, match="query_start_loc must be int32"):
        tq.decode_varlen(q, cache, bt, sl, torch.tensor([0, 2, 4]), preset, 0.1)
    with pytest.raises(RuntimeError, match="block_table must have 1 rows"):
        tq.decode_varlen(q, cache, bt, sl, torch.tensor([0, 4], dtype=torch.int32), preset, 0.1)
    with pytest.raises(RuntimeError, match="query_start_loc must be 1-D"):
        tq.decode_varlen(q, cache, bt, sl, torch.tensor([[0, 2, 4]], dtype=torch.int32), preset, 0.1)


@requires_cuda
@pytest.mark.parametrize("group", [1, 2, 3, 4, 6, 8, 16])
@pytest.mark.parametrize("num_splits", [1, 2, 4])  # 2: merged in a cluster, empty chunks returning together
def test_decode_varlen_cuda_gqa_chunks_match_cpu(group, num_splits):
    """Every GQA group (tokens per CTA 8 // group), chunks of 1-128 tokens, a sequence shorter
    than its chunk, an empty sequence, and rows past the last sequence (zeros)."""
    preset, hkv, d = "turboquant_4bit_nc", 2, 128
    seq_lens, q_lens = [300, 40, 9, 0, 1000], [128, 7, 12, 0, 33]
    cache, bt, sl, _, _ = make_paged_batch(seq_lens, 16, hkv, d, preset, seed=group)
    starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    total = int(starts[-1]) + 3  # three rows outside every sequence
    query = torch.randn(total, hkv * group, d).bfloat16().float()  # the reference sees the same inputs
    ref = tq.decode_varlen(query, cache, bt, sl, starts, preset, 0.1, num_splits)
    dev = [t.cuda() for t in (query.bfloat16(), cache, bt, sl, starts)]
    poison_next_allocations(dev[0], workspace=True)  # the output is zero-filled; a partial vector must not be read unwritten
    out = tq.decode_varlen(*dev, preset, 0.1, num_splits)
    assert torch.isfinite(out).all()
    assert rel_err(out.float().cpu(), ref) <= 2e-3
    assert out[-3:].abs().max() == 0


@requires_cuda
@pytest.mark.parametrize("preset", PRESETS)
def test_decode_varlen_cuda_single_token_rows_equal_decode(preset):
    """query_start_loc = arange: the varlen launch serves the same columns as a plain decode."""
    cache, bt, sl, _, _ = make_paged_batch([50, 700, 1], 16, 2, 128, preset, device="cuda", seed=2)
    q = torch.randn(3, 8, 128, device="cuda", dtype=torch.float16)
    starts = torch.arange(4, dtype=torch.int32, device="cuda")
    torch.testing.assert_close(tq.decode_varlen(q, cache, bt, sl, starts, preset, 0.1, 3),
                               tq.decode(q, cache, bt, sl, preset, 0.1, 3), rtol=2e-3, atol=2e-3)


@requires_cuda
def test_decode_varlen_cuda_graph_replay_and_empty_query():
    preset = "turboquant_k8v4"
    cache, bt, sl, _, _ = make_paged_batch([200, 90], 16, 2, 64, preset, device="cuda", seed=4)
    starts = torch.tensor([0, 16, 21], dtype=torch.int32, device="cuda")
    q = torch.randn(21, 8, 64, device="cuda", dtype=torch.bfloat16)
    eager = tq.decode_varlen(q, cache, bt, sl, starts, preset, 0.125, 2)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        tq.decode_varlen(q, cache, bt, sl, starts, preset, 0.125, 2)  # warm-up outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = tq.decode_varlen(q, cache, bt, sl, starts, preset, 0.125, 2)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, eager, rtol=0, atol=0)
    starts.copy_(torch.tensor([0, 5, 21], dtype=torch.int32))  # new chunk lengths, same shapes
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, tq.decode_varlen(q, cache, bt, sl, starts, preset, 0.125, 2), rtol=0, atol=0)
    empty = tq.decode_varlen(q[:0], cache, bt, sl, torch.zeros(3, dtype=torch.int32, device="cuda"), preset, 0.125)
    assert empty.shape == (0, 8, 64)


@requires_cuda
@pytest.mark.parametrize("num_splits", [1, 2, 3])
def test_decode_varlen_cuda_nan_key_reaches_exactly_the_rows_that_see_it(num_splits):
    """A NaN key at token 0 of KV head 1 makes exactly the query rows that see token 0 NaN in that
    head's query heads, as on the CPU: here every row, including those that see token 0 alone
    (a sequence of one token; the first row of a 16-token chunk over 16 tokens), where the running
    max stays -inf and only the softmax sum says NaN (column_saw_tokens). Other heads match."""
    preset, hkv, group, d = "turboquant_4bit_nc", 2, 4, 128
    seq_lens, q_lens = [1, 40, 16], [1, 16, 16]
    cache, bt, sl, _, _ = make_paged_batch(seq_lens, 16, hkv, d, preset, seed=21)
    key = torch.randn(3, hkv, d)
    key[:, 1, 5] = float("nan")
    tq.store_kv(key, torch.randn(3, hkv, d), cache, bt[:, 0].long() * 16, preset)  # token 0 of each
    starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    query = torch.randn(int(starts[-1]), hkv * group, d).half()
    ref = tq.decode_varlen(query.float(), cache, bt, sl, starts, preset, 0.1, num_splits)
    dev = [t.cuda() for t in (cache, bt, sl, starts)]
    out = tq.decode_varlen(query.cuda(), *dev, preset, 0.1, num_splits).float().cpu()
    nan_heads = torch.zeros(query.shape[:2], dtype=torch.bool)
    nan_heads[:, group:] = True
    assert torch.equal(ref.isnan().any(-1), nan_heads)  # the reference: every row sees token 0
    assert torch.equal(out.isnan().any(-1), nan_heads) and out[nan_heads].isnan().all()
    assert rel_err(out[~nan_heads], ref[~nan_heads]) <= 2e-3


@requires_cuda
@pytest.mark.parametrize("kernel", ["decode", "chunked"])
def test_each_varlen_kernel_passes_the_varlen_cuda_tests(kernel):
    """launch_decode picks the varlen kernel by shape (the chunked one, 64 query columns per CTA,
    once the average chunk fills half of them), so each test above exercises one of them: run this
    file's CUDA tests again with each kernel forced (TURBOQUANT_VARLEN_KERNEL, read once per
    process), so both see every shape."""
    rerun_tests_with(__file__, {"TURBOQUANT_VARLEN_KERNEL": kernel}, "cuda and not each_varlen_kernel")


@requires_cuda
@pytest.mark.parametrize("preset, block_size, head_major, group", [
    *[(p, 32, False, 5) for p in PRESETS],
    ("turboquant_4bit_nc", 64, True, 7),
    ("turboquant_3bit_nc", 128, True, 2),
])
def test_decode_varlen_cuda_block_sizes_layouts_and_bad_block_ids(preset, block_size, head_major, group):
    """Tiles at non-zero offsets in their blocks, head-major caches, GQA 5 and 7, and block-table
    entries outside the cache (their tokens are masked on both devices)."""
    hkv, d = 2, 128
    seq_lens, q_lens = [260, 70], [40, 9]
    cache, bt, sl, _, _ = make_paged_batch(seq_lens, block_size, hkv, d, preset, head_major=head_major, seed=group)
    bt[0, 1] = 10 ** 6  # a block id past the cache
    bt[1, 0] = -3
    starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    query = torch.randn(int(starts[-1]), hkv * group, d).half().float()
    ref = tq.decode_varlen(query, cache, bt, sl, starts, preset, 0.1, 3)
    gpu_cache = cache.cuda() if not head_major else cache.transpose(1, 2).contiguous().cuda().transpose(1, 2)
    dev = [t.cuda() for t in (query.half(), bt, sl, starts)]
    poison_next_allocations(dev[0], workspace=True)
    out = tq.decode_varlen(dev[0], gpu_cache, *dev[1:], preset, 0.1, 3)
    assert torch.isfinite(out).all()
    assert rel_err(out.float().cpu(), ref) <= 2e-3
