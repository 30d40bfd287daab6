"""What moves the decode time? One shape, one knob at a time, in one process.

    python benchmarks/diagnose_decode.py [--shape B HQ HKV L] [--preset turboquant_4bit_nc]

Knobs: block-table order (shuffled vs identity), cache layout (token- vs head-major), block size,
number of splits, preset (bytes per slot). Only the inputs change, never the kernel, so a knob that
moves the time names what limits it.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import turboquant as tq  # noqa: E402
from bench_decode import HEAD_DIM, build_cache  # noqa: E402
from timing import copy_bandwidth_gbs, time_us  # noqa: E402



def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=int, nargs=4, metavar=("B", "HQ", "HKV", "L"), default=(32, 32, 8, 8192))
    p.add_argument("--preset", choices=list(tq.PRESETS), default="turboquant_4bit_nc")
    a = p.parse_args()
    b, hq, hkv, length = a.shape
    copy_bw = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}, copy {copy_bw:.0f} GB/s; shape B={b} Hq={hq} Hkv={hkv} L={length}")
    print("| knob | preset | block | layout | table | splits | us | % copy BW |\n|---|---|---|---|---|---|---|---|")
    base = dict(preset=a.preset, block_size=16, head_major=False, shuffled=True, splits=0)
    variants = [("baseline", {}), ("identity block table", dict(shuffled=False)),
                ("head-major cache", dict(head_major=True)), ("block size 64", dict(block_size=64)),
                ("block size 128", dict(block_size=128)), ("splits 1", dict(splits=1)),
                ("splits 6", dict(splits=6)), ("splits 12", dict(splits=12)),
                ("k8v4 (46% more bytes)", dict(preset="turboquant_k8v4")),
                ("3bit_nc (24% fewer bytes)", dict(preset="turboquant_3bit_nc"))]
    q = torch.randn(b, hq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    for name, change in variants:
        v = {**base, **change}
        cache, bt = build_cache(v["preset"], b, hkv, length, block_size=v["block_size"], head_major=v["head_major"],
                                shuffled=v["shuffled"])
        us = time_us([lambda: tq.decode(q, cache, bt, seq_lens, v["preset"], HEAD_DIM ** -0.5, v["splits"])])
        packed = b * hkv * length * tq.slot_layout(v["preset"], HEAD_DIM).slot_size_aligned
        pct = 100 * packed / (us * 1e-6) / 1e9 / copy_bw
        print(f"| {name} | {v['preset'].replace('turboquant_', '')} | {v['block_size']} | "
              f"{'head' if v['head_major'] else 'token'}-major | {'shuffled' if v['shuffled'] else 'identity'} | "
              f"{v['splits'] or 'auto'} | {us:.1f} | {pct:.0f}% |", flush=True)
        del cache, bt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
