"""Exact tokens (turboquant.recent): each sequence's last R positions (``exact_recent``) and its first
F (``exact_first``, a calibrated layer's sinks) attend with their raw K/V, the others on the packed
cache, on every path of a step (decodes merged by log-sum-exp, continuation chunks over a
dequantized prefix with the raw ones put back), with the attention options and calibration;
against float64 attention over exactly those K/V, and with the packed-logit shift
(turboquant.packed_noise) against float64 attention with the packed logits lowered by it."""

import dataclasses

import pytest
import torch

import turboquant as tq
from turboquant.attention import PagedAttentionLayer, StepMetadata
from turboquant.calibration import Calibration
from turboquant.recent import merge_by_lse
from conftest import requires_cuda
from reference import attention_options_reference, packed_shift_reference, rel_err

BS, HKV, HQ, D, SCALE, R = 16, 2, 8, 64, 0.125, 8
OPTIONS = {
    "plain": {},
    "window": {"window_left": 12},  # reaches past the exact tokens
    "short_window": {"window_left": 5},  # lies among them
    "softcap": {"softcap": 1.0},
    "sinks": {"sinks": torch.randn(HQ, generator=torch.Generator().manual_seed(2))},
}
CALIBRATED = Calibration(smooth_keys=0.5, center_values=True, min_offset=0.0, measure=False)


def _meta(block_table, prev, new, decodes):
    starts, slots = [0], []
    for b, (p, n) in enumerate(zip(prev, new)):
        starts.append(starts[-1] + n)
        slots += [int(block_table[b, t // BS]) * BS + t % BS for t in range(p, p + n)]
    return StepMetadata(torch.tensor(starts, dtype=torch.int32), torch.tensor([p + n for p, n in zip(prev, new)],
                        dtype=torch.int32), block_table, torch.tensor(slots), decodes,
                        sequence_ids=torch.arange(len(prev)), num_sequences=len(prev))


def _on(meta, device):
    return dataclasses.replace(meta, **{f: getattr(meta, f).to(device) for f in (
        "query_start_loc", "seq_lens", "block_table", "slot_mapping", "sequence_ids")})


# (first, last) positions kept exact: the last R; the first block and the last R (their ranges meet
# in the 22-token sequence); the first block alone (the 7-token sequence lies inside it)
KEPT = [(0, R), (BS, R), (BS, 0)]


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k3v4_nc"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("calibration", [None, CALIBRATED])
@pytest.mark.parametrize("first,recent", KEPT)
def test_every_path_attends_to_the_kept_positions_exactly(preset, option, calibration, first, recent):
    _check_every_path(preset, option, calibration, "cpu", torch.float32, 1e-5, first, recent)


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("calibration", [None, CALIBRATED])
@pytest.mark.parametrize("first,recent", KEPT)
def test_with_the_packed_logit_shift_every_path_lowers_the_packed_logits(option, calibration, first, recent):
    """``shift_packed_logits=True``: the packed keys' logits lowered by their expected noise where raw
    ones share the softmax (none under soft-capping or sinks)."""
    _check_every_path("turboquant_k3v4_nc", option, calibration, "cpu", torch.float32, 1e-5, first, recent, shift=True)


def test_the_reference_tells_a_layer_that_does_not_shift_from_one_that_does():
    """Control: the shift is large enough against the tolerance for the test above to see it."""
    with pytest.raises(AssertionError):
        _check_every_path("turboquant_k3v4_nc", "plain", None, "cpu", torch.float32, 1e-5, BS, R, shift=False,
                          reference_shift=True)


def _check_every_path(preset, option, calibration, device, dtype, tolerance, first=0, recent=R, shift=False,
                      reference_shift=None):
    torch.manual_seed(0)
    options = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in OPTIONS[option].items()}
    layer = PagedAttentionLayer(32, BS, HKV, D, preset, device=device, dtype=dtype, varlen_threshold=8,
                                calibration=calibration, exact_recent=recent, exact_first=first,
                                shift_packed_logits=shift, **options)
    options = OPTIONS[option]  # the reference's, on the CPU
    block_table = torch.arange(32, dtype=torch.int32).view(4, 8)
    offset = 3 * torch.randn(HKV, D)
    raw_k, raw_v = torch.zeros(4, 128, HKV, D), torch.zeros(4, 128, HKV, D)
    steps = []
    # first chunks; 2 decodes + a short and a long continuation (both over the dequantized prefix);
    # a pure decode step
    for prev, new, decodes in (([0, 0, 0, 0], [20, 5, 40, 30], 0), ([20, 5, 40, 30], [1, 1, 5, 12], 2),
                               ([21, 6, 45, 42], [1, 1, 1, 1], 4)):
        meta = _meta(block_table, prev, new, decodes)
        t = sum(new)
        q, k, v = torch.randn(t, HQ, D), torch.randn(t, HKV, D) * 2 + offset, torch.randn(t, HKV, D)
        q, k, v = (x.to(dtype).float() for x in (q, k, v))  # what the layer gets, for the reference
        starts = meta.query_start_loc.tolist()
        for b in range(4):
            raw_k[b, prev[b]:prev[b] + new[b]], raw_v[b, prev[b]:prev[b] + new[b]] = k[starts[b]:starts[b + 1]], v[starts[b]:starts[b + 1]]
        on_device = [x.to(device, dtype) for x in (q, k, v)]
        steps.append((meta, q, layer.forward(*on_device, _on(meta, device), SCALE).float().cpu()))
    keys, values = tq.dequantize(layer.cache, block_table.to(device), steps[-1][0].seq_lens.to(device), preset,
                                 torch.float32)
    if layer.transform is not None:
        keys, values = layer.transform.restore(keys, values)
    keys, values = keys.cpu(), values.cpu()
    shift = shift if reference_shift is None else reference_shift
    shifts = shift and option not in ("softcap", "sinks")  # where the layer lowers packed logits
    for i, (meta, q, out) in enumerate(steps):
        starts = meta.query_start_loc.tolist()
        lens = meta.seq_lens.tolist()
        stored = torch.cat([raw_k[b, :lens[b]] for b in range(4)])  # every key stored up to this step
        for b in range(4):
            s, e = starts[b], starts[b + 1]
            n = int(meta.seq_lens[b])
            kb, vb = keys[b, :n].double().clone(), values[b, :n].double().clone()
            packed = torch.ones(n, dtype=torch.bool)
            # exact: a first chunk all of it; a decode its last R positions (itself one of them); a
            # continuation chunk its own tokens and the R before them; every step the first F
            own = e - s if e - s > 1 else 0
            for exact in (slice(0, n) if i == 0 else slice(max(n - recent - own, 0), n), slice(0, min(first, n))):
                kb[exact], vb[exact] = raw_k[b, exact].double(), raw_v[b, exact].double()
                packed[exact] = False
            bias = None
            if shifts:
                bias = -packed_shift_reference(q[s:e], stored, layer.transform, preset, SCALE)[..., None] * packed
            ref = attention_options_reference(q[s:e], kb[None], vb[None], [n], [e - s], SCALE, key_bias=bias,
                                              **options)
            assert rel_err(out[s:e], ref) < tolerance, (i, b)


def test_merge_by_lse_is_attention_over_the_union():
    g = torch.Generator().manual_seed(0)
    s, v = torch.randn(3, 4, 10, generator=g), torch.randn(3, 4, 10, 5, generator=g)
    whole = torch.einsum("bhn,bhnd->bhd", s.softmax(-1), v)
    part = lambda sl: (torch.einsum("bhn,bhnd->bhd", s[..., sl].softmax(-1), v[..., sl, :]), s[..., sl].logsumexp(-1))
    merged = merge_by_lse(*part(slice(0, 7)), *part(slice(7, 10)))
    torch.testing.assert_close(merged, whole, rtol=1e-6, atol=1e-6)
    empty = (torch.zeros(3, 4, 5), torch.full((3, 4), float("-inf")))
    torch.testing.assert_close(merge_by_lse(*empty, *part(slice(0, 10))), whole, rtol=1e-6, atol=1e-6)
    assert merge_by_lse(*empty, *empty).eq(0).all()  # nothing on either side: zeros, as the ops give


@pytest.mark.parametrize("kept", [{"exact_recent": 4}, {"exact_first": BS}])
def test_a_layer_with_exact_tokens_needs_the_steps_sequence_ids(kept):
    layer = PagedAttentionLayer(4, BS, HKV, D, "turboquant_4bit_nc", dtype=torch.float32, **kept)
    meta = _meta(torch.arange(4, dtype=torch.int32).view(1, 4), [0], [3], 0)
    meta.sequence_ids = None
    with pytest.raises(ValueError, match="exact_recent or exact_first needs steps that name their sequences"):
        layer.forward(torch.randn(3, HQ, D), torch.randn(3, HKV, D), torch.randn(3, HKV, D), meta, SCALE)


@pytest.mark.parametrize("bad", [-1, 2.5, True])
def test_bad_exact_recent_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="exact_recent must be an int >= 0"):
        PagedAttentionLayer(4, BS, HKV, D, "turboquant_4bit_nc", exact_recent=bad)


@pytest.mark.parametrize("bad", [-BS, 8, 2.5, True])
def test_exact_first_that_is_not_whole_blocks_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"exact_first must be a multiple of block_size \(16\)"):
        PagedAttentionLayer(4, BS, HKV, D, "turboquant_4bit_nc", exact_first=bad)
