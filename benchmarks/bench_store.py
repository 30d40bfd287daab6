"""Store benchmark: the fused store_kv kernel vs the same store done the way vLLM does it (torch
norm/divide/fp32 matmul rotation through cuBLAS, then bucketize and pack in torch), vs the copy
bandwidth, in one process.

    python benchmarks/bench_store.py [--presets ...] [--tokens 65536] [--heads 8] [--out results.md]
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
from timing import append_markdown, copies_to_defeat_l2, copy_bandwidth_gbs, graph_replay_us, time_us  # noqa: E402

HEADS, HEAD_DIM, BLOCK_SIZE = 8, 128, 16


def torch_store_4bit_nc(key, value, cache_flat, slots, hadamard, centroids, midpoints):
    """vLLM-style 4bit_nc store in separate torch launches (rotation = cuBLAS fp32 GEMM)."""
    n, h, d = key.shape
    k = key.float()
    norm = k.norm(dim=-1, keepdim=True)
    y = (k / (norm + 1e-8)) @ hadamard
    idx = torch.bucketize(y, midpoints, right=True)
    c = centroids[idx]
    stored = (norm.squeeze(-1) / c.norm(dim=-1)).half()
    kbytes = (idx[..., 0::2] | (idx[..., 1::2] << 4)).to(torch.uint8)
    v = value.float()
    vmin, vmax = v.amin(-1, keepdim=True), v.amax(-1, keepdim=True)
    scale = ((vmax - vmin) / 15).half()
    zero = vmin.half()
    q = torch.floor((v - zero.float()) / scale.float() + 0.5).clamp(0, 15).to(torch.uint8)
    vbytes = q[..., 0::2] | (q[..., 1::2] << 4)
    slot = torch.cat([kbytes, stored.unsqueeze(-1).view(torch.uint8), vbytes, scale.view(torch.uint8),
                      zero.view(torch.uint8)], dim=-1)
    rows = (slots[:, None] * h + torch.arange(h, device=key.device)).reshape(-1)
    cache_flat.index_copy_(0, rows, slot.reshape(n * h, -1))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", choices=list(tq.PRESETS), default=list(tq.PRESETS))
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--heads", type=int, default=HEADS, help="KV heads (the slots of a token's heads are adjacent)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    copy_bw = copy_bandwidth_gbs()
    n = a.tokens
    lines = [f"Store, {n} tokens x {a.heads} KV heads x D={HEAD_DIM}, bf16 input, {torch.cuda.get_device_name()}, "
             f"copy bandwidth {copy_bw:.0f} GB/s; {datetime.date.today()}", "",
             "| preset | fused us | GB/s (read K,V + write slots) | % copy BW | vLLM-style torch us | speed-up | cuBLAS rotation alone us |",
             "|---|---|---|---|---|---|---|"]
    print(lines[0], flush=True)
    num_blocks = n // BLOCK_SIZE
    in_bytes = 2 * n * a.heads * HEAD_DIM * 2
    sets = []
    for _ in range(copies_to_defeat_l2(in_bytes)):
        k = torch.randn(n, a.heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(n, a.heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        sets.append((k, v, torch.randperm(n, device="cuda")))
    hadamard = tq.hadamard(HEAD_DIM, "cuda")
    for preset in a.presets:
        slot = tq.slot_layout(preset, HEAD_DIM).slot_size_aligned
        cache = tq.allocate_kv_cache(num_blocks, BLOCK_SIZE, a.heads, HEAD_DIM, preset, "cuda")
        us = time_us([lambda s=s: tq.store_kv(s[0], s[1], cache, s[2], preset) for s in sets])
        moved = in_bytes + n * a.heads * slot
        gbs = moved / (us * 1e-6) / 1e9
        torch_us = rot_us = float("nan")
        if preset == "turboquant_4bit_nc":
            c, m = tq.codebook(4, HEAD_DIM, "cuda")
            flat = cache.view(-1, slot)
            torch_us = time_us([lambda s=s: torch_store_4bit_nc(s[0], s[1], flat, s[2], hadamard, c, m) for s in sets], reps=10)
            rot_us = time_us([lambda s=s: s[0].float() @ hadamard for s in sets], reps=10)
        baseline = (f"{torch_us:.1f} | {torch_us / us:.1f}x | {rot_us:.1f}" if torch_us == torch_us  # not NaN
                    else "- | - | -")  # the torch pipeline is written for 4bit_nc only
        row = f"| {preset.replace('turboquant_', '')} | {us:.1f} | {gbs:.0f} | {100 * gbs / copy_bw:.0f}% | {baseline} |"
        lines.append(row)
        print(row, flush=True)
    lines += ["", "Decode-batch store (one launch), graph replay:", "", "| N tokens | preset | replay us |", "|---|---|---|"]
    for count in (1, 8, 64, 256):
        for preset in ("turboquant_4bit_nc", "turboquant_k8v4"):
            cache = tq.allocate_kv_cache(64, BLOCK_SIZE, a.heads, HEAD_DIM, preset, "cuda")
            k = torch.randn(count, a.heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            slots = torch.randperm(64 * BLOCK_SIZE, device="cuda")[:count]
            us = graph_replay_us(lambda: tq.store_kv(k, k, cache, slots, preset))
            lines.append(f"| {count} | {preset.replace('turboquant_', '')} | {us:.1f} |")
            print(lines[-1], flush=True)
    append_markdown(a.out, lines)


if __name__ == "__main__":
    main()
