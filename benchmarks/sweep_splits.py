"""Decode time against the number of splits, for the batch sizes where the default heuristic
(decode_num_splits in turboquant/split_plan.h: one wave of one or two CTAs per SM) has a choice,
for whichever kernel the default picks (TURBOQUANT_DECODE_KERNEL=heads|rows forces one).
Evidence for the split rule: one row per (shape, preset), graph replay in rotation over
enough caches to defeat the L2, the default ("auto") next to fixed counts.

    python benchmarks/sweep_splits.py [--short] [--out results.md]

--short: the short contexts instead (B = 1..8, L = 256..4k, one L2-resident input set, as in
bench_decode.py's short table), where the split count's lower bound (the tokens a split keeps) rules.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import turboquant as tq  # noqa: E402
from bench_decode import HEAD_DIM, build_cache, with_table_tokens  # noqa: E402
from timing import append_markdown, copies_to_defeat_l2, graph_replays, time_us  # noqa: E402

# Batch 1..16 at GQA 4 and 8 KV heads: 8..128 CTAs before splitting, so the default picks 33..2.
# B = 1 at 16k and 8k: the per-head kernel's one-or-two-per-SM threshold (7 tiles per warp) below 32k.
SHAPES = [(1, 32, 8, 32768), (1, 32, 8, 16384), (1, 32, 8, 8192), (2, 32, 8, 16384), (4, 32, 8, 16384),
          (8, 32, 8, 8192), (16, 32, 8, 8192)]
# 64 and 128: the row-staged kernel (decode_rows.cu) runs one CTA per sequence and split at 8 KV heads.
SPLITS = [0, 1, 2, 4, 8, 16, 33, 64, 128]
SHORT_SHAPES = [(1, 32, 8, 256), (1, 32, 8, 512), (1, 32, 8, 1024), (2, 32, 8, 1024), (4, 32, 8, 1024),
                (8, 32, 8, 1024), (1, 32, 8, 2048), (2, 32, 8, 2048), (1, 32, 8, 4096), (2, 32, 8, 4096)]
SHORT_SPLITS = [0, 1, 2, 4, 8, 16, 32]
PRESETS = ["turboquant_4bit_nc", "turboquant_k8v4"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="append the table to this markdown file")
    p.add_argument("--short", action="store_true", help="short contexts, L2-resident")
    p.add_argument("--table-tokens", type=int, default=0,
                   help="block tables that could hold this many tokens (a serving engine's, sized to its longest "
                        "model length; the extra entries are never read), not exactly L")
    a = p.parse_args()
    shapes, splits_list = (SHORT_SHAPES, SHORT_SPLITS) if a.short else (SHAPES, SPLITS)
    header = ("| B | Hq | Hkv | L | preset | " + " | ".join(f"splits {s or 'auto'} us" for s in splits_list) + " |\n|"
              + "---|" * (5 + len(splits_list)))
    lines = [f"Decode vs splits, D={HEAD_DIM}, block_size 16, {torch.cuda.get_device_name()}, graph replay"
             + (", one input set (L2-resident)" if a.short else ", enough caches to defeat the L2")
             + (f"; block tables of {a.table_tokens} tokens" if a.table_tokens else "; block tables of exactly L tokens")
             + " (the split rule caps splits by the table's capacity); the per-head"
             " kernel merges 2 splits in a cluster, more through the merge kernel", "", header]
    print("\n".join(lines), flush=True)
    for (b, hq, hkv, length) in shapes:
        for preset in PRESETS:
            packed = b * hkv * length * tq.slot_layout(preset, HEAD_DIM).slot_size_aligned
            caches = [with_table_tokens(build_cache(preset, b, hkv, length, s), a.table_tokens)
                      for s in range(1 if a.short else copies_to_defeat_l2(packed))]
            q = torch.randn(b, hq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            seq_lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
            cells = []
            for splits in splits_list:
                fns = [lambda c=c, s=splits: tq.decode(q, c[0], c[1], seq_lens, preset, HEAD_DIM ** -0.5, s)
                       for c in caches]
                cells.append(f"{time_us(graph_replays(fns)):.1f}")
            row = f"| {b} | {hq} | {hkv} | {length} | {preset.replace('turboquant_', '')} | " + " | ".join(cells) + " |"
            lines.append(row)
            print(row, flush=True)
            del caches
            torch.cuda.empty_cache()
    append_markdown(a.out, lines)


if __name__ == "__main__":
    main()
