"""Head dims without tiled kernels on the GPU: what the generic decode (kernels/generic_head_dim.cu)
costs against PyTorch SDPA on a bf16 cache of the same shape, next to the tiled kernels at D = 128.

    python benchmarks/bench_head_dims.py [--dims 96 160 128] [--rounds 5] [--out results.md]

Each row: a decode step of B sequences of L tokens, graph replay, turboquant and the best SDPA
backend timed in alternating rounds in one process (median of the rounds), enough input sets to
defeat the L2. The CUDA store does not take the generic head dims: their caches are 16 blocks
stored on the CPU, repeated to the length and copied over (the decode reads the same bytes per
token either way).
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
from timing import append_markdown, copies_to_defeat_l2, graph_replays  # noqa: E402

# (B, Hq, Hkv, L): GQA 4 at short and long contexts, and Phi-3-mini's 32 KV heads (no GQA)
SHAPES = [(1, 32, 8, 8192), (8, 32, 8, 8192), (32, 32, 8, 2048), (8, 32, 32, 4096)]
TILED = (64, 128, 256)


def cpu_stored_cache(preset, b, hkv, length, seed, head_dim, block_size=16, stored_blocks=16):
    """A packed cache of b x length tokens whose blocks repeat `stored_blocks` blocks stored on the
    CPU, on the GPU, with a shuffled block table (build_cache's shape)."""
    g = torch.Generator().manual_seed(seed)
    small = tq.allocate_kv_cache(stored_blocks, block_size, hkv, head_dim, preset)
    k = torch.randn(stored_blocks * block_size, hkv, head_dim, generator=g)
    tq.store_kv(k, torch.randn(k.shape, generator=g), small, torch.arange(k.shape[0]), preset)
    num_blocks = b * length // block_size
    cache = small.repeat(-(-num_blocks // stored_blocks), 1, 1, 1)[:num_blocks].cuda()
    order = torch.randperm(num_blocks, generator=g).cuda()
    return cache, order.view(b, length // block_size).int()


def decode_replays(preset, head_dim, b, hq, hkv, length):
    read = b * hkv * length * tq.slot_layout(preset, head_dim).slot_size_aligned
    tiled = head_dim in TILED or (head_dim == 96 and preset == "turboquant_k8v4")
    build = build_cache if tiled else cpu_stored_cache
    caches = [build(preset, b, hkv, length, s, head_dim=head_dim) for s in range(copies_to_defeat_l2(read))]
    q = torch.randn(b, hq, head_dim, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    return graph_replays([lambda c=c: tq.decode(q, c[0], c[1], seq_lens, preset, head_dim ** -0.5) for c in caches])


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
    append_markdown(a.out, lines)


if __name__ == "__main__":
    main()
