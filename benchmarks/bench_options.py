"""Attention options on the GPU: what a sliding window, soft-capping and attention sinks cost.

    python benchmarks/bench_options.py [--presets ...] [--rounds 5] [--out results.md]

A windowed decode reads only the window's blocks, so its time should track the window, not the
context: each row times a decode over L cached tokens with a window of W tokens against a plain
decode over W tokens (same batch and heads), in alternating graph-replay rounds in one process.
Soft-capping and sinks are timed against the plain decode over the same L (both then run the
per-head kernel's code path only where an option is set, so the ratio includes any kernel switch).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import turboquant as tq  # noqa: E402
from bench_decode import HEAD_DIM, alternating_rounds_us, build_cache  # noqa: E402
from timing import append_markdown, copies_to_defeat_l2, graph_replays  # noqa: E402

# (B, Hq, Hkv, L, window tokens or 0, softcap, sinks)
CASES = [
    (8, 32, 8, 32768, 4096, 0.0, False),
    (1, 32, 8, 32768, 4096, 0.0, False),
    (32, 32, 8, 8192, 1024, 0.0, False),
    (8, 32, 8, 8192, 0, 50.0, False),
    (8, 32, 8, 8192, 0, 0.0, True),
    (32, 32, 8, 8192, 0, 50.0, True),
]


def decode_fns(preset, b, hq, hkv, length, window=0, softcap=0.0, sinks=False):
    """Graph-replayable decode closures over enough caches to defeat the L2."""
    slot = tq.slot_layout(preset, HEAD_DIM).slot_size_aligned
    read = b * hkv * (min(window, length) if window else length) * slot
    caches = [build_cache(preset, b, hkv, length, s) for s in range(copies_to_defeat_l2(read))]
    q = torch.randn(b, hq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    sink = torch.randn(hq, device="cuda", dtype=torch.float32) if sinks else None
    options = dict(window_left=window - 1 if window else -1, softcap=softcap, sinks=sink)
    return [lambda c=c: tq.decode(q, c[0], c[1], seq_lens, preset, HEAD_DIM ** -0.5, **options) for c in caches], read


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", choices=list(tq.PRESETS), default=["turboquant_4bit_nc", "turboquant_k8v4"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.manual_seed(0)
    lines = [f"Attention options, D={HEAD_DIM}, {torch.cuda.get_device_name()}, {datetime.date.today()}: "
             "graph replay, alternating rounds, median", "",
             "| B | Hq | Hkv | L | option | preset | us with option | baseline | baseline us | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    print(lines[0], flush=True)
    for (b, hq, hkv, length, window, softcap, sinks) in CASES:
        for preset in a.presets:
            opt, _ = decode_fns(preset, b, hq, hkv, length, window, softcap, sinks)
            if window:  # the same decode over the window's length alone
                base, _ = decode_fns(preset, b, hq, hkv, window)
                base_name = f"plain, L={window}"
                option = f"window {window}"
            else:
                base, _ = decode_fns(preset, b, hq, hkv, length)
                base_name = f"plain, L={length}"
                option = " + ".join(([f"softcap {softcap:g}"] if softcap else []) + (["sinks"] if sinks else []))
            base_us, opt_us, _ = alternating_rounds_us(graph_replays(base), graph_replays(opt), a.rounds)
            row = (f"| {b} | {hq} | {hkv} | {length} | {option} | {preset.replace('turboquant_', '')} | "
                   f"{opt_us:.1f} | {base_name} | {base_us:.1f} | {opt_us / base_us:.2f} |")
            lines.append(row)
            print(row, flush=True)
            del opt, base
            torch.cuda.empty_cache()
    append_markdown(a.out, lines)


if __name__ == "__main__":
    main()
