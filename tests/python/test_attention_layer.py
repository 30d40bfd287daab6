"""The reference attention layer over a mixed batch: decodes first, then a first prefill chunk
and continuation chunks (short: decode_varlen; long: dequantize + SDPA), against float64 attention
over what the cache holds."""

import pytest
import torch

import turboquant as tq
from turboquant.attention import PagedAttentionLayer, StepMetadata
from reference import rel_err


def _step_meta(block_table, prev_lens, new_lens, num_decodes, block_size):
    starts = [0]
    slots = []
    for b, (p, n) in enumerate(zip(prev_lens, new_lens)):
        starts.append(starts[-1] + n)
        for t in range(p, p + n):
            slots.append(int(block_table[b, t // block_size]) * block_size + t % block_size)
    return StepMetadata(torch.tensor(starts, dtype=torch.int32), torch.tensor([p + n for p, n in zip(prev_lens, new_lens)], dtype=torch.int32),
                        block_table, torch.tensor(slots), num_decodes)


@pytest.mark.parametrize("preset", [None] + list(tq.PRESETS))
def test_mixed_batch_matches_attention_over_the_cache(preset):
    torch.manual_seed(0)
    bs, hkv, hq, d = 16, 2, 8, 64
    layer = PagedAttentionLayer(32, bs, hkv, d, preset, dtype=torch.float32, varlen_threshold=8)
    block_table = torch.arange(32, dtype=torch.int32).view(4, 8)
    # Step 1: four first chunks (prefill from scratch).
    prev, new = [0, 0, 0, 0], [20, 9, 40, 30]
    meta = _step_meta(block_table, prev, new, 0, bs)
    t = sum(new)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    out1 = layer.forward(q, k, v, meta, 0.125)
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
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    out2 = layer.forward(q, k, v, meta, 0.125)
    # Reference: float64 causal attention over what the cache decodes to.
    if preset is None:
        keys = layer.cache[block_table.long()].flatten(1, 2)[:, :, 0].double()
        values = layer.cache[block_table.long()].flatten(1, 2)[:, :, 1].double()
    else:
        keys, values = tq.dequantize(layer.cache, block_table, meta.seq_lens, preset, torch.float32)
    starts = meta.query_start_loc.tolist()
    for b in range(4):
        s, e = starts[b], starts[b + 1]
        n = int(meta.seq_lens[b])
        for i in range(e - s):
            limit = n - (e - s) + 1 + i
            kk = keys[b, :limit].double().repeat_interleave(hq // hkv, 1)
            vv = values[b, :limit].double().repeat_interleave(hq // hkv, 1)
            sc = torch.einsum("hd,thd->ht", q[s + i].double(), kk) * 0.125
            ref = torch.einsum("ht,thd->hd", sc.softmax(-1), vv)
            assert rel_err(out2[s + i], ref) < 1e-4, (preset, b, i)


def test_readme_serving_example_runs():
    import os
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "serving_step.py")
    result = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "torch.Size([2, 32, 128]) torch.bfloat16" in result.stdout
