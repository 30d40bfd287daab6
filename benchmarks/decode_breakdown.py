"""Where a split decode's time goes: the decode kernel, the split merge after it, and the whole
step, for bench_decode's A/B shapes at the library's split count and at fixed ones.

    python benchmarks/decode_breakdown.py [--preset turboquant_4bit_nc] [--shapes ab] [--out results.md]

Per shape and split count (0 = the library's choice, which the table cannot name): µs of one
step under graph replay (as bench_decode times it) and eager, then from torch.profiler traces of
eager steps and of graph replays the decode kernel's own duration and the merge's tail (merge
end - decode end: the merge kernel starts early under programmatic dependent launch, so its own
duration includes waiting). (16,64,8,16384) took 108 µs under graph replay and 97 eager (H200)
while the other shapes agreed within 3 µs: the two traces say whether a kernel or the gaps
between them differ. Shapes with the same bytes (e.g. (32,32,8,8192) and
(16,64,8,16384), 281 MB each at 4bit_nc) that differ in step time show here whether the
difference is in the main loop or in the partials and their merge. --placement adds the same
step on caches built before and after bench_decode's SDPA baseline (see placement()).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import turboquant as tq  # noqa: E402
from bench_decode import HEAD_DIM, SHAPES, build_cache, sdpa_best_us, with_table_tokens  # noqa: E402
from timing import append_markdown, graph_replay_us, graph_replays, time_us  # noqa: E402


def kernel_spans(step, steps: int):
    """(decode µs, merge tail µs) medians over `steps` steps (eager calls or graph replays), from
    the profiler's kernel events in launch order: a decode kernel, then the merge kernel when the
    step has one. NaN where the trace holds no decode kernel (a profiler that does not see the
    kernels of graphs)."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and ("decode" in e.name or "merge" in e.name)), key=lambda e: e.time_range.start)
    decode, tail = [], []
    for i, e in enumerate(kernels):
        if "merge" in e.name:
            continue
        decode.append(e.time_range.end - e.time_range.start)
        nxt = kernels[i + 1] if i + 1 < len(kernels) else None
        tail.append(nxt.time_range.end - e.time_range.end if nxt is not None and "merge" in nxt.name else 0.0)
    if not decode:
        return float("nan"), float("nan")
    return statistics.median(decode), statistics.median(tail)


def placement(a):
    """The same decode step timed three ways, per shape: (fresh) on a cache built right away; (after
    SDPA) that cache again after bench_decode's SDPA baseline has run on the same shape; (in SDPA's
    memory) a second cache built after the baseline, so it lands in memory the caching allocator
    kept from the baseline's dense K/V, as bench_decode's cache does. Tells heat or clocks (the
    second differs) from where the cache lies (only the third differs)."""
    lines = ["", f"Decode placement, {a.preset}, graph replay µs (default splits)", "",
             "| B | Hq | Hkv | L | fresh | after SDPA | in SDPA's memory | fresh again |", "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for b, hq, hkv, length in SHAPES["quick"]:
        torch.cuda.empty_cache()
        q = torch.randn(b, hq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        seq_lens = torch.full((b,), length, dtype=torch.int32, device="cuda")

        def step_us(cache, block_table):
            return graph_replay_us(lambda: tq.decode(q, cache, block_table, seq_lens, a.preset, HEAD_DIM ** -0.5))
        first = build_cache(a.preset, b, hkv, length)
        fresh = step_us(*first)
        sdpa_best_us(b, hq, hkv, length, graphed=True)
        after = step_us(*first)
        second = build_cache(a.preset, b, hkv, length)
        inside = step_us(*second)
        again = step_us(*first)
        line = f"| {b} | {hq} | {hkv} | {length} | {fresh:.1f} | {after:.1f} | {inside:.1f} | {again:.1f} |"
        lines.append(line)
        print(line, flush=True)
        del first, second
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="turboquant_4bit_nc", choices=list(tq.PRESETS))
    p.add_argument("--shapes", default="ab", choices=list(SHAPES))
    p.add_argument("--splits", type=int, nargs="+", default=[0, 8, 16, 32], help="split counts (0: the library's)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--placement", action="store_true", help="also the placement table (see placement())")
    p.add_argument("--table-tokens", type=int, default=0,
                   help="block tables that could hold this many tokens (a serving engine's), not exactly L")
    p.add_argument("--out", help="markdown file to append the table to")
    a = p.parse_args()
    lines = [f"Decode breakdown, {a.preset} ({torch.cuda.get_device_name()}): one step under graph replay and eager, "
             "the decode kernel and the merge tail (profiler traces of eager steps and of graph replays), µs"
             + (f"; block tables of {a.table_tokens} tokens" if a.table_tokens else "; block tables of exactly L tokens"), "",
             "| B | Hq | Hkv | L | splits | step (graph, before / after eager) | step (eager) | decode kernel (eager) | merge tail (eager) "
             "| decode kernel (graph) | merge tail (graph) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for b, hq, hkv, length in SHAPES[a.shapes]:
        cache, block_table = with_table_tokens(build_cache(a.preset, b, hkv, length), a.table_tokens)
        q = torch.randn(b, hq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        seq_lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
        for splits in a.splits:
            def step(splits=splits):
                return tq.decode(q, cache, block_table, seq_lens, a.preset, HEAD_DIM ** -0.5, splits)
            graph = graph_replay_us(step)
            eager = time_us([step])
            graph_again = graph_replay_us(step)  # after eager: tells an order effect from the graph's own
            decode, tail = kernel_spans(step, a.steps)
            graph_decode, graph_tail = kernel_spans(graph_replays([step])[0], a.steps)
            line = (f"| {b} | {hq} | {hkv} | {length} | {splits or 'default'} | {graph:.1f} / {graph_again:.1f} | {eager:.1f} "
                    f"| {decode:.1f} | {tail:.1f} | {graph_decode:.1f} | {graph_tail:.1f} |")
            lines.append(line)
            print(line, flush=True)
    if a.placement:
        lines += placement(a)
    if a.out:
        append_markdown(a.out, lines)


if __name__ == "__main__":
    main()
