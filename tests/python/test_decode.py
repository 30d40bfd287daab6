"""decode and dequantize on CPU against float64 references over the dequantized cache."""

import pytest
import torch

import turboquant as tq
from helpers import make_paged_batch
from reference import attention_reference, decode_slot_reference, rel_err

PRESETS = list(tq.PRESETS)
BLOCK_SIZES = [16, 32, 64, 128]
GROUPS = [1, 4, 8]
SPLITS = [1, 3, 7, 0]
SEQ_LENS = [37, 0, 1, 200, 16]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 112, 128, 160, 192, 256])
def test_dequantize_matches_reference_decoding(preset, head_dim):
    block_size, heads = 16, 2
    cache, bt, sl, _, _ = make_paged_batch([5, 0, 19], block_size, heads, head_dim, preset)
    k, v = tq.dequantize(cache, bt, sl, preset, torch.float32)
    assert k.shape == (3, 19, heads, head_dim) and k.dtype == torch.float32
    assert (k[1] == 0).all() and (k[0, 5:] == 0).all() and (v[0, 5:] == 0).all()
    for b, n in enumerate(sl.tolist()):
        for t in range(n):
            blk = bt[b, t // block_size].item()
            for h in range(heads):
                slot = bytes(cache[blk, t % block_size, h].tolist())
                rk, rv, _ = decode_slot_reference(slot, preset, head_dim)
                torch.testing.assert_close(k[b, t, h].double(), rk, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(v[b, t, h].double(), rv, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("num_splits", SPLITS)
def test_decode_equals_float64_attention(preset, group, num_splits):
    head_dim, heads = 64, 2
    cache, bt, sl, _, _ = make_paged_batch(SEQ_LENS, 16, heads, head_dim, preset, seed=group)
    k, v = tq.dequantize(cache, bt, sl, preset, torch.float32)
    q = torch.randn(len(SEQ_LENS), heads * group, head_dim)
    scale = head_dim ** -0.5
    out = tq.decode(q, cache, bt, sl, preset, scale, num_splits)
    ref = attention_reference(q, k, v, sl, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert (out[1] == 0).all(), "seq_len 0 must give zeros"
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 112, 128, 160, 192, 256])
def test_decode_block_sizes_layouts_head_dims(block_size, head_major, head_dim):
    preset = "turboquant_k3v4_nc"
    cache, bt, sl, _, _ = make_paged_batch([130, 3, 64], block_size, 2, head_dim, preset, head_major=head_major)
    k, v = tq.dequantize(cache, bt, sl, preset, torch.float32)
    q = torch.randn(3, 4, head_dim)
    out = tq.decode(q, cache, bt, sl, preset, 0.1, 2)
    assert rel_err(out, attention_reference(q, k, v, sl, 0.1)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half_precision_query(dtype):
    preset = "turboquant_4bit_nc"
    cache, bt, sl, _, _ = make_paged_batch([50, 90], 16, 2, 128, preset, dtype=dtype)
    k, v = tq.dequantize(cache, bt, sl, preset, torch.float32)
    q = torch.randn(2, 8, 128).to(dtype)
    out = tq.decode(q, cache, bt, sl, preset, 128 ** -0.5)
    assert out.dtype == dtype
    # The reference takes the rounded q, so what is left is the output's rounding: at most one unit
    # roundoff per element (fp16 2^-11, bf16 2^-8 = 3.9e-3; bf16 measures ~1.6e-3), plus fp32 sums.
    tolerance = 2e-3 if dtype == torch.float16 else 4e-3
    assert rel_err(out, attention_reference(q.float(), k, v, sl, 128 ** -0.5)) < tolerance


def test_quantized_attention_is_close_to_unquantized():
    """Sanity of the whole scheme: attention over the packed cache tracks attention over the raw K/V,
    better for more bits."""
    errs = {}
    for preset in PRESETS:
        cache, bt, sl, keys, values = make_paged_batch([256, 256], 16, 2, 128, preset, seed=5, dense=True)
        q = torch.randn(2, 8, 128, generator=torch.Generator().manual_seed(9))
        out = tq.decode(q, cache, bt, sl, preset, 128 ** -0.5)
        errs[preset] = rel_err(out, attention_reference(q, keys, values, sl, 128 ** -0.5))
    assert errs["turboquant_k8v4"] < errs["turboquant_k3v4_nc"] < errs["turboquant_3bit_nc"] < 0.3
    assert errs["turboquant_4bit_nc"] < errs["turboquant_k3v4_nc"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_into_caller_buffers(dtype):
    preset = "turboquant_3bit_nc"
    cache, bt, sl, _, _ = make_paged_batch([30, 0, 12], 16, 2, 64, preset)
    k, v = tq.dequantize(cache, bt, sl, preset, dtype)
    key_out = torch.full((3, 40, 2, 64), float("nan"), dtype=dtype)  # poisoned, longer than needed
    value_out = torch.full_like(key_out, float("nan"))
    tq.dequantize_into(cache, bt, sl, preset, key_out, value_out)
    assert torch.equal(key_out[:, :30], k) and torch.equal(value_out[:, :30], v)
    assert (key_out[:, 30:] == 0).all() and (value_out[:, 30:] == 0).all()
    short = torch.empty(3, 8, 2, 64, dtype=dtype)
    tq.dequantize_into(cache, bt, sl, preset, short, torch.empty_like(short))  # positions >= L are skipped
    assert torch.equal(short, k[:, :8])
    with pytest.raises(RuntimeError, match=r"key_out must be \[3, L, 2, 64\]"):
        tq.dequantize_into(cache, bt, sl, preset, torch.empty(3, 8, 2, 32), torch.empty(3, 8, 2, 32))
