"""Continuation chunks: where decode_varlen stops paying off against dequantize + SDPA.

A continuation chunk of q_len tokens over a context of L cached tokens (the chunk's own included)
is attended either by ``decode_varlen`` on the packed cache (no dense copy; the decode kernel
serves 8 // group query tokens per CTA, the chunked kernel 64 // group) or by
``dequantize`` into dense K/V and SDPA with a bottom-right causal mask (one read of the packed
context, a dense write and read, then attention). Times, for one sequence:
  * varlen: ``tq.decode_varlen``;
  * dense: dequantize + PagedAttentionLayer._sdpa (the reference layer's path: SDPA in the query
    dtype with a lower-right causal bias, what a serving stack would run).
Prints, per context length, the largest q_len up to which decode_varlen is faster; the layer's
``varlen_threshold`` is set from the long contexts, where the choice matters (short ones are
dominated by host overhead in eager mode, see RESULTS.md).

    python benchmarks/bench_continuation.py [--preset turboquant_4bit_nc] [--kernel auto|decode|chunked] [--out results.md]

``--kernel`` forces decode_varlen's kernel (TURBOQUANT_VARLEN_KERNEL): kernels/decode.cu or
kernels/decode_chunked.cu; ``auto`` (default) lets the library pick by shape.
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
from bench_decode import HEAD_DIM, build_cache  # noqa: E402
from timing import append_markdown, time_us  # noqa: E402
from turboquant.attention import PagedAttentionLayer  # noqa: E402

HQ, HKV = 32, 8
Q_LENS = (1, 2, 4, 8, 16, 32, 64, 128)
CONTEXTS = (2048, 8192, 32768)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=list(tq.PRESETS), default="turboquant_4bit_nc")
    p.add_argument("--kernel", choices=["auto", "decode", "chunked"], default="auto",
                   help="decode_varlen's kernel (default: the library's choice by shape)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.kernel != "auto":  # read by the library at its first varlen launch
        os.environ["TURBOQUANT_VARLEN_KERNEL"] = a.kernel
    else:  # an inherited override would mislabel the run
        os.environ.pop("TURBOQUANT_VARLEN_KERNEL", None)
    kernel = {"auto": "kernel the library picks by shape", "decode": "decode kernel (8 columns per CTA)",
              "chunked": "chunked kernel (64 columns per CTA)"}[a.kernel]
    scale = HEAD_DIM ** -0.5
    lines = [f"Continuation chunk of one sequence, Hq={HQ}, Hkv={HKV}, D={HEAD_DIM}, {a.preset}, bf16, "
             f"{torch.cuda.get_device_name()}; decode_varlen on the {kernel}; {datetime.date.today()}", "",
             "| L | q_len | decode_varlen us | dequantize + SDPA us | decode_varlen faster |",
             "|---|---|---|---|---|"]
    print(lines[0], flush=True)
    wins = {}
    for length in CONTEXTS:
        cache, block_table = build_cache(a.preset, 1, HKV, length)
        seq_lens = torch.tensor([length], dtype=torch.int32, device="cuda")
        for q_len in Q_LENS:
            q = torch.randn(q_len, HQ, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            loc = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")

            def dense():
                return tq.dequantize(cache, block_table, seq_lens, a.preset, torch.bfloat16)

            varlen = time_us([lambda: tq.decode_varlen(q, cache, block_table, seq_lens, loc, a.preset, scale)], reps=15)
            dense_us = time_us([lambda: PagedAttentionLayer._sdpa(q, *(t[0] for t in dense()), scale)], reps=15)
            wins.setdefault(q_len, []).append(varlen < dense_us)
            lines.append(f"| {length} | {q_len} | {varlen:.1f} | {dense_us:.1f} | {'yes' if varlen < dense_us else 'no'} |")
            print(lines[-1], flush=True)
    lines.append("")
    for i, length in enumerate(CONTEXTS):  # wins[q][i]: decode_varlen faster at CONTEXTS[i]
        best = max([q for q in Q_LENS if all(wins[r][i] for r in Q_LENS if r <= q)] or [0])
        lines.append(f"L={length}: decode_varlen faster up to q_len {best}" if best else
                     f"L={length}: dequantize + SDPA faster at every q_len")
        print(lines[-1], flush=True)
    append_markdown(a.out, lines)


if __name__ == "__main__":
    main()
