"""Multi-token queries per sequence (decode_varlen) against float64 causal attention."""

import pytest
import torch

import turboquant as tq
from conftest import requires_cuda
from helpers import make_paged_batch
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
    ref = tq.decode_varlen(query, cache, bt, sl, starts, preset, 0.125)
    out = tq.decode_varlen(query.half().cuda(), cache.cuda(), bt.cuda(), sl.cuda(), starts.cuda(), preset, 0.125)
    assert rel_err(out.cpu(), ref) <= 2e-3
