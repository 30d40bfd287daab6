"""Decode benchmark: turboquant decode on the packed paged cache vs torch SDPA bf16 on a dense
cache of the same shape (best of its backends), in one process, plus the copy bandwidth.

    python benchmarks/bench_decode.py [--presets ...] [--shapes default|quick|small|ab|short|fill|...] [--table-tokens N] [--rounds 5] [--out results.md]

Times are GPU times: each call is captured in a CUDA graph and the graphs are replayed in rotation,
so small shapes measure the kernels rather than Python and launch overhead. Ours and SDPA's graphs
are timed in alternating rounds (SDPA, ours, SDPA, ours, ...) and each reports its median round, so
both run in the same power and clock state: the H200 runs SDPA's large shapes into its 700 W cap,
and whichever is timed right after the other's long run pays for it (H200: a single timing of
ours right after SDPA's baseline read 5-20 % slower than the same graphs a moment later).
The eager ratio (back-to-back calls, what a Python loop sees) is printed too.
Prints time, GB/s over the packed bytes, % of copy bandwidth and the speed-up over SDPA bf16;
then graph-replay latency at short contexts for B = 1..8 against SDPA's, with one decode step per
graph and (--layers, default with --shapes short) with 16, a model step's layers, each over its
own cache.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import turboquant as tq  # noqa: E402
from timing import (append_markdown, copies_to_defeat_l2, copy_bandwidth_gbs, graph_replays,  # noqa: E402
                    time_us)

SHAPES = {  # (B, Hq, Hkv, L)
    "default": [(1, 32, 8, 32768), (8, 32, 8, 8192), (32, 32, 8, 8192), (64, 32, 8, 4096), (128, 32, 8, 2048),
                (32, 32, 32, 4096), (16, 64, 8, 16384)],
    "quick": [(32, 32, 8, 8192), (16, 64, 8, 16384)],
    "small": [(1, 32, 8, 32768), (1, 32, 8, 8192), (8, 32, 8, 8192)],  # set-up/latency-bound: A/B runs
    "ab": [(1, 32, 8, 32768), (8, 32, 8, 8192), (32, 32, 8, 8192), (16, 64, 8, 16384)],  # A/B of loop changes
    # A loop change and a split-merge change in one A/B: the bandwidth-bound shapes and the per-head
    # kernel's multi-split short ones (merged by the merge kernel at exact tables).
    "ab_merge": [(1, 32, 8, 32768), (32, 32, 8, 8192), (16, 64, 8, 16384), (1, 32, 8, 1024), (1, 32, 8, 4096),
                 (2, 32, 8, 4096)],
    # Around the row kernel's selection rule (turboquant/split_plan.h, row_kernel_preferred:
    # batch x head groups x L/256 x 2 >= SMs), where neither kernel has been timed against the
    # other: `TURBOQUANT_DECODE_KERNEL=heads|rows python benchmarks/bench_decode.py --shapes fill` times each.
    # Short contexts, where a step is latency (launches, the query set-up, the merge) and SDPA bf16
    # is as fast (0.93-1.23x, RESULTS.md): `BREAKDOWN_ARGS="--shapes short ..." gpu_run.sh breakdown`.
    "short": [(1, 32, 8, 256), (1, 32, 8, 1024), (8, 32, 8, 1024), (1, 32, 8, 4096), (2, 32, 8, 4096)],
    # The per-head kernel at B = 1-2 with a serving engine's 32k-token tables took 1.4-6 us more than with
    # tables of exactly L (H200, B=1 L=16k 24.1 vs 17.9, the same 16 splits): `BREAKDOWN_ARGS="--shapes
    # serving_gap --splits 0 --table-tokens 32768" gpu_run.sh breakdown`, and again without --table-tokens.
    "serving_gap": [(1, 32, 8, 4096), (1, 32, 8, 16384), (2, 32, 8, 4096)],
    # That cost is the block scheduler doubling up some of the grid's first CTAs
    # (tools/probes/cta_placement_probe.cu); such rows now get the grid's splits
    # (row_splits_in_grid) where their own count fills one CTA per SM; between 1.9k and 4k tokens (B=1) the 128-token cap keeps them at 16-31 splits, still
    # first in a grid of 33: these lengths tell whether that range pays too.
    "serving_mid": [(1, 32, 8, 1536), (1, 32, 8, 2048), (1, 32, 8, 3072), (1, 32, 8, 8192), (2, 32, 8, 2048),
                    (2, 32, 8, 8192)],
    # Batches of 3-8 with a serving engine's 32k-token tables take the row kernel by their shapes, which
    # took 12-18 us at 256-1k tokens where the per-head kernel took 9.7-15 (H200): where its time goes,
    # `TURBOQUANT_DECODE_KERNEL=rows BREAKDOWN_ARGS="--shapes serving_rows --table-tokens 32768" gpu_run.sh breakdown`.
    "serving_rows": [(3, 32, 8, 256), (3, 32, 8, 1024), (8, 32, 8, 256), (8, 32, 8, 1024), (8, 32, 8, 4096)],
    "fill": [(1, 32, 8, 4096), (2, 32, 8, 4096), (4, 32, 8, 4096), (8, 32, 8, 4096), (4, 32, 8, 2048),
             (8, 32, 8, 2048), (16, 32, 8, 2048), (2, 32, 8, 16384)],
}
HEAD_DIM, BLOCK_SIZE = 128, 16


def build_cache(preset, b, hkv, length, gen_seed=0, block_size=BLOCK_SIZE, head_major=False, shuffled=True,
                head_dim=HEAD_DIM):
    """A randomly filled packed cache (written by store_kv) and its block table (shuffled blocks
    unless shuffled=False)."""
    blocks_per_seq = length // block_size
    num_blocks = b * blocks_per_seq
    cache = tq.allocate_kv_cache(num_blocks, block_size, hkv, head_dim, preset, "cuda", head_major=head_major)
    g = torch.Generator(device="cuda").manual_seed(gen_seed)
    chunk = 65536
    for start in range(0, num_blocks * block_size, chunk):
        n = min(chunk, num_blocks * block_size - start)
        k = torch.randn(n, hkv, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(n, hkv, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
        tq.store_kv(k, v, cache, torch.arange(start, start + n, device="cuda"), preset)
    order = torch.randperm(num_blocks, device="cuda", generator=g) if shuffled else torch.arange(num_blocks, device="cuda")
    return cache, order.view(b, blocks_per_seq).int()


def with_table_tokens(cache_and_table, tokens):
    """The block table widened to hold `tokens` tokens (padding entries: block 0, past seq_len)."""
    cache, table = cache_and_table
    extra = -(-tokens // BLOCK_SIZE) - table.shape[1]
    if extra > 0:
        table = torch.cat([table, torch.zeros(table.shape[0], extra, dtype=table.dtype, device=table.device)], dim=1)
    return cache, table


def sdpa_best(b, hq, hkv, length, head_dim=HEAD_DIM):
    """Best SDPA bf16 over the cuDNN, flash and efficient backends (GQA without expanding K/V when
    the backend allows it). Returns (eager us, its backend, graph-replay us, its backend, that
    backend's graph replays, which keep their inputs) from one pass; a backend that cannot be captured
    counts for eager only. Enough input sets to defeat the L2."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sets = []
    for _ in range(copies_to_defeat_l2(2 * b * hkv * length * head_dim * 2)):
        q = torch.randn(b, hq, 1, head_dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, length, head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        sets.append((q, k, v))
    best, best_graph, best_replays = (float("inf"), "none"), (float("inf"), "none"), None
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        with sdpa_kernel(backend):
            fns = [lambda s=s: F.scaled_dot_product_attention(s[0], s[1], s[2], enable_gqa=True) for s in sets]
            try:
                best = min(best, (time_us(fns), backend.name.lower()))
                replays = graph_replays(fns)
                graph = (time_us(replays), backend.name.lower())
                if graph < best_graph:
                    best_graph, best_replays = graph, replays
            except RuntimeError:
                continue
    return best + best_graph + (best_replays,)


def sdpa_best_us(b, hq, hkv, length, graphed=False):
    """sdpa_best's (us, backend), with `graphed` also (graph-replay us, its backend); frees its inputs."""
    result = sdpa_best(b, hq, hkv, length)[:4]
    torch.cuda.empty_cache()
    return result if graphed else result[:2]


def alternating_rounds_us(a, b, rounds):
    """Median graph-replay time of `a` and of `b` (lists of replay functions), timed in alternating
    rounds a, b, a, b, ...: both see the same clock and power state. Also returns b's round range."""
    times_a, times_b = [], []
    for _ in range(rounds):
        times_a.append(time_us(a))
        times_b.append(time_us(b))
    return statistics.median(times_a), statistics.median(times_b), (min(times_b), max(times_b))


def sdpa_step_graph(b, length, steps):
    """The fastest SDPA bf16 backend's graph of `steps` calls, each over its own inputs (Hq 32,
    Hkv 8): (backend name, replays; each replay keeps its inputs)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sets = [tuple(torch.randn(b, h, t, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                  for h, t in ((32, 1), (8, length), (8, length))) for _ in range(steps)]
    timed = []
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        def step(backend=backend, sets=sets):
            with sdpa_kernel(backend):
                for s in sets:
                    F.scaled_dot_product_attention(s[0], s[1], s[2], enable_gqa=True)
        try:
            replays = graph_replays([step])
            timed.append((time_us(replays, reps=10), backend.name.lower(), replays))
        except RuntimeError:
            continue
    if not timed:
        raise RuntimeError(f"no SDPA backend could be captured at B={b}, L={length}")
    _, name, replays = min(timed, key=lambda x: x[0])
    return name, replays


def short_context_lines(rounds, steps=1):
    """Graph replay at short contexts, B = 1..8 (latency-bound: launches, the query set-up, the
    merge), against SDPA bf16's best graph on the same shape, timed in alternating rounds, us per
    decode step. steps = 1: one step per graph, L2-resident, so the launch latency is what the
    table shows. steps = n > 1: n steps in one graph, each over its own cache (the layers of one
    captured model step, as a serving engine replays them), so a one-call graph's launch no longer
    counts; with 16 the caches of a graph fit in the 60 MB L2 at 256 tokens for the packed presets
    (4bit_nc at B = 4: 17.6 MB) and for bf16 at B = 1-2 (16.8-34 MB), and pass it from about B = 8,
    L = 1k on (4bit_nc 140 MB, bf16 537 MB)."""
    if steps == 1:
        # The floor every row stands on: a graph of one trivial kernel, replayed back to back.
        scratch = torch.zeros(1, device="cuda")
        floor_us = time_us(graph_replays([lambda: scratch.add_(1)]), reps=30, calls_per_rep=20)
        title = ("Graph replay of one decode step at short contexts (Hq 32, Hkv 8; one input set, L2-resident; "
                 f"a graph of one trivial kernel replays in {floor_us:.1f} us):")
    else:
        title = f"{steps} decode steps per graph, each over its own cache (one model step's layers), us per step:"
    lines = ["", title, "", "| B | L | SDPA bf16 us (backend) | 4bit_nc us | speed-up | k8v4 us | speed-up |",
             "|---|---|---|---|---|---|---|"]
    print(title, flush=True)
    for length in (256, 1024, 4096):
        for b in (1, 2, 4, 8):
            backend, sdpa_replays = sdpa_step_graph(b, length, steps)
            cells = []
            for preset in ("turboquant_4bit_nc", "turboquant_k8v4"):
                caches = [build_cache(preset, b, 8, length, seed) for seed in range(steps)]
                q = torch.randn(b, 32, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                sl = torch.full((b,), length, dtype=torch.int32, device="cuda")
                # Defaults bind this preset's inputs: the replay keeps them alive (graph_replays).
                ours = graph_replays([lambda caches=caches, q=q, sl=sl, preset=preset:
                                      [tq.decode(q, c, bt, sl, preset, HEAD_DIM ** -0.5) for c, bt in caches]])
                sdpa_us, us, _ = alternating_rounds_us(sdpa_replays, ours, rounds)
                cells.append((sdpa_us / steps, us / steps))
                del ours, caches
            sdpa_us = statistics.median(c[0] for c in cells)
            lines.append(f"| {b} | {length} | {sdpa_us:.1f} ({backend}) | "
                         + " | ".join(f"{us:.1f} | {s_us / us:.2f}x" for s_us, us in cells) + " |")
            print(lines[-1], flush=True)
            del sdpa_replays
            torch.cuda.empty_cache()
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", choices=list(tq.PRESETS), default=list(tq.PRESETS))
    p.add_argument("--shapes", choices=list(SHAPES), default="default")
    p.add_argument("--num-splits", type=int, default=0)
    p.add_argument("--table-tokens", type=int, default=0,
                   help="block tables that could hold this many tokens (a serving engine's; the extra entries are "
                        "never read), not exactly L: the main table only")
    p.add_argument("--rounds", type=int, default=5, help="alternating timing rounds of SDPA and ours per row")
    p.add_argument("--out", default=None, help="append the markdown tables to this file")
    p.add_argument("--no-short-table", action="store_true",
                   help="only the table of --shapes (A/B runs of shapes that the short-context table does not cover)")
    p.add_argument("--layers", type=int, default=None,
                   help="decode steps per graph of a second short-context table (0: none; default 16 with "
                        "--shapes short, else 0)")
    a = p.parse_args()
    layers = a.layers if a.layers is not None else (16 if a.shapes == "short" else 0)
    torch.manual_seed(0)
    copy_bw = copy_bandwidth_gbs()
    name = torch.cuda.get_device_name()
    lines = [f"Decode, D={HEAD_DIM}, block_size {BLOCK_SIZE}, {name}, copy bandwidth {copy_bw:.0f} GB/s "
             f"(read+write); {datetime.date.today()}"
             + (f"; block tables of {a.table_tokens} tokens" if a.table_tokens else ""), "",
             "| B | Hq | Hkv | L | preset | splits | us (graph) | GB/s packed | % copy BW | SDPA bf16 us (graph, backend) "
             "| speed-up | eager us: ours / SDPA | ours' rounds, min-max us |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print(lines[0], flush=True)
    for (b, hq, hkv, length) in SHAPES[a.shapes]:
        sdpa_eager_us, _, _, backend, sdpa_replays = sdpa_best(b, hq, hkv, length)
        for preset in a.presets:
            slot = tq.slot_layout(preset, HEAD_DIM).slot_size_aligned
            packed = b * hkv * length * slot
            caches = [with_table_tokens(build_cache(preset, b, hkv, length, s), a.table_tokens)
                      for s in range(copies_to_defeat_l2(packed))]
            q = torch.randn(b, hq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            seq_lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
            fns = [lambda c=c: tq.decode(q, c[0], c[1], seq_lens, preset, HEAD_DIM ** -0.5, a.num_splits) for c in caches]
            eager_us = time_us(fns)
            sdpa_us, us, (low, high) = alternating_rounds_us(sdpa_replays, graph_replays(fns), a.rounds)
            gbs = packed / (us * 1e-6) / 1e9
            splits = a.num_splits or "auto"
            row = (f"| {b} | {hq} | {hkv} | {length} | {preset.replace('turboquant_', '')} | {splits} | {us:.1f} | "
                   f"{gbs:.0f} | {100 * gbs / copy_bw:.0f}% | {sdpa_us:.1f} ({backend}) | {sdpa_us / us:.2f}x | "
                   f"{eager_us:.1f} / {sdpa_eager_us:.1f} | {low:.1f}-{high:.1f} |")
            lines.append(row)
            print(row, flush=True)
            del caches
            torch.cuda.empty_cache()
        del sdpa_replays
        torch.cuda.empty_cache()
    append_markdown(a.out, lines)  # each table as it is done: a later one cut short by a timeout loses only itself
    if a.no_short_table:
        return
    append_markdown(a.out, short_context_lines(a.rounds))
    if layers:
        append_markdown(a.out, short_context_lines(a.rounds, layers))


if __name__ == "__main__":
    main()
