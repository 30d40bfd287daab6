"""The reference attention layer over a mixed batch: decodes first, then a first prefill chunk
and continuation chunks (short: decode_varlen; long: the dequantized prefix and the chunk's own raw
K/V through SDPA), against float64 attention over what the cache holds."""

import copy

import pytest
import torch

import turboquant as tq
from turboquant.attention import PagedAttentionLayer, StepMetadata
from turboquant.calibration import Calibration
from conftest import requires_cuda
from reference import attention_options_reference, packed_shift_reference, rel_err


def _step_meta(block_table, prev_lens, new_lens, num_decodes, block_size):
    starts = [0]
    slots = []
    for b, (p, n) in enumerate(zip(prev_lens, new_lens)):
        starts.append(starts[-1] + n)
        for t in range(p, p + n):
            slots.append(int(block_table[b, t // block_size]) * block_size + t % block_size)
    return StepMetadata(torch.tensor(starts, dtype=torch.int32), torch.tensor([p + n for p, n in zip(prev_lens, new_lens)], dtype=torch.int32),
                        block_table, torch.tensor(slots), num_decodes)


CALIBRATED = Calibration(smooth_keys=0.5, center_values=True, min_offset=0.0)


@pytest.mark.parametrize("preset,calibration", [(None, None)] + [(p, None) for p in tq.PRESETS]
                         + [(p, CALIBRATED) for p in tq.PRESETS])
def test_mixed_batch_matches_attention_over_the_cache(preset, calibration):
    """Calibrated: the cache holds transformed K/V, and every path (decode, decode_varlen, the
    dequantized prefix) must attend as over the restored K/V in the original basis."""
    torch.manual_seed(0)
    bs, hkv, hq, d = 16, 2, 8, 64
    # with the packed-logit shift, which the long chunk's dense attention applies (its own keys are raw)
    layer = PagedAttentionLayer(32, bs, hkv, d, preset, dtype=torch.float32, varlen_threshold=8, calibration=calibration,
                                shift_packed_logits=True)
    block_table = torch.arange(32, dtype=torch.int32).view(4, 8)
    # keys with a shared per-channel offset and uneven channel spreads, as real keys have
    key_offset, key_spread, value_offset = 3 * torch.randn(hkv, d), torch.rand(hkv, d) * 3 + 0.2, torch.randn(hkv, d)
    # Step 1: four first chunks (prefill from scratch).
    prev, new = [0, 0, 0, 0], [20, 9, 40, 30]
    meta = _step_meta(block_table, prev, new, 0, bs)
    t = sum(new)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d) * key_spread + key_offset, torch.randn(t, hkv, d) + value_offset
    out1 = layer.forward(q, k, v, meta, 0.125)
    first_keys = k
    for b, (s, e) in enumerate(zip(meta.query_start_loc[:-1].tolist(), meta.query_start_loc[1:].tolist())):
        for i in range(e - s):  # first chunks attend causally to their raw K/V
            kk = k[s:s + i + 1].double().repeat_interleave(hq // hkv, 1)
            vv = v[s:s + i + 1].double().repeat_interleave(hq // hkv, 1)
            sc = torch.einsum("hd,thd->ht", q[s + i].double(), kk) * 0.125
            assert rel_err(out1[s + i], torch.einsum("ht,thd->hd", sc.softmax(-1), vv)) < 1e-5
    # Step 2: two decodes, a short continuation (5 tokens) and a long one (12 > threshold 8).
    prev, new = [20, 9, 40, 30], [1, 1, 5, 12]
    meta = _step_meta(block_table, prev, new, 2, bs)
    t = sum(new)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d) * key_spread + key_offset, torch.randn(t, hkv, d) + value_offset
    out2 = layer.forward(q, k, v, meta, 0.125)
    assert (layer.transform is not None) == (calibration is not None)
    # Reference: float64 causal attention over what the cache decodes to.
    if preset is None:
        keys = layer.cache[block_table.long()].flatten(1, 2)[:, :, 0].double()
        values = layer.cache[block_table.long()].flatten(1, 2)[:, :, 1].double()
    else:
        keys, values = tq.dequantize(layer.cache, block_table, meta.seq_lens, preset, torch.float32)
        if layer.transform is not None:
            keys, values = layer.transform.restore(keys, values)
    starts = meta.query_start_loc.tolist()
    for b in range(4):
        s, e = starts[b], starts[b + 1]
        n = int(meta.seq_lens[b])
        kb, vb = keys[b, :n].double(), values[b, :n].double()
        shift = torch.zeros(e - s, hq, dtype=torch.float64)
        if e - s > 8:  # a long chunk (past the threshold) attends to its own raw K/V, and lowers the packed logits
            kb = torch.cat([kb[:n - (e - s)], k[s:e].double()])
            vb = torch.cat([vb[:n - (e - s)], v[s:e].double()])
            if preset is not None:
                shift = packed_shift_reference(q[s:e], torch.cat([first_keys, k]), layer.transform, preset, 0.125)
        for i in range(e - s):
            limit = n - (e - s) + 1 + i
            kk = kb[:limit].repeat_interleave(hq // hkv, 1)
            vv = vb[:limit].repeat_interleave(hq // hkv, 1)
            sc = torch.einsum("hd,thd->ht", q[s + i].double(), kk) * 0.125
            sc[:, :n - (e - s)] -= shift[i][:, None]
            ref = torch.einsum("ht,thd->hd", sc.softmax(-1), vv)
            assert rel_err(out2[s + i], ref) < 1e-4, (preset, b, i)


LAYER_OPTIONS = {
    "window": {"window_left": 7},
    "softcap": {"softcap": 1.0},
    "sinks": {"sinks": torch.linspace(-2.0, 3.0, 8)},
    "combined": {"window_left": 7, "softcap": 1.5, "sinks": torch.linspace(-2.0, 3.0, 8)},
}


@pytest.mark.parametrize("option", list(LAYER_OPTIONS))
@pytest.mark.parametrize("preset,calibration", [(None, None)] + [(p, None) for p in tq.PRESETS]
                         + [("turboquant_4bit_nc", CALIBRATED)])
def test_mixed_batch_with_attention_options_matches_float64(option, preset, calibration):
    """Every path of a step (first chunks on raw K/V, decodes, a short continuation through
    decode_varlen, a long one over the dequantized prefix, the plain cache) applies the window,
    the soft-cap and the sinks; calibrated, only the transformations that stay exact are fitted."""
    torch.manual_seed(0)
    bs, hkv, hq, d, scale = 16, 2, 8, 64, 0.125
    options = LAYER_OPTIONS[option]
    layer = PagedAttentionLayer(32, bs, hkv, d, preset, dtype=torch.float32, varlen_threshold=8,
                                calibration=calibration, shift_packed_logits=True, **options)
    block_table = torch.arange(32, dtype=torch.int32).view(4, 8)
    key_offset = 3 * torch.randn(hkv, d)
    raw = []
    for prev, new, decodes in (([0, 0, 0, 0], [20, 9, 40, 30], 0), ([20, 9, 40, 30], [1, 1, 5, 12], 2)):
        meta = _step_meta(block_table, prev, new, decodes, bs)
        t = sum(new)
        q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d) * 2 + key_offset, torch.randn(t, hkv, d)
        out = layer.forward(q, k, v, meta, scale)
        raw.append((meta, q, k, v, out))
    if calibration is not None:  # key centering is inexact under soft-capping and sinks: not fitted there
        centered = layer.transform.key_offset is not None
        assert centered == ("softcap" not in options and "sinks" not in options)
    if preset is None:
        keys = layer.cache[block_table.long()].flatten(1, 2)[:, :, 0]
        values = layer.cache[block_table.long()].flatten(1, 2)[:, :, 1]
    else:
        keys, values = tq.dequantize(layer.cache, block_table, raw[-1][0].seq_lens, preset, torch.float32)
        if layer.transform is not None:
            keys, values = layer.transform.restore(keys, values)
    for step, (meta, q, k, v, out) in enumerate(raw):
        starts = meta.query_start_loc.tolist()
        for b in range(4):
            s, e = starts[b], starts[b + 1]
            n = int(meta.seq_lens[b])
            kb, vb = keys[b, :n].double().clone(), values[b, :n].double().clone()
            bias = None
            if step == 0 or e - s > 8:  # first chunks and long continuations attend to their own raw K/V
                kb[n - (e - s):], vb[n - (e - s):] = k[s:e].double(), v[s:e].double()
                if step > 0 and preset is not None and option == "window":  # and lower the packed logits
                    stored = torch.cat([x[2] for x in raw[:step + 1]])
                    packed = torch.arange(n) < n - (e - s)
                    bias = -packed_shift_reference(q[s:e], stored, layer.transform, preset, scale)[..., None] * packed
            ref = attention_options_reference(q[s:e], kb[None], vb[None], [n], [e - s], scale, key_bias=bias,
                                              **options)
            assert rel_err(out[s:e], ref) < 1e-5, (step, b)


def _pure_decode_setup(preset, device, dtype=torch.float32, calibration=None):
    """A layer whose 3 sequences hold 30, 17 and 0 tokens, and the next pure-decode step: the first
    two decode one token each, the third is a padding row (slot -1, seq_len 0)."""
    bs, hkv, hq, d = 16, 2, 8, 64
    layer = PagedAttentionLayer(12, bs, hkv, d, preset, device=device, dtype=dtype, calibration=calibration)
    block_table = torch.arange(12, dtype=torch.int32).view(3, 4).to(device)
    g = torch.Generator().manual_seed(7)
    meta = _step_meta(block_table.cpu(), [0, 0], [30, 17], 0, bs)
    prefill = StepMetadata(meta.query_start_loc.to(device), meta.seq_lens.to(device), block_table[:2],
                           meta.slot_mapping.to(device), 0)
    layer.forward(*(torch.randn(47, h, d, generator=g).to(device, dtype) for h in (hq, hkv, hkv)), prefill, 0.125)
    step = StepMetadata(torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=device),
                        torch.tensor([31, 18, 0], dtype=torch.int32, device=device), block_table,
                        torch.tensor([1 * 16 + 14, 5 * 16 + 1, -1], device=device), 3)
    q, k, v = (torch.randn(3, h, d, generator=g).to(device, dtype) for h in (hq, hkv, hkv))
    return layer, step, q, k, v


@pytest.mark.parametrize("preset,calibration", [(None, None), ("turboquant_4bit_nc", None),
                                                ("turboquant_4bit_nc", CALIBRATED)])
def test_pure_decode_step_matches_attention_over_the_cache(preset, calibration):
    layer, step, q, k, v = _pure_decode_setup(preset, "cpu", calibration=calibration)
    assert calibration is None or layer.transform.key_scale is not None  # fitted on the prefill
    out = layer.forward(q, k, v, step, 0.125)
    if preset is None:
        keys = layer.cache[step.block_table.long()].flatten(1, 2)[:, :, 0]
        values = layer.cache[step.block_table.long()].flatten(1, 2)[:, :, 1]
    else:
        keys, values = tq.dequantize(layer.cache, step.block_table, step.seq_lens, preset, torch.float32)
        if calibration is not None:
            keys, values = layer.transform.restore(keys, values)
    for b, n in enumerate(step.seq_lens.tolist()):
        if n == 0:
            assert (out[b] == 0).all(), "a padding row decodes to zeros"
            continue
        kk = keys[b, :n].double().repeat_interleave(4, 1)
        vv = values[b, :n].double().repeat_interleave(4, 1)
        sc = torch.einsum("hd,thd->ht", q[b].double(), kk) * 0.125
        assert rel_err(out[b], torch.einsum("ht,thd->hd", sc.softmax(-1), vv)) < 1e-5, b


@requires_cuda
@pytest.mark.parametrize("preset,calibration", [(None, None), ("turboquant_4bit_nc", None),
                                                ("turboquant_4bit_nc", CALIBRATED)])
def test_pure_decode_step_replays_in_a_cuda_graph(preset, calibration):
    # bf16: the CUDA decode takes fp16/bf16 queries (a serving stack's dtype). Calibrated: the
    # query scale and value offset are device ops, captured with the decode.
    layer, step, q, k, v = _pure_decode_setup(preset, "cuda", torch.bfloat16, calibration)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        snapshot = layer.cache.clone()
        layer.forward(q, k, v, step, 0.125)  # warm-up outside capture
        layer.cache.copy_(snapshot)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer.forward(q, k, v, step, 0.125)
    for lens, slots in (([31, 18, 0], [30, 81, -1]), ([32, 19, 1], [31, 82, 128])):
        step.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        step.slot_mapping.copy_(torch.tensor(slots))
        for t in (q, k, v):
            t.normal_()
        before = layer.cache.clone()
        graph.replay()
        replayed, after = out.clone(), layer.cache.clone()
        layer.cache.copy_(before)
        eager = layer.forward(q, k, v, step, 0.125)
        assert torch.equal(after, layer.cache)
        torch.testing.assert_close(replayed, eager, rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("preset", tq.PRESETS)
def test_layer_over_an_engines_cache_attends_as_its_own(preset, head_major, device):
    """A serving engine (vLLM) owns the cache, stores each step's K/V itself and hands the layer a
    view (head-major next to vLLM's CPU attention) and host copies of the chunk bounds:
    ``over_cache(...).attend`` must give what the layer's own ``forward`` gives, over the same bytes."""
    torch.manual_seed(0)
    bs, hkv, hq, d, window = 16, 2, 8, 64, 23
    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # CUDA decodes take fp16/bf16 queries
    own = PagedAttentionLayer(32, bs, hkv, d, preset, device, dtype, varlen_threshold=8, window_left=window)
    engine_cache = tq.allocate_kv_cache(32, bs, hkv, d, preset, device, head_major=head_major)
    engine = PagedAttentionLayer.over_cache(engine_cache, preset, dtype, varlen_threshold=8, window_left=window)
    assert engine.head_dim == d and engine.cache is engine_cache
    block_table = torch.randperm(32, dtype=torch.int32).view(4, 8).to(device)
    for prev, new, decodes in (([0, 0, 0, 0], [20, 9, 40, 30], 0), ([20, 9, 40, 30], [1, 1, 5, 12], 2),
                               ([21, 10, 45, 42], [1, 1, 1, 1], 4)):
        meta = _step_meta(block_table.cpu(), prev, new, decodes, bs)
        meta = StepMetadata(*(t.to(device) for t in (meta.query_start_loc, meta.seq_lens)), block_table,
                            meta.slot_mapping.to(device), decodes, query_start_loc_host=meta.query_start_loc.tolist(),
                            seq_lens_host=meta.seq_lens.tolist())
        t = sum(new)
        q, k, v = (torch.randn(t, h, d, device=device, dtype=dtype) for h in (hq, hkv, hkv))
        expected = own.forward(q, k, v, meta, 0.125)
        tq.store_kv(k, v, engine.cache, meta.slot_mapping, preset)  # the engine's own store step
        torch.testing.assert_close(engine.attend(q, k, v, meta, 0.125), expected, rtol=0, atol=0)
    assert torch.equal(engine_cache, own.cache)


@pytest.mark.parametrize("preset", [None, "turboquant_4bit_nc", "turboquant_k8v4"])
def test_windowed_long_chunk_never_reads_blocks_before_its_window(preset):
    """An engine frees a sliding-window layer's blocks that lie wholly before the window (vLLM
    does): a long continuation chunk must attend as before when those blocks hold NaN bytes."""
    torch.manual_seed(0)
    bs, hkv, hq, d, window = 16, 2, 8, 64, 23
    layer = PagedAttentionLayer(16, bs, hkv, d, preset, dtype=torch.float32, varlen_threshold=8, window_left=window,
                                shift_packed_logits=True)
    block_table = torch.arange(16, dtype=torch.int32).view(1, 16)
    first = _step_meta(block_table, [0], [100], 0, bs)
    layer.forward(torch.randn(100, hq, d), torch.randn(100, hkv, d), torch.randn(100, hkv, d), first, 0.125)
    chunk = _step_meta(block_table, [100], [12], 0, bs)  # 12 > varlen_threshold: the dequantized prefix
    q, k, v = torch.randn(12, hq, d), torch.randn(12, hkv, d), torch.randn(12, hkv, d)
    clean_cache, clean_noise = layer.cache.clone(), copy.deepcopy(layer.noise)  # the chunk is stored twice
    expected = layer.forward(q, k, v, chunk, 0.125)
    layer.cache.copy_(clean_cache)
    layer.noise = clean_noise
    freed = (100 - window) // bs  # blocks 0-3 end before position 100 - 23 = 77
    if preset is None:
        layer.cache[:freed] = float("nan")
    else:
        layer.cache[:freed] = 0xFF  # fp16 norms and scales of all ones: NaN
    out = layer.forward(q, k, v, chunk, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_readme_serving_example_runs():
    import os
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "serving_step.py")
    result = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "torch.Size([2, 32, 128]) torch.bfloat16" in result.stdout
