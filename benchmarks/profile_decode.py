"""One decode shape for a profiler: builds a packed cache and runs a few decode steps.

    ncu --clock-control none --kernel-name regex:decode_kernel --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section Occupancy \\
        python benchmarks/profile_decode.py --preset turboquant_4bit_nc
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import turboquant as tq  # noqa: E402
from bench_decode import HEAD_DIM, build_cache  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=list(tq.PRESETS), default="turboquant_4bit_nc")
    p.add_argument("--shape", type=int, nargs=4, metavar=("B", "HQ", "HKV", "L"), default=(32, 32, 8, 8192))
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    b, hq, hkv, length = a.shape
    cache, block_table = build_cache(a.preset, b, hkv, length)
    q = torch.randn(b, hq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    for _ in range(a.steps):
        tq.decode(q, cache, block_table, seq_lens, a.preset, HEAD_DIM ** -0.5)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
