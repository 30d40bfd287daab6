"""torch.library.opcheck on a small subset, and one torch.compile(fullgraph=True) step."""

import pytest
import torch

import turboquant  # noqa: F401  (registers torch.ops.turboquant)
from helpers import make_paged_batch

P = "turboquant_k3v4_nc"


@pytest.fixture(autouse=True)
def _no_inference_mode():
    # opcheck and dynamo need autograd-visible tensors; override the suite's inference_mode.
    with torch.inference_mode(False):
        yield


def test_opcheck_store_decode_dequantize():
    cache, bt, sl, _, _ = make_paged_batch([20, 7], 16, 2, 64, P)
    cache = cache.clone()
    key = torch.randn(3, 2, 64)
    torch.library.opcheck(torch.ops.turboquant.store_kv.default,
                          (key, key.clone(), cache, torch.tensor([1, -1, 40], dtype=torch.int32), P))
    q = torch.randn(2, 4, 64)
    torch.library.opcheck(torch.ops.turboquant.decode.default, (q, cache, bt, sl, P, 0.125, 2))
    starts = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    torch.library.opcheck(torch.ops.turboquant.decode_varlen.default, (q, cache, bt, sl, starts, P, 0.125, 2))
    sinks = torch.randn(4)  # the attention options: window, softcap, sinks
    torch.library.opcheck(torch.ops.turboquant.decode.default, (q, cache, bt, sl, P, 0.125, 2, 5, 1.5, sinks))
    torch.library.opcheck(torch.ops.turboquant.decode_lse.default, (q, cache, bt, sl, P, 0.125, 2, 5, 1.5, sinks))
    torch.library.opcheck(torch.ops.turboquant.decode_varlen.default,
                          (q, cache, bt, sl, starts, P, 0.125, 0, 5, 1.5, sinks))
    torch.library.opcheck(torch.ops.turboquant.dequantize.default, (cache, bt, sl, P, torch.float32),
                          test_utils=("test_schema", "test_faketensor"))
    out = torch.empty(2, 24, 2, 64)
    torch.library.opcheck(torch.ops.turboquant.dequantize_into.default, (cache, bt, sl, P, out, torch.empty_like(out)))
    # The per-head transforms (key_offset, key_scale, value_offset) on every op.
    t = (torch.randn(2, 64), torch.rand(2, 64) + 0.5, torch.randn(2, 64))
    torch.library.opcheck(torch.ops.turboquant.store_kv.default,
                          (key, key.clone(), cache, torch.tensor([1, -1, 40], dtype=torch.int32), P, *t))
    torch.library.opcheck(torch.ops.turboquant.decode.default, (q, cache, bt, sl, P, 0.125, 2, 5, 0.0, None, *t))
    torch.library.opcheck(torch.ops.turboquant.decode_lse.default, (q, cache, bt, sl, P, 0.125, 2, -1, 0.0, None, *t))
    torch.library.opcheck(torch.ops.turboquant.decode_varlen.default,
                          (q, cache, bt, sl, starts, P, 0.125, 0, 5, 0.0, None, *t))
    torch.library.opcheck(torch.ops.turboquant.dequantize.default, (cache, bt, sl, P, torch.float32, *t),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.turboquant.dequantize_into.default,
                          (cache, bt, sl, P, out, torch.empty_like(out), *t))


def test_compile_fullgraph_store_then_decode():
    cache, bt, sl, _, _ = make_paged_batch([20, 7], 16, 2, 64, P)
    cache = cache.clone()
    expected_cache = cache.clone()

    def step(q, k, v, slots, kv_cache, block_table, seq_lens):
        torch.ops.turboquant.store_kv(k, v, kv_cache, slots, P)
        return torch.ops.turboquant.decode(q, kv_cache, block_table, seq_lens, P, 0.125, 0) * 2.0

    q, k, v = torch.randn(2, 4, 64), torch.randn(2, 2, 64), torch.randn(2, 2, 64)
    slots = torch.tensor([bt[0, 1].item() * 16 + 4, bt[1, 0].item() * 16 + 7], dtype=torch.int64)
    lens = sl + 1
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v, slots, cache, bt, lens)
    ref = step(q, k, v, slots, expected_cache, bt, lens)
    torch.testing.assert_close(out, ref)
    assert torch.equal(cache, expected_cache)
