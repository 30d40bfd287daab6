"""Exact per-head K/V transformations (turboquant.calibration): the algebra in float64, robust
fitting (sink tokens and outliers left out), and that they lower the quantization error on keys
with a shared offset."""

from dataclasses import replace

import pytest
import torch

import turboquant as tq
import turboquant.roundtrip  # noqa: F401  (tq.roundtrip.packed)
from turboquant.attention import PagedAttentionLayer, StepMetadata
from turboquant.calibration import Calibration, KVTransform, as_calibration, fit
from reference import rel_err


def _attention(q, k, v, scale=0.125):
    """float64 attention of every query row over all keys: q [T, Hq, D], k/v [N, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    weights = (torch.einsum("thd,nhd->thn", q.double(), kk) * scale).softmax(-1)
    return torch.einsum("thn,nhd->thd", weights, vv)


def _real_like(n=300, hkv=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    offset, spread = 3 * torch.randn(hkv, d, generator=g), torch.rand(hkv, d, generator=g) * 3 + 0.2
    k = torch.randn(n, hkv, d, generator=g, dtype=torch.float64) * spread + offset
    v = torch.randn(n, hkv, d, generator=g, dtype=torch.float64) + torch.randn(hkv, d, generator=g)
    q = torch.randn(7, 4 * hkv, d, generator=g, dtype=torch.float64)
    return q, k, v


def test_transformed_attention_equals_the_original_in_float64():
    q, k, v = _real_like()
    t = fit(k, v, [0, k.shape[0]], Calibration(smooth_keys=0.5, center_values=True, min_offset=0.0))
    assert t.key_offset is not None and t.key_scale is not None and t.value_offset is not None
    got = t.output(_attention(t.query(q), t.keys(k), t.values(v)))
    assert rel_err(got, _attention(q, k, v)) < 1e-12
    restored = t.restore(t.keys(k), t.values(v))
    assert rel_err(restored[0], k) < 1e-12 and rel_err(restored[1], v) < 1e-12
    # smoothing scales have geometric mean 1 per head, so the norms stay comparable
    assert torch.allclose(t.key_scale.log().mean(-1), torch.zeros(2, dtype=t.key_scale.dtype), atol=1e-5)


def test_fit_leaves_out_sink_tokens_and_outliers():
    _, k, v = _real_like()
    starts = [0, 150, 300]  # two sequences
    k_sinky, v_sinky = k.clone(), v.clone()
    for s in starts[:-1]:
        k_sinky[s:s + 4] *= 50  # attention sinks: huge norms at each sequence's first positions
    k_sinky[77] *= 30  # and an outlier inside a sequence
    t = fit(k_sinky, v_sinky, starts, Calibration(center_values=True, min_offset=0.0))
    keep = torch.ones(300, dtype=torch.bool)
    keep[[0, 1, 2, 3, 150, 151, 152, 153, 77]] = False
    assert rel_err(t.key_offset, k[keep].mean(0)) < 1e-6
    assert rel_err(t.value_offset, v[keep].mean(0)) < 1e-6


def test_min_offset_centers_only_the_heads_with_a_large_offset():
    g = torch.Generator().manual_seed(3)
    k = torch.randn(200, 2, 64, generator=g, dtype=torch.float64)
    k[:, 0] += 3.0  # head 0: mean key ~3x the spread; head 1: no offset
    t = fit(k, k, [0, 200], Calibration(min_offset=0.5))
    assert rel_err(t.key_offset[0], k[4:, 0].mean(0)) < 1e-6
    assert (t.key_offset[1] == 0).all()
    with pytest.raises(ValueError, match="min_offset"):
        Calibration(min_offset=1.0)


def test_a_chunk_too_short_to_fit_gives_the_identity():
    _, k, v = _real_like(n=19)
    t = fit(k, v, [0, 19], Calibration(smooth_keys=0.5, center_values=True, min_offset=0.0, min_tokens=16))  # 15 after sinks
    assert t.key_offset is None and t.key_scale is None and t.value_offset is None
    q = torch.randn(3, 8, 64)
    assert t.query(q) is q


def test_calibration_options_are_checked():
    assert as_calibration(None) is None and as_calibration(False) is None
    assert as_calibration(True) == Calibration()
    assert as_calibration(Calibration(center_keys=False, smooth_keys=0.0)) is None  # nothing to fit
    with pytest.raises(ValueError, match="calibrate must be"):
        as_calibration("keys")
    with pytest.raises(ValueError, match="smooth_keys"):
        Calibration(smooth_keys=2.0)
    with pytest.raises(ValueError, match="min_tokens"):
        Calibration(min_tokens=0)


def _layer_error(preset, calibration, q, k, v):
    """Relative error of one decode step over a packed layer holding k/v, against float64
    attention over the original K/V."""
    n, hkv, d = k.shape
    bs = 16
    blocks = -(-n // bs)
    layer = PagedAttentionLayer(blocks, bs, hkv, d, preset, dtype=torch.float32, calibration=calibration)
    table = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    prefill = StepMetadata(torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32), table,
                           torch.arange(n), 0)
    prefill_queries = torch.randn(n, q.shape[1], d, generator=torch.Generator().manual_seed(9)) * 2  # what measure sees
    layer.forward(prefill_queries, k.float(), v.float(), prefill, 0.125)
    errs = []
    for row in range(q.shape[0]):
        step = StepMetadata(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([n], dtype=torch.int32), table,
                            torch.tensor([-1]), 1)  # a decode of the held tokens (nothing new stored)
        out = layer.forward(q[row:row + 1].float(), k[:1].float(), v[:1].float(), step, 0.125)
        errs.append(rel_err(out[0], _attention(q[row:row + 1], k, v)[0]))
    return sum(errs) / len(errs)


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"])
def test_calibration_lowers_the_error_on_keys_with_a_shared_offset(preset):
    q, k, v = _real_like()
    plain = _layer_error(preset, None, q, k, v)
    centered = _layer_error(preset, Calibration(smooth_keys=0.0, measure=False), q, k, v)
    everything = _layer_error(preset, Calibration(center_values=True, measure=False), q, k, v)
    measured = _layer_error(preset, Calibration(), q, k, v)
    # keys offset by 3 sigma: centering takes most of the key error away (the value error stays,
    # the larger share at 3-bit values)
    assert centered < 0.8 * plain, (plain, centered)
    assert everything < 0.8 * plain, (plain, everything)
    assert measured < 0.8 * plain, (plain, measured)


def test_measured_choice_is_per_head_and_never_worse_on_the_measured_chunk():
    """Head 0's keys share an offset three times their spread (centering and smoothing pay), head
    1's are centered already with one channel far wider than the rest (smoothing pays, centering
    has nothing to take); each head gets the candidate with the smallest attention error on the
    chunk's own queries, and that error is never above the plain cache's."""
    g = torch.Generator().manual_seed(5)
    n, d = 256, 64
    k = torch.randn(n, 2, d, generator=g)
    k[:, 0] += 3.0
    k[:, 1, :4] *= 12.0
    v = torch.randn(n, 2, d, generator=g)
    q = torch.randn(n, 8, d, generator=g) * 2
    recipe = Calibration(smooth_keys=0.5, min_offset=0.0, measure=True)
    t = fit(k, v, [0, n], recipe, query=q, preset="turboquant_k3v4_nc")
    assert t.key_offset[0].abs().max() > 1.0
    assert (t.key_scale[1] != 1).any()  # smoothed
    errors = {}
    for label, transform in (("chosen", t), ("plain", KVTransform()),
                             ("everything", fit(k, v, [0, n], replace(recipe, measure=False)))):
        stored = transform.keys(k)
        kq, _ = transform.restore(*tq.roundtrip.packed("turboquant_k3v4_nc", stored, stored))
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        logits = torch.einsum("nhgd,mhd->hgnm", q.double().view(n, 2, 4, d), kq.double()) * d ** -0.5
        out = torch.einsum("hgnm,mhd->hgnd", logits.masked_fill(~causal, float("-inf")).softmax(-1), v.double())
        errors[label] = out
    ref_logits = torch.einsum("nhgd,mhd->hgnm", q.double().view(n, 2, 4, d), k.double()) * d ** -0.5
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    ref = torch.einsum("hgnm,mhd->hgnd", ref_logits.masked_fill(~causal, float("-inf")).softmax(-1), v.double())
    err = {label: (out - ref).square().sum((1, 2, 3)) / ref.square().sum((1, 2, 3)) for label, out in errors.items()}
    assert (err["chosen"] <= err["plain"] * (1 + 1e-9)).all() and (err["chosen"] <= err["everything"] * (1 + 1e-9)).all()
    assert (err["chosen"] < 0.7 * err["plain"]).all(), err


def test_measured_calibration_without_queries_falls_back_to_min_offset():
    """Without queries (a cache loaded from another) the min_offset rule decides (head 1, without an
    offset, stays uncentered); with them the measurement does, and centers the head whose offset is
    large."""
    g = torch.Generator().manual_seed(3)
    k = torch.randn(200, 2, 64, generator=g, dtype=torch.float64)
    k[:, 0] += 3.0  # head 0: a large offset; head 1: none
    recipe = Calibration(smooth_keys=0.0, min_offset=0.5)
    without_queries = fit(k, k, [0, 200], recipe)
    assert torch.equal(without_queries.key_offset, fit(k, k, [0, 200], replace(recipe, measure=False)).key_offset)
    assert without_queries.key_offset[0].abs().max() > 1 and (without_queries.key_offset[1] == 0).all()
    everything = fit(k, k, [0, 200], replace(recipe, min_offset=0.0))  # the measurement's candidates: both centered
    assert (everything.key_offset[1] != 0).any()
    measured = fit(k, k, [0, 200], replace(recipe, min_offset=0.0), query=torch.randn(200, 8, 64, generator=g, dtype=torch.float64),
                   preset="turboquant_4bit_nc")
    assert measured.key_offset[0].abs().max() > 1  # centering pays where the offset is large

@pytest.mark.parametrize("kept", ["exact_recent", "exact_first"])
def test_measured_choice_with_exact_tokens_scores_only_the_packed_positions(kept):
    """A layer keeping its last R tokens (or its first F) raw chooses by the error on the others:
    with them covering the whole measured chunk no candidate changes anything, and the tie keeps
    the identity (the same keys that, measured without them, get centered and smoothed)."""
    g = torch.Generator().manual_seed(5)
    n, d = 128, 64
    k = torch.randn(n, 2, d, generator=g)
    k[:, 0] += 3.0
    k[:, 1, :4] *= 12.0
    v, q = torch.randn(n, 2, d, generator=g), torch.randn(n, 8, d, generator=g) * 2
    recipe = Calibration(smooth_keys=0.5, min_offset=0.0, measure=True)
    measured = fit(k, v, [0, n], recipe, query=q, preset="turboquant_k3v4_nc")
    assert measured.key_offset[0].abs().max() > 1.0  # without R: head 0 centered
    covered = fit(k, v, [0, n], recipe, query=q, preset="turboquant_k3v4_nc", **{kept: n})
    assert (covered.key_offset == 0).all() and (covered.key_scale == 1).all()
