"""GPU timing helpers shared by the benchmark scripts: CUDA-event medians, rotation over several
input sets (so repeated runs do not measure the L2 cache), graph replay, copy bandwidth."""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch

L2_BYTES = 60 * 2**20  # H200; rotating over > 3x this defeats the cache


def copies_to_defeat_l2(bytes_per_set: int) -> int:
    return max(1, min(8, -(-3 * L2_BYTES // max(bytes_per_set, 1))))


def time_us(fns: Sequence[Callable[[], object]], reps: int = 30, calls_per_rep: int = 10, warmup: int = 3) -> float:
    """Median over `reps` of the mean time per call (microseconds) of back-to-back calls cycling
    through `fns` (one closure per input set)."""
    for _ in range(warmup):
        for f in fns:
            f()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    k = 0
    for _ in range(reps):
        start.record()
        for _ in range(calls_per_rep):
            fns[k % len(fns)]()
            k += 1
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop) * 1e3 / calls_per_rep)
    return statistics.median(samples)


def graph_replays(fns: Sequence[Callable[[], object]]) -> list[Callable[[], object]]:
    """Captures each closure in its own CUDA graph (after a warm-up on a side stream) and returns the
    replay functions: timing them measures GPU time without the host's per-call launch overhead,
    which dominates eager calls of small shapes (~30 us of Python and launches per step)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graphs = []
    for f in fns:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            f()
        graphs.append(graph)
    # Each replay holds its closure, so the inputs the graph reads stay allocated as long as it does.
    return [lambda g=g, f=f: g.replay() for g, f in zip(graphs, fns)]


def graph_replay_us(fn: Callable[[], object], reps: int = 50, replays_per_rep: int = 20) -> float:
    """Median time of one replay of a CUDA graph that captured one call of `fn`."""
    return time_us(graph_replays([fn]), reps=reps, calls_per_rep=replays_per_rep)


def append_markdown(path: str | None, lines: list[str]) -> None:
    """Appends a finished table (list of markdown lines) to `path`, if given."""
    if path:
        with open(path, "a") as f:
            f.write("\n".join(lines) + "\n\n")


def copy_bandwidth_gbs(nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth counting bytes read plus bytes written (GB/s)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    us = time_us([lambda: b.copy_(a)], reps=20, calls_per_rep=5)
    return 2 * nbytes / (us * 1e-6) / 1e9
