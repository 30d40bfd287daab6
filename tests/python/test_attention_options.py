"""Sliding windows, logit soft-capping and attention sinks on decode and decode_varlen, against
float64 attention written from the options' definitions (reference.attention_options_reference)."""

import pytest
import torch

import turboquant as tq
from conftest import requires_cuda
from helpers import make_paged_batch
from reference import attention_options_reference, rel_err

PRESETS = list(tq.PRESETS)
HKV, D, BLOCK = 2, 64, 16
SCALE = 0.125  # random unit-variance q and k at D = 64: logits of standard deviation 1
# Lengths around the window (37 + 1 tokens seen), an empty sequence and ones many tiles past it.
DECODE_LENS = [0, 1, 5, 37, 38, 39, 100, 300]
WINDOW = 37


def options_for(name: str, num_q_heads: int, seed: int = 0) -> dict:
    """The options a test case runs with; sinks drawn on a scale that moves the softmax noticeably."""
    g = torch.Generator().manual_seed(seed)
    sinks = torch.randn(num_q_heads, generator=g) * 2.0
    return {
        "window": {"window_left": WINDOW},
        "window_self_only": {"window_left": 0},
        "softcap": {"softcap": 1.0},
        "sinks": {"sinks": sinks},
        "combined": {"window_left": WINDOW, "softcap": 1.5, "sinks": sinks},
    }[name]


OPTION_NAMES = ["window", "window_self_only", "softcap", "sinks", "combined"]


def _decode_case(preset: str, group: int, dtype=torch.float32, seed: int = 0):
    cache, bt, sl, _, _ = make_paged_batch(DECODE_LENS, BLOCK, HKV, D, preset, seed=seed)
    keys, values = tq.dequantize(cache, bt, sl, preset, torch.float32)
    query = torch.randn(len(DECODE_LENS), HKV * group, D, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return cache, bt, sl, keys, values, query


def _reference(query, keys, values, seq_lens, q_lens, options):
    return attention_options_reference(query.float(), keys, values, seq_lens, q_lens, SCALE, **options)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("option", OPTION_NAMES)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_decode_options_match_float64(preset, option, group):
    cache, bt, sl, keys, values, query = _decode_case(preset, group)
    options = options_for(option, query.shape[1])
    ref = _reference(query, keys, values, sl, [1] * len(DECODE_LENS), options)
    for num_splits in (0, 1, 3):
        out = tq.decode(query, cache, bt, sl, preset, SCALE, num_splits, **options)
        assert rel_err(out, ref) < 1e-5, num_splits
    plain = tq.decode(query, cache, bt, sl, preset, SCALE)
    assert rel_err(plain, ref) > 1e-3, "the option must change the result for this case to test anything"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_decode_options_every_query_dtype(dtype):
    preset = "turboquant_4bit_nc"
    cache, bt, sl, keys, values, query = _decode_case(preset, 4, dtype)
    options = options_for("combined", query.shape[1])
    out = tq.decode(query, cache, bt, sl, preset, SCALE, **options)
    assert out.dtype == dtype
    ref = _reference(query, keys, values, sl, [1] * len(DECODE_LENS), options)
    assert rel_err(out, ref) < {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}[dtype]


def test_decode_window_edges():
    """A window as long as the context, and one longer, equal the causal decode; window 0 attends
    to the last token alone, so the output is its value."""
    preset = "turboquant_k8v4"
    cache, bt, sl, keys, values, query = _decode_case(preset, 2)
    causal = tq.decode(query, cache, bt, sl, preset, SCALE)
    for window_left in (max(DECODE_LENS) - 1, 10 ** 6):
        torch.testing.assert_close(tq.decode(query, cache, bt, sl, preset, SCALE, window_left=window_left), causal,
                                   rtol=0, atol=0)
    self_only = tq.decode(query, cache, bt, sl, preset, SCALE, window_left=0)
    for b, n in enumerate(DECODE_LENS):
        expected = values[b, n - 1].repeat_interleave(2, dim=0) if n > 0 else torch.zeros_like(self_only[b])
        torch.testing.assert_close(self_only[b], expected, rtol=1e-6, atol=1e-6)


def test_decode_sinks_keep_an_empty_context_at_zeros_and_a_large_sink_takes_the_weight():
    preset = "turboquant_4bit_nc"
    cache, bt, sl, keys, values, query = _decode_case(preset, 4)
    out = tq.decode(query, cache, bt, sl, preset, SCALE, sinks=torch.full((query.shape[1],), 50.0))
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # no tokens: the sink takes all the weight
    assert out[1:].abs().max() < 1e-12  # a sink of e^50 outweighs every token's e^(~1)


VARLEN_LENS, VARLEN_Q = [70, 5, 33, 128, 40, 300], [4, 5, 1, 16, 0, 9]


def _varlen_case(preset: str, group: int, seed: int = 0):
    cache, bt, sl, _, _ = make_paged_batch(VARLEN_LENS, BLOCK, HKV, D, preset, seed=seed)
    keys, values = tq.dequantize(cache, bt, sl, preset, torch.float32)
    starts = torch.tensor([0] + torch.tensor(VARLEN_Q).cumsum(0).tolist(), dtype=torch.int32)
    query = torch.randn(int(starts[-1]), HKV * group, D, generator=torch.Generator().manual_seed(seed + 1))
    return cache, bt, sl, keys, values, starts, query


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("option", OPTION_NAMES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_varlen_options_match_float64(preset, option, group):
    """A window counts back from each query token's own position."""
    cache, bt, sl, keys, values, starts, query = _varlen_case(preset, group)
    options = options_for(option, query.shape[1])
    ref = _reference(query, keys, values, sl, VARLEN_Q, options)
    for num_splits in (0, 1, 3):
        out = tq.decode_varlen(query, cache, bt, sl, starts, preset, SCALE, num_splits, **options)
        assert rel_err(out, ref) < 1e-5, num_splits


def _poison_before_windows(cache, bt, seq_lens, q_lens, window_left):
    """The cache with 0xFF bytes (NaN norms, scales and zeros) in every block that lies wholly before
    the window of each sequence's first query token: a decode that read them would return NaN."""
    poisoned = cache.clone()
    for b, (n, m) in enumerate(zip(seq_lens.tolist(), q_lens)):
        first = max(n - m - window_left, 0)  # the first query token's window starts here
        whole_blocks = first // BLOCK
        if whole_blocks:
            poisoned[bt[b, :whole_blocks].long()] = 255
    return poisoned


@pytest.mark.parametrize("preset", PRESETS)
def test_windowed_decode_reads_only_the_window(preset):
    cache, bt, sl, keys, values, query = _decode_case(preset, 4)
    poisoned = _poison_before_windows(cache, bt, sl, [1] * len(DECODE_LENS), WINDOW)
    assert not torch.equal(poisoned, cache)
    for num_splits in (0, 1, 3):
        clean = tq.decode(query, cache, bt, sl, preset, SCALE, num_splits, window_left=WINDOW)
        torch.testing.assert_close(tq.decode(query, poisoned, bt, sl, preset, SCALE, num_splits, window_left=WINDOW),
                                   clean, rtol=0, atol=0)


def test_options_bad_input_name_the_argument():
    preset = "turboquant_4bit_nc"
    cache, bt, sl, _, _, query = _decode_case(preset, 2)
    hq = query.shape[1]
    cases = [
        ({"window_left": -2}, "window_left"),
        ({"softcap": -1.0}, r"softcap must be 0 \(no soft-capping\) or a finite number in .*, got -1$"),
        ({"softcap": float("nan")}, "softcap .*, got nan$"),
        ({"softcap": float("inf")}, "softcap .*, got inf$"),
        ({"softcap": 1e-40}, "softcap .*, got 1e-40$"),  # rounds to 0 as the kernels' float
        ({"softcap": 1e39}, "softcap .*, got 1e[+]39$"),
        ({"sinks": torch.zeros(hq, dtype=torch.float16)}, "sinks must be float32"),
        ({"sinks": torch.zeros(hq + 1)}, "sinks must be 1-D"),
        ({"sinks": torch.zeros(1, hq)}, "sinks must be 1-D"),
        ({"sinks": torch.zeros(2 * hq)[::2]}, "sinks must be contiguous"),
    ]
    starts = torch.arange(query.shape[0] + 1, dtype=torch.int32)
    for options, message in cases:
        with pytest.raises(RuntimeError, match=message):
            tq.decode(query, cache, bt, sl, preset, SCALE, **options)
        with pytest.raises(RuntimeError, match=message):
            tq.decode_varlen(query, cache, bt, sl, starts, preset, SCALE, **options)


# ---- CUDA: the per-head kernel serves every decode with options ------------------------------------
def _cuda(*tensors):
    return [t.cuda() for t in tensors]


@requires_cuda
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("option", OPTION_NAMES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_cuda_decode_options_match_cpu(preset, option, group):
    cache, bt, sl, keys, values, query = _decode_case(preset, group, torch.float16)
    options = options_for(option, query.shape[1])
    ref = tq.decode(query, cache, bt, sl, preset, SCALE, **options).float()
    cuda_options = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in options.items()}
    for num_splits in (0, 1, 2, 3):
        out = tq.decode(*_cuda(query, cache, bt, sl), preset, SCALE, num_splits, **cuda_options)
        assert rel_err(out.float().cpu(), ref) <= 2e-3, num_splits


@requires_cuda
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("option", OPTION_NAMES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_cuda_decode_varlen_options_match_cpu(preset, option, group):
    cache, bt, sl, keys, values, starts, query = _varlen_case(preset, group)
    query = query.half()
    options = options_for(option, query.shape[1])
    ref = tq.decode_varlen(query, cache, bt, sl, starts, preset, SCALE, **options).float()
    cuda_options = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in options.items()}
    for num_splits in (0, 1, 3):
        out = tq.decode_varlen(*_cuda(query, cache, bt, sl, starts), preset, SCALE, num_splits, **cuda_options)
        assert rel_err(out.float().cpu(), ref) <= 2e-3, num_splits


@requires_cuda
@pytest.mark.parametrize("preset", PRESETS)
def test_cuda_windowed_decode_reads_only_the_window(preset):
    cache, bt, sl, keys, values, query = _decode_case(preset, 4, torch.bfloat16)
    poisoned = _poison_before_windows(cache, bt, sl, [1] * len(DECODE_LENS), WINDOW)
    q, bt_c, sl_c = _cuda(query, bt, sl)
    for num_splits in (0, 1, 3):
        clean = tq.decode(q, cache.cuda(), bt_c, sl_c, preset, SCALE, num_splits, window_left=WINDOW)
        dirty = tq.decode(q, poisoned.cuda(), bt_c, sl_c, preset, SCALE, num_splits, window_left=WINDOW)
        torch.testing.assert_close(dirty, clean, rtol=0, atol=0)


@requires_cuda
def test_cuda_decode_refuses_sinks_on_another_device():
    cache, bt, sl, _, _, query = _decode_case("turboquant_4bit_nc", 2)
    with pytest.raises(RuntimeError, match="query and sinks must be on the same device"):
        tq.decode(*_cuda(query, cache, bt, sl), "turboquant_4bit_nc", SCALE, sinks=torch.zeros(query.shape[1]))


@requires_cuda
def test_cuda_graph_of_a_windowed_decode_with_sinks_and_changing_lengths():
    """The split plan of a windowed decode depends on shapes only: one captured graph serves every
    length. A 512-token window over 3,000-token sequences plans several splits: each replay also
    matches the CPU reference."""
    preset = "turboquant_4bit_nc"
    cache, bt, sl, _, _ = make_paged_batch([3000, 50, 1200, 17], BLOCK, HKV, 128, preset)
    cache, bt, seq_lens = cache.cuda(), bt.cuda(), sl.cuda().clone()
    q = torch.randn(4, 8, 128, device="cuda", dtype=torch.bfloat16)
    options = {"window_left": 511, "softcap": 30.0, "sinks": torch.randn(8, device="cuda")}
    tq.decode(q, cache, bt, seq_lens, preset, 0.1, **options)  # one-time set-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tq.decode(q, cache, bt, seq_lens, preset, 0.1, **options)
    for lens in ([3000, 50, 1200, 17], [1, 0, 600, 17], [2999, 512, 513, 1]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.normal_()
        graph.replay()
        torch.testing.assert_close(out, tq.decode(q, cache, bt, seq_lens, preset, 0.1, **options), rtol=0, atol=0)
        cpu_options = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in options.items()}
        ref = tq.decode(q.cpu(), cache.cpu(), bt.cpu(), seq_lens.cpu(), preset, 0.1, **cpu_options)
        assert rel_err(out.float().cpu(), ref.float()) <= 1e-2  # bf16 queries and outputs
