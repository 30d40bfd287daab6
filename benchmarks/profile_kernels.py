"""One decode, varlen or store call shape for a profiler, run a few times.

    ncu --kernel-name regex:decode_kernel --launch-skip 1 --launch-count 1 --set full \\
        python benchmarks/profile_kernels.py decode --preset turboquant_4bit_nc
    ncu --kernel-name regex:store_kv_kernel ... python benchmarks/profile_kernels.py store

decode: bench_decode's packed cache and query at --shape (default (32, 32, 8, 8192)); --table-tokens
widens its block table to a serving engine's (bench_decode.with_table_tokens), --splits forces a count.
varlen: one sequence of L = --shape's L cached tokens with a --q-len token continuation chunk
(decode_varlen; the library picks the kernel by shape unless TURBOQUANT_VARLEN_KERNEL is set).
store: bench_store's 65,536 tokens x 8 KV heads x D=128 bf16 into a paged cache at random slots.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import turboquant as tq  # noqa: E402
from bench_decode import HEAD_DIM, build_cache, with_table_tokens  # noqa: E402
from bench_store import BLOCK_SIZE, HEADS  # noqa: E402


def decode_step(a):
    b, hq, hkv, length = a.shape
    cache, block_table = with_table_tokens(build_cache(a.preset, b, hkv, length), a.table_tokens)
    q = torch.randn(b, hq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    return lambda: tq.decode(q, cache, block_table, seq_lens, a.preset, HEAD_DIM ** -0.5, a.splits)


def varlen_step(a):
    _, hq, hkv, length = a.shape
    cache, block_table = build_cache(a.preset, 1, hkv, length)
    q = torch.randn(a.q_len, hq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.tensor([length], dtype=torch.int32, device="cuda")
    starts = torch.tensor([0, a.q_len], dtype=torch.int32, device="cuda")
    return lambda: tq.decode_varlen(q, cache, block_table, seq_lens, starts, a.preset, HEAD_DIM ** -0.5)


def store_step(a):
    k = torch.randn(a.tokens, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(a.tokens, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(a.tokens, device="cuda")
    cache = tq.allocate_kv_cache(a.tokens // BLOCK_SIZE, BLOCK_SIZE, HEADS, HEAD_DIM, a.preset, "cuda")
    t = {}
    if a.transforms:  # the per-head transforms of a calibrated cache (values of bench_transforms.py's kind)
        t = {"key_offset": torch.randn(HEADS, HEAD_DIM, device="cuda"),
             "key_scale": torch.rand(HEADS, HEAD_DIM, device="cuda") + 0.5,
             "value_offset": torch.randn(HEADS, HEAD_DIM, device="cuda")}
    return lambda: tq.store_kv(k, v, cache, slots, a.preset, **t)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kernel", choices=["decode", "varlen", "store"])
    p.add_argument("--preset", choices=list(tq.PRESETS), default="turboquant_4bit_nc")
    p.add_argument("--shape", type=int, nargs=4, metavar=("B", "HQ", "HKV", "L"), default=(32, 32, 8, 8192),
                   help="decode shape")
    p.add_argument("--table-tokens", type=int, default=0, help="decode: block tables that could hold this many tokens")
    p.add_argument("--splits", type=int, default=0, help="decode: a forced split count (0: the library's)")
    p.add_argument("--tokens", type=int, default=65536, help="store tokens")
    p.add_argument("--q-len", type=int, default=128, help="varlen: query tokens of the chunk")
    p.add_argument("--transforms", action="store_true", help="store: with key_offset, key_scale and value_offset")
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    step = {"decode": decode_step, "varlen": varlen_step, "store": store_step}[a.kernel](a)
    for _ in range(a.steps):
        step()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
