"""CUDA ops at the head dims without tiled kernels (kernels/generic_head_dim.cu): the rotated presets at
80, 96, 112, 160, 192 (H_m (x) H_{2^k}) and small and large powers of two, FP8 keys at any multiple
of 8. The store writes the CPU's bytes exactly (the same per-element rules in the same order),
dequantize returns the CPU's floats, decode and decode_varlen, with every attention option and
split count, the CPU's attention. Skipped (saying why) without a GPU."""

import pytest
import torch

import turboquant as tq
from conftest import requires_cuda
from helpers import make_paged_batch
from reference import rel_err

pytestmark = requires_cuda

PRESETS = list(tq.PRESETS)
# Phi-3 (96), GPT-NeoX-style models (80), and the other H_m (x) H_{2^k} orders; 8 and 24 are narrower
# than a warp, 512 wider than the tiled kernels.
ROTATED_DIMS = [80, 96, 112, 160, 192, 8, 24, 512]
FP8_ONLY_DIMS = [72, 136, 200]  # multiples of 8 with no Hadamard matrix: FP8 keys only
CASES = [(p, d) for p in PRESETS for d in ROTATED_DIMS if (p, d) != ("turboquant_k8v4", 96)]  # 96: tiled for FP8
CASES += [("turboquant_k8v4", d) for d in FP8_ONLY_DIMS]
LENS = [0, 1, 37, 300, 129]
BLOCK = 16


def _cuda(*tensors):
    return [t.cuda() for t in tensors]


@pytest.mark.parametrize("preset, head_dim", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_major", [False, True])
def test_store_writes_the_cpus_bytes(preset, head_dim, dtype, head_major):
    """Every byte equal to the CPU's, including the untouched ones around the written slots (a
    poisoned cache), with padding, out-of-range and skipped slots in the mapping."""
    g = torch.Generator().manual_seed(head_dim)
    n, heads, blocks = 150, 3, 16
    key = (torch.randn(n, heads, head_dim, generator=g) * 3).to(dtype)
    value = torch.randn(n, heads, head_dim, generator=g).to(dtype)
    slots = torch.randperm(blocks * BLOCK, generator=g)[:n]
    slots[::13] = -1
    slots[4] = blocks * BLOCK + 2  # past the cache: skipped
    slot = tq.slot_layout(preset, head_dim).slot_size_aligned
    shape = (blocks, heads, BLOCK, slot) if head_major else (blocks, BLOCK, heads, slot)
    poison = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    view = (lambda t: t.transpose(1, 2)) if head_major else (lambda t: t)
    cpu, gpu = view(poison.clone()), view(poison.cuda())
    tq.store_kv(key, value, cpu, slots, preset)
    tq.store_kv(key.cuda(), value.cuda(), gpu, slots.cuda(), preset)
    assert torch.equal(gpu.cpu(), cpu)


@pytest.mark.parametrize("preset, head_dim", CASES)
def test_store_of_nan_inf_and_zero_vectors_writes_the_cpus_bytes(preset, head_dim):
    """The edge values the CPU rules define: zero and constant vectors, inf and NaN elements, an
    all-NaN value."""
    rows = [torch.zeros(head_dim), torch.full((head_dim,), 2.5), torch.randn(head_dim)]
    rows[2][3] = float("inf")
    nan_row = torch.randn(head_dim)
    nan_row[::5] = float("nan")
    rows.append(nan_row)
    rows.append(torch.full((head_dim,), float("nan")))
    x = torch.stack(rows)[:, None, :]  # [5, 1, D]
    cpu = tq.allocate_kv_cache(1, BLOCK, 1, head_dim, preset)
    gpu = cpu.cuda()
    slots = torch.arange(5)
    tq.store_kv(x, x.flip(0), cpu, slots, preset)
    tq.store_kv(x.cuda(), x.flip(0).cuda(), gpu, slots.cuda(), preset)
    assert torch.equal(gpu.cpu(), cpu)


@pytest.mark.parametrize("preset, head_dim", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_returns_the_cpus_values(preset, head_dim, dtype):
    cache, bt, sl, _, _ = make_paged_batch(LENS, BLOCK, 2, head_dim, preset, seed=head_dim)
    kc, vc = tq.dequantize(cache, bt, sl, preset, dtype)
    kg, vg = tq.dequantize(*_cuda(cache, bt, sl), preset, dtype)
    tol = 1e-6 if dtype == torch.float32 else 4e-3  # bf16: one rounding of each element either side
    assert rel_err(kg.cpu().float(), kc.float()) <= tol and rel_err(vg.cpu().float(), vc.float()) <= tol
    assert (kg[0] == 0).all() and (vg[0, :, :, :] == 0).all()  # the empty sequence


@pytest.mark.parametrize("preset, head_dim", CASES)
@pytest.mark.parametrize("group", [1, 4, 6, 8])
def test_decode_matches_cpu(preset, head_dim, group):
    """A CTA takes up to 8 query heads of a GQA group (4 past D = 128, 1 past 256): group 6 leaves
    a slice part-filled at D <= 128 and splits into 4 + 2 at D = 160 and 192."""
    heads = 2
    cache, bt, sl, _, _ = make_paged_batch(LENS, BLOCK, heads, head_dim, preset, seed=group + head_dim)
    q = torch.randn(len(LENS), heads * group, head_dim, generator=torch.Generator().manual_seed(group)).half()
    scale = head_dim ** -0.5
    ref = tq.decode(q.float(), cache, bt, sl, preset, scale)
    for num_splits in (0, 1, 3):
        out = tq.decode(*_cuda(q, cache, bt, sl), preset, scale, num_splits)
        assert not out.isnan().any() and (out[0] == 0).all()
        assert rel_err(out.float().cpu(), ref) <= 2e-3, num_splits


def _options(name: str, num_q_heads: int) -> dict:
    sinks = torch.randn(num_q_heads, generator=torch.Generator().manual_seed(5)) * 2.0
    return {"window": {"window_left": 37}, "softcap": {"softcap": 1.0}, "sinks": {"sinks": sinks},
            "combined": {"window_left": 20, "softcap": 1.5, "sinks": sinks}}[name]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("head_dim", [96, 160])
@pytest.mark.parametrize("option", ["window", "softcap", "sinks", "combined"])
def test_decode_and_varlen_options_match_cpu(preset, head_dim, option):
    cache, bt, sl, _, _ = make_paged_batch(LENS, BLOCK, 2, head_dim, preset, seed=7)
    options = _options(option, 8)
    on_gpu = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in options.items()}
    scale = 0.5 * head_dim ** -0.5 if option == "softcap" else head_dim ** -0.5
    q = torch.randn(len(LENS), 8, head_dim, generator=torch.Generator().manual_seed(3)).half()
    ref = tq.decode(q.float(), cache, bt, sl, preset, scale, **options)
    plain = tq.decode(q.float(), cache, bt, sl, preset, scale)
    assert rel_err(plain, ref) > 1e-3, "the option must change the result for this case to test anything"
    for num_splits in (0, 1, 3):
        out = tq.decode(*_cuda(q, cache, bt, sl), preset, scale, num_splits, **on_gpu)
        assert rel_err(out.float().cpu(), ref) <= 2e-3, num_splits
    # Varlen: the last q_len tokens of each sequence as one chunk (0, 1, 5, 17 and 3 tokens).
    q_lens = [0, 1, 5, 17, 3]
    starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    qv = torch.randn(sum(q_lens), 8, head_dim, generator=torch.Generator().manual_seed(4)).half()
    ref = tq.decode_varlen(qv.float(), cache, bt, sl, starts, preset, scale, **options)
    for num_splits in (0, 1, 3):
        out = tq.decode_varlen(*_cuda(qv, cache, bt, sl, starts), preset, scale, num_splits, **on_gpu)
        assert rel_err(out.float().cpu(), ref) <= 2e-3, num_splits


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
def test_windowed_decode_reads_only_the_window(preset):
    """Blocks wholly before every query's window filled with 0xFF (NaN norms and scales): a decode
    that read them would return NaN."""
    head_dim, window = 96, 40
    cache, bt, sl, _, _ = make_paged_batch([300, 200], BLOCK, 2, head_dim, preset, seed=2)
    q = torch.randn(2, 4, head_dim).half()
    clean = tq.decode(*_cuda(q, cache, bt, sl), preset, 0.1, window_left=window)
    poisoned = cache.clone()
    for b, n in enumerate(sl.tolist()):
        first_block_needed = (n - 1 - window) // BLOCK
        poisoned[bt[b, :first_block_needed].long()] = 0xFF
    for num_splits in (0, 1, 3):
        dirty = tq.decode(*_cuda(q, poisoned, bt, sl), preset, 0.1, num_splits, window_left=window)
        assert not dirty.isnan().any()
        assert rel_err(dirty.float(), clean.float()) <= 1e-3


def test_graph_replay_of_a_generic_decode_with_changing_lengths():
    """The generic decode's grid and split plan depend on shapes only: one captured graph serves
    every length."""
    preset, head_dim = "turboquant_k3v4_nc", 96
    cache, bt, sl, _, _ = make_paged_batch([2000, 50, 700], BLOCK, 2, head_dim, preset)
    cache, bt, seq_lens = cache.cuda(), bt.cuda(), sl.cuda().clone()
    q = torch.randn(3, 8, head_dim, device="cuda", dtype=torch.bfloat16)
    tq.decode(q, cache, bt, seq_lens, preset, 0.1)  # one-time set-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tq.decode(q, cache, bt, seq_lens, preset, 0.1)
    for lens in ([2000, 50, 700], [1, 0, 333], [1999, 1000, 16]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.normal_()
        graph.replay()
        torch.testing.assert_close(out, tq.decode(q, cache, bt, seq_lens, preset, 0.1), rtol=0, atol=0)
