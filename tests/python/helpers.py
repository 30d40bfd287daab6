"""Builders shared by the pytest modules: random paged caches, block tables, slot comparison."""

from __future__ import annotations

import torch

import turboquant as tq
from reference import encode_slot_reference, half_value, key_norm_reference, unpack_bits


def make_paged_batch(seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, preset: str,
                     device="cpu", dtype=torch.float32, head_major=False, seed=0, extra_blocks=3, dense=False):
    """Random K/V for every sequence stored through store_kv into shuffled blocks.

    Returns (kv_cache, block_table, seq_lens tensor, keys, values): with `dense`, the raw K/V as
    [B, L, Hkv, D] float32 (zero past each length), else None for both. Most tests compare against
    the stored cache, and the padded copies were most of a large batch's set-up (150 sequences of
    up to 3000 tokens: 3.7 GB zeroed and filled per call). The cache is the same either way.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [max(1, -(-n // block_size)) for n in seq_lens]
    width = max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + extra_blocks
    order = torch.randperm(num_blocks, generator=g)
    cache = tq.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, preset, device, head_major)
    block_table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    max_len = max(max(seq_lens), 1)
    keys = torch.zeros(len(seq_lens), max_len, num_kv_heads, head_dim) if dense else None
    values = torch.zeros_like(keys) if dense else None
    used = 0
    for b, n in enumerate(seq_lens):
        ids = order[used:used + blocks_per_seq[b]]
        used += blocks_per_seq[b]
        block_table[b, :len(ids)] = ids.to(torch.int32)
        if n == 0:
            continue
        k = torch.randn(n, num_kv_heads, head_dim, generator=g)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g)
        pos = torch.arange(n)
        slots = block_table[b, pos // block_size].to(torch.int64) * block_size + pos % block_size
        tq.store_kv(k.to(device, dtype), v.to(device, dtype), cache, slots.to(device), preset)
        if dense:
            keys[b, :n], values[b, :n] = k.to(dtype).float(), v.to(dtype).float()
    return (cache, block_table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device), keys, values)


def compare_slot(got: bytes, key: torch.Tensor, value: torch.Tensor, preset: str) -> tuple[int, int]:
    """Asserts one stored slot equals the reference encoding. Returns (index mismatches inside the
    ambiguity band, indices compared). Value bytes, FP8 keys and every unambiguous key index must
    match exactly; the fp16 key norm within one unit in the last place of the reference's norm for
    the stored indices (a flipped index changes the centroid vector's norm, hence the corrected one)."""
    info = tq.preset_info(preset)
    layout = tq.slot_layout(preset, key.numel())
    want, ambiguous = encode_slot_reference(key, value, preset)
    got = bytes(got)
    vo = layout.value_data_offset
    assert got[vo:layout.slot_size] == want[vo:layout.slot_size], "value bytes differ"
    if info.key_format == "fp8_e4m3":
        assert got[:layout.key_data_bytes] == want[:layout.key_data_bytes], "fp8 key bytes differ"
        return 0, key.numel()
    d = key.numel()
    gi = torch.tensor(unpack_bits(got[:layout.key_data_bytes], d, info.key_bits))
    wi = torch.tensor(unpack_bits(want[:layout.key_data_bytes], d, info.key_bits))
    differ = gi != wi
    assert not (differ & ~ambiguous).any(), f"key indices differ away from a midpoint at {torch.nonzero(differ & ~ambiguous).flatten().tolist()}"
    no = layout.key_norm_offset
    want_norm = key_norm_reference(key, gi, preset) if differ.any() else want[no:no + 2]
    gn = torch.tensor(list(got[no:no + 2]), dtype=torch.uint8).view(torch.int16).item()
    wn = torch.tensor(list(want_norm), dtype=torch.uint8).view(torch.int16).item()
    assert abs(gn - wn) <= 1, f"key norm {half_value(got[no:no+2])} vs {half_value(want_norm)}"
    return int(differ.sum()), d


def slot_bytes(cache: torch.Tensor, slot: int, head: int) -> bytes:
    block_size = cache.shape[1]
    return bytes(cache[slot // block_size, slot % block_size, head].cpu().tolist())


def store_fp16_extremes(preset: str, head_dim: int = 128):
    """One token whose key and value alternate -65504 / +65504 (the fp16 limits), stored on the CPU.
    Returns (kv_cache, block_table, seq_lens) for reading it back."""
    value = torch.full((1, 1, head_dim), 65504.0)
    value[..., ::2] = -65504.0
    cache = tq.allocate_kv_cache(1, 16, 1, head_dim, preset)
    tq.store_kv(value.half(), value.half(), cache, torch.zeros(1, dtype=torch.int32), preset)
    return cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)


def poison_next_allocations(out_like: torch.Tensor, workspace: bool = False, splits: int = 0) -> None:
    """NaN left in freed blocks of the caching allocator that the next allocations reuse: one of
    out_like's size (the output takes it) and, with `workspace`, ~1 MB of the small pool and 8 MB of
    the large one (a split workspace comes from either, by its size), and where the split count is
    known (`splits` > 0, out_like a decode's [rows, Hq, D] query) blocks of the workspace's exact
    sizes, which larger workspaces (hundreds of MB at 256 splits) take first. An output element,
    log-sum-exp or partial vector the decode should have written and did not then shows up as NaN.
    Call it once the inputs are on the GPU."""
    junk = [torch.full_like(out_like, float("nan"))]
    if workspace:
        junk.append(torch.full(((1 << 18) - 64,), float("nan"), device=out_like.device))
        junk.append(torch.full((1 << 21,), float("nan"), device=out_like.device))
        if splits > 0:
            rows, heads, head_dim = out_like.shape
            junk.append(torch.full((rows * heads * splits * head_dim,), float("nan"), device=out_like.device))
            junk.append(torch.full((rows * heads * splits,), float("nan"), device=out_like.device))
    del junk


def poisoned_cuda_decode(q, cache, bt, sl, preset: str, scale: float, splits: int,
                         workspace: bool = False) -> torch.Tensor:
    """The CUDA decode with NaN left where its output (and, with `workspace`, its split workspace)
    will be allocated (poison_next_allocations), so an element the kernel forgets to write cannot
    pass. Returns the output on the CPU."""
    args = [t.cuda() for t in (q, cache, bt, sl)]
    poison_next_allocations(args[0], workspace, splits)
    return tq.decode(*args, preset, scale, splits).cpu()


def captured_decode(q, cache, block_table, seq_lens, preset: str, scale: float):
    """A CUDA graph of one decode (its one-time set-up run first, outside the capture) and the output
    it writes: replay it after writing new lengths into seq_lens and new queries into q."""
    tq.decode(q, cache, block_table, seq_lens, preset, scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tq.decode(q, cache, block_table, seq_lens, preset, scale)
    return graph, out


def serving_table(bt: torch.Tensor, cache: torch.Tensor, tokens: int = 32768) -> torch.Tensor:
    """bt widened to `tokens` tokens per sequence, as a serving engine sizes it for its longest model
    length; the entries past each sequence's blocks are stale ids of other blocks."""
    stale = torch.randint(0, cache.shape[0], (bt.shape[0], tokens // 16 - bt.shape[1]), dtype=torch.int32)
    return torch.cat([bt, stale], dim=1)


def rerun_tests_with(path: str, env_changes: dict, select: str, workers: int = 0) -> None:
    """Runs the tests of `path` that `select` (-k) picks in a fresh process whose environment has
    env_changes (None: unset), for switches the library reads once per process, and asserts that
    they all passed and none was skipped. Under compute-sanitizer (gpu_run.sh sets
    PYTORCH_NO_CUDA_MEMORY_CACHING=1) graph tests are left out: without the caching allocator a
    capture would cudaMalloc. `workers`: pytest-xdist workers, where it is installed."""
    import importlib.util
    import os
    import subprocess
    import sys
    env = dict(os.environ)
    for name, value in env_changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1":
        select += " and not graph"
    parallel = ["-n", str(workers)] if workers and importlib.util.find_spec("xdist") is not None else []
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *parallel, path, "-k", select],
                            env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " skipped" not in result.stdout, result.stdout[-2000:]
