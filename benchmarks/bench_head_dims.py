"""Head dims without tiled kernels on the GPU: what the generic kernels (kernels/generic_head_dim.cu)
cost against PyTorch SDPA on a bf16 cache of the same shape, next to the tiled kernels at D = 128.

    python benchmarks/bench_head_dims.py [--dims 96 160 128] [--rounds 5] [--out results.md]

Each row: a decode step of B sequences of L tokens, graph replay, turboquant and the best SDPA
backend timed in alternating rounds in one process (median of the rounds), enough input sets to
defeat the L2. Then the generic decode's time by split count, and the store of a 4,096-token
prefill (Hkv 8) per preset and head dim.
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
from bench_decode import alternating_rounds_us, build_cache, sdpa_best  # noqa: E402
from timing import append_markdown, copies_to_defeat_l2, graph_replays, time_us  # noqa: E402

# (B, Hq, Hkv, L): GQA 4 at short and long contexts, and Phi-3-mini's 32 KV heads (no GQA)
SHAPES = [(1, 32, 8, 8192), (8, 32, 8, 8192), (32, 32, 8, 2048), (8, 32, 32, 4096)]
TILED = (64, 128, 256)


def decode_replays(preset, head_dim, b, hq, hkv, length, num_splits=0):
    read = b * hkv * length * tq.slot_layout(preset, head_dim).slot_size_aligned
    caches = [build_cache(preset, b, hkv, length, s, head_dim=head_dim) for s in range(copies_to_defeat_l2(read))]
    q = torch.randn(b, hq, head_dim, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    return graph_replays([lambda c=c: tq.decode(q, c[0], c[1], seq_lens, preset, head_dim ** -0.5, num_splits)
                          for c in caches])


def store_us(preset, head_dim, tokens=4096, hkv=8):
    cache = tq.allocate_kv_cache(tokens // 16, 16, hkv, head_dim, preset, "cuda")
    k = torch.randn(tokens, hkv, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.arange(tokens, device="cuda")
    return time_us(graph_replays([lambda: tq.store_kv(k, v, cache, slots, preset)]))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dims", type=int, nargs="+", default=[96, 160, 128])
    p.add_argument("--presets", nargs="+", choices=list(tq.PRESETS), default=["turboquant_4bit_nc", "turboquant_k8v4"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.manual_seed(0)
    lines = [f"Decode by head dim, {torch.cuda.get_device_name()}, {datetime.date.today()}: graph replay, "
             "alternating rounds with SDPA (best backend, bf16 cache), median", "",
             "| D | kernel | B | Hq | Hkv | L | preset | turboquant us | SDPA bf16 us | ratio (SDPA / turboquant) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    print(lines[0], flush=True)
    for d in a.dims:
        for (b, hq, hkv, length) in SHAPES:
            sdpa = sdpa_best(b, hq, hkv, length, head_dim=d)[4]
            for preset in a.presets:
                kernel = "tiled" if d in TILED or (d == 96 and preset == "turboquant_k8v4") else "generic"
                ours = decode_replays(preset, d, b, hq, hkv, length)
                sdpa_us, ours_us, _ = alternating_rounds_us(sdpa, ours, a.rounds)
                row = (f"| {d} | {kernel} | {b} | {hq} | {hkv} | {length} | {preset.replace('turboquant_', '')} | "
                       f"{ours_us:.1f} | {sdpa_us:.1f} | {sdpa_us / ours_us:.2f} |")
                lines.append(row)
                print(row, flush=True)
                del ours
            del sdpa
            torch.cuda.empty_cache()
    # The generic decode's split count (kGenericMinTokensPerSplit, kernels/launchers.h): auto
    # against forced counts.
    splits = [0, 16, 32, 64, 128]
    lines += ["", "Generic decode (D = 96, 4bit_nc) by split count, graph replay, median", "",
              "| B | Hq | Hkv | L | " + " | ".join("auto us" if n == 0 else f"{n} splits us" for n in splits) + " |",
              "|---|---|---|---|" + "---|" * len(splits)]
    for (b, hq, hkv, length) in SHAPES[:2]:
        times = [time_us(decode_replays("turboquant_4bit_nc", 96, b, hq, hkv, length, n)) for n in splits]
        row = f"| {b} | {hq} | {hkv} | {length} | " + " | ".join(f"{t:.1f}" for t in times) + " |"
        lines.append(row)
        print(row, flush=True)
    lines += ["", "Store of a 4,096-token prefill, Hkv 8, bf16 K/V, graph replay, median", "",
              "| preset | " + " | ".join(f"D={d} us" for d in a.dims) + " |", "|---|" + "---|" * len(a.dims)]
    for preset in tq.PRESETS:
        row = f"| {preset.replace('turboquant_', '')} | " + " | ".join(f"{store_us(preset, d):.1f}" for d in a.dims) + " |"
        lines.append(row)
        print(row, flush=True)
    append_markdown(a.out, lines)


if __name__ == "__main__":
    main()
