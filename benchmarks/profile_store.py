"""One store shape for a profiler: bench_store's 65,536 tokens x 8 KV heads x D=128 bf16 into a
paged cache at random slots, a few times.

    ncu --kernel-name regex:store_kv_kernel --launch-skip 1 --launch-count 1 --set full \\
        python benchmarks/profile_store.py --preset turboquant_4bit_nc
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import turboquant as tq  # noqa: E402
from bench_store import BLOCK_SIZE, HEAD_DIM, HEADS  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=list(tq.PRESETS), default="turboquant_4bit_nc")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    k = torch.randn(a.tokens, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(a.tokens, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(a.tokens, device="cuda")
    cache = tq.allocate_kv_cache(a.tokens // BLOCK_SIZE, BLOCK_SIZE, HEADS, HEAD_DIM, a.preset, "cuda")
    for _ in range(a.steps):
        tq.store_kv(k, v, cache, slots, a.preset)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
