"""Numerical edge cases (defined behaviour, README "Guarantees"): zero and constant vectors,
fp16 extremes, FP8 saturation, NaN/inf confined to the sequences that read them."""

import pytest
import torch

import turboquant as tq
from helpers import make_paged_batch, store_fp16_extremes

PRESETS = list(tq.PRESETS)


def _store_one(preset, key, value, d=128):
    cache = tq.allocate_kv_cache(1, 16, 1, d, preset)
    tq.store_kv(key.view(1, 1, d), value.view(1, 1, d), cache, torch.zeros(1, dtype=torch.int32), preset)
    k, v = tq.dequantize(cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), preset,
                         torch.float32)
    return k[0, 0, 0], v[0, 0, 0]


@pytest.mark.parametrize("preset", PRESETS)
def test_zero_and_constant_vectors(preset):
    k, v = _store_one(preset, torch.zeros(128), torch.full((128,), 0.75))
    assert (k == 0).all(), "a zero key decodes to zero (stored norm 0)"
    assert (v == 0.75).all(), "a constant value decodes exactly (scale 0, zero = the constant)"


@pytest.mark.parametrize("preset", PRESETS)
def test_fp16_extremes_stay_finite(preset):
    key = torch.full((128,), 65504.0)
    key[::2] = -65504.0
    value = key.clone()
    k, v = _store_one(preset, key.half(), value.half())
    assert torch.isfinite(k).all() and torch.isfinite(v).all(), "key norms past fp16 saturate to 65504"
    assert v.min() == -65504.0 and abs(v.max().item() - 65504.0) <= 131008 / 15  # within one value step


@pytest.mark.parametrize("preset", PRESETS)
def test_fp16_outputs_of_fp16_extremes_saturate_instead_of_overflowing(preset):
    """Values stored at +-65504 decode (in fp32) to up to 65536; fp16 outputs clamp finite values
    to +-65504 rather than turning them into inf. inf and NaN are not clamped (see below)."""
    cache, bt, sl = store_fp16_extremes(preset)
    k32, v32 = tq.dequantize(cache, bt, sl, preset, torch.float32)
    assert v32.max() > 65504.0, "the fp32 decode lands past the fp16 range (what this test is about)"
    k16, v16 = tq.dequantize(cache, bt, sl, preset, torch.float16)
    assert torch.isfinite(k16).all() and torch.isfinite(v16).all()
    assert v16.max() == 65504.0 and v16.min() == -65504.0
    out = tq.decode(torch.randn(1, 4, 128).half(), cache, bt, sl, preset, 0.1)
    assert out.dtype == torch.float16 and torch.isfinite(out).all() and out.abs().max() == 65504.0


def test_fp8_keys_saturate():
    k, _ = _store_one("turboquant_k8v4", torch.linspace(-1000, 1000, 128), torch.zeros(128))
    assert k.max() == 448.0 and k.min() == -448.0


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_stays_in_its_sequence(preset, bad):
    cache, bt, sl, _, _ = make_paged_batch([40, 40], 16, 2, 128, preset)
    clean = tq.decode(torch.randn(2, 4, 128, generator=torch.Generator().manual_seed(1)), cache, bt, sl, preset, 0.1)
    key = torch.randn(1, 2, 128)
    key[0, 0, 5] = bad
    slot = bt[0, 1].item() * 16 + 3  # token 19 of sequence 0
    tq.store_kv(key, key, cache, torch.tensor([slot]), preset)
    out = tq.decode(torch.randn(2, 4, 128, generator=torch.Generator().manual_seed(1)), cache, bt, sl, preset, 0.1)
    torch.testing.assert_close(out[1], clean[1], rtol=0, atol=0)  # the other sequence is untouched
    assert not torch.isfinite(out[0, :2]).all(), "the sequence that reads the token sees it"


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_3bit_nc"])
def test_key_norm_past_fp16_keeps_the_direction(preset):
    """A key whose norm is past fp16's range stores a saturated norm: the decoded key keeps the
    direction (as well as the codebook allows at that bit width) and has a finite length."""
    g = torch.Generator().manual_seed(4)
    direction = torch.randn(128, generator=g)
    small, _ = _store_one(preset, direction, torch.zeros(128))
    big, _ = _store_one(preset, direction * 1e6, torch.zeros(128))
    assert torch.isfinite(big).all()
    assert 60000.0 < big.norm() <= 65504.0  # 65504 times the codebook vector (norm just under 1)
    cos = torch.nn.functional.cosine_similarity(big, direction, dim=0).item()
    assert cos == pytest.approx(torch.nn.functional.cosine_similarity(small, direction, dim=0).item(), abs=1e-5)
    assert cos > 0.9


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_inf_value_decodes_to_nan_in_every_output_dtype(dtype):
    """An inf in a stored value makes its scale inf, so the token's whole value vector decodes to
    NaN, and fp16 outputs pass it through (only finite results are clamped to +-65504)."""
    preset = "turboquant_4bit_nc"
    value = torch.randn(128)
    value[7] = float("inf")
    cache = tq.allocate_kv_cache(1, 16, 1, 128, preset)
    tq.store_kv(torch.randn(1, 1, 128), value.view(1, 1, 128), cache, torch.zeros(1, dtype=torch.int32), preset)
    bt, sl = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    _, v = tq.dequantize(cache, bt, sl, preset, dtype)
    assert v.isnan().all()
    out = tq.decode(torch.randn(1, 4, 128).to(dtype), cache, bt, sl, preset, 0.1)
    assert out.isnan().all()
