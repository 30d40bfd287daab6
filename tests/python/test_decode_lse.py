"""decode(..., return_lse=True): the attention and each row's log-sum-exp of its scores, the weight
that merges it with an attention over other keys. Against float64 (reference.log_sum_exp_reference)
on the CPU, against the CPU on CUDA (the tiled per-head kernel and the generic one)."""

import math

import pytest
import torch

import turboquant as tq
from conftest import requires_cuda
from helpers import make_paged_batch
from reference import attention_options_reference, log_sum_exp_reference, rel_err

PRESETS = list(tq.PRESETS)
LENS = [0, 1, 5, 37, 300]
HKV, BLOCK = 2, 16
OPTIONS = {
    "plain": {},
    "window": {"window_left": 20},
    "softcap": {"softcap": 1.5},
    "sinks": {"sinks": torch.randn(8, generator=torch.Generator().manual_seed(3)) * 2},
    "combined": {"window_left": 20, "softcap": 1.5, "sinks": torch.randn(8, generator=torch.Generator().manual_seed(3)) * 2},
}


def _case(preset, head_dim, seed=0):
    cache, bt, sl, _, _ = make_paged_batch(LENS, BLOCK, HKV, head_dim, preset, seed=seed)
    keys, values = tq.dequantize(cache, bt, sl, preset, torch.float32)
    q = torch.randn(len(LENS), 4 * HKV, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    return cache, bt, sl, keys, values, q


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_lse_matches_float64(preset, option):
    head_dim, scale = 64, 0.125
    cache, bt, sl, keys, values, q = _case(preset, head_dim)
    options = OPTIONS[option]
    lse_ref = log_sum_exp_reference(q, keys, sl, [1] * len(LENS), scale, **options)
    out_ref = attention_options_reference(q, keys, values, sl, [1] * len(LENS), scale, **options)
    for num_splits in (0, 1, 3):
        out, lse = tq.decode(q, cache, bt, sl, preset, scale, num_splits, return_lse=True, **options)
        assert lse.dtype == torch.float32 and lse.shape == (len(LENS), 4 * HKV)
        finite = torch.isfinite(lse_ref)
        assert torch.equal(torch.isfinite(lse), finite), num_splits  # -inf exactly where nothing is seen
        torch.testing.assert_close(lse[finite].double(), lse_ref[finite], rtol=0, atol=1e-5)
        assert rel_err(out, out_ref) < 1e-5
        torch.testing.assert_close(out, tq.decode(q, cache, bt, sl, preset, scale, num_splits, **options), rtol=0,
                                   atol=0)
    if "sinks" not in options:  # an empty sequence attends to nothing
        assert lse[0].eq(-math.inf).all()


def test_two_halves_merged_by_their_lse_equal_the_whole():
    """What the log-sum-exp is for: attention over positions [0, 96) and over [96, 300) (the second
    through the block table from its 7th block on), merged with weights e^lse, equals attention
    over [0, 300)."""
    preset, head_dim, scale = "turboquant_4bit_nc", 64, 0.125
    cache, bt, sl, keys, values, q = _case(preset, head_dim, seed=4)
    b = 4  # the 300-token sequence
    cut = 96
    whole = tq.decode(q[b:b + 1], cache, bt[b:b + 1], sl[b:b + 1], preset, scale)
    o1, l1 = tq.decode(q[b:b + 1], cache, bt[b:b + 1], torch.tensor([cut], dtype=torch.int32), preset, scale,
                       return_lse=True)
    o2, l2 = tq.decode(q[b:b + 1], cache, bt[b:b + 1, cut // BLOCK:].contiguous(),
                       torch.tensor([300 - cut], dtype=torch.int32), preset, scale, return_lse=True)
    m = torch.maximum(l1, l2)
    w1, w2 = (l1 - m).exp()[..., None], (l2 - m).exp()[..., None]
    merged = (w1 * o1 + w2 * o2) / (w1 + w2)
    assert rel_err(merged, whole) < 1e-5


@requires_cuda
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("head_dim", [128, 96])  # the per-head kernel; the generic one (rotated presets at 96)
@pytest.mark.parametrize("option", ["plain", "combined"])
def test_cuda_lse_matches_cpu(preset, head_dim, option):
    cache, bt, sl, keys, values, q = _case(preset, head_dim, seed=head_dim)
    scale = head_dim ** -0.5
    options = OPTIONS[option]
    on_gpu = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in options.items()}
    q = q.half()
    ref_out, ref_lse = tq.decode(q.float(), cache, bt, sl, preset, scale, return_lse=True, **options)
    for num_splits in (0, 1, 2, 5):
        out, lse = tq.decode(q.cuda(), cache.cuda(), bt.cuda(), sl.cuda(), preset, scale, num_splits, return_lse=True,
                             **on_gpu)
        lse = lse.cpu()
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite), num_splits
        torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=0, atol=2e-3)  # fp16 query, fp16 MMA
        assert rel_err(out.float().cpu(), ref_out) <= 2e-3, num_splits
