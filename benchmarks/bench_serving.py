"""Decode with a serving engine's block tables: each sequence's row of the block table sized for the
longest model length (32k tokens by default; the entries past a sequence's blocks are never read),
as vLLM allocates them. The library sees only shapes, so its kernel choice and the grid's split
count see the table's capacity, never the lengths (the per-head kernel then gives each sequence
the splits of its own length on the device, or the grid's where those would fill one CTA per SM of
a grid sized for two; the row kernel divides it over the whole grid): this
table shows what that costs at every length, for the default choice, for each plain-decode kernel
forced (TURBOQUANT_DECODE_KERNEL, read once per process, hence one subprocess per kernel), next to
SDPA bf16 over a dense cache of the same length. A second table times batches of mixed lengths (no SDPA: a dense cache would pad every
sequence to the longest).

    python benchmarks/bench_serving.py [--table-tokens 32768] [--batches 3 4 5] [--kernels heads rows]
                                       [--presets ...] [--no-mixed] [--out results.md]

Graph replay of one decode step, D = 128, Hq 32, Hkv 8, block size 16, auto splits; input sets
rotated as in bench_decode.py's main table (enough to defeat the L2 from ~16 MB per set up;
smaller sets stay L2-resident, as a short context's cache does in one step).
"""

import argparse
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import turboquant as tq  # noqa: E402
from bench_decode import HEAD_DIM, build_cache, sdpa_best_us, with_table_tokens  # noqa: E402
from timing import append_markdown, copies_to_defeat_l2, graph_replays, time_us  # noqa: E402

BATCHES = [1, 2, 3, 4, 8]  # 3: the first batch the row kernel takes at 8 KV heads (kMinRowKernelRows)
LENGTHS = [256, 1024, 4096, 16384, 32768]
HQ, HKV = 32, 8
PRESETS = ["turboquant_4bit_nc", "turboquant_k8v4"]
KERNELS = ["default", "heads", "rows"]
# Batches of mixed lengths (a serving engine's decode batch): short and long sequences side by side.
MIXED_BATCHES = [[256, 32768, 1024, 16384], [256, 1024, 4096, 16384, 512, 2048, 8192, 32768],
                 [1024] * 7 + [32768], [512, 512, 512, 512, 16384, 16384, 16384, 16384]]


def ours_us(b, length, preset, table_tokens, lens=None):
    """One step's us; every sequence `length` tokens long, or `lens` (in a cache of `length` per sequence)."""
    packed = b * HKV * length * tq.slot_layout(preset, HEAD_DIM).slot_size_aligned
    caches = [with_table_tokens(build_cache(preset, b, HKV, length, s), table_tokens)
              for s in range(copies_to_defeat_l2(packed))]
    q = torch.randn(b, HQ, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens if lens is not None else [length] * b, dtype=torch.int32, device="cuda")
    fns = [lambda c=c: tq.decode(q, c[0], c[1], seq_lens, preset, HEAD_DIM ** -0.5, 0) for c in caches]
    return time_us(graph_replays(fns))


def measure_ours(table_tokens, batches, mixed, presets):
    """{"b,length,preset": us} for this process's kernel choice."""
    times = {}
    for b in batches:
        for length in LENGTHS:
            for preset in presets:
                times[f"{b},{length},{preset}"] = ours_us(b, length, preset, table_tokens)
                torch.cuda.empty_cache()  # the shape's caches and graphs are gone with ours_us' frame
    for lens in MIXED_BATCHES if mixed else []:
        for preset in presets:
            times[f"mixed {lens},{preset}"] = ours_us(len(lens), max(lens), preset, table_tokens, lens)
            torch.cuda.empty_cache()
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="append the table to this markdown file")
    p.add_argument("--table-tokens", type=int, default=32768)
    p.add_argument("--batches", type=int, nargs="+", default=BATCHES)
    p.add_argument("--kernels", nargs="+", choices=KERNELS, default=KERNELS,
                   help="kernel choices to time (the first one is compared with SDPA)")
    p.add_argument("--presets", nargs="+", default=PRESETS, choices=list(tq.PRESETS))
    p.add_argument("--no-mixed", action="store_true", help="leave out the batches of mixed lengths")
    p.add_argument("--ours-only", action="store_true", help=argparse.SUPPRESS)  # a kernel's subprocess
    a = p.parse_args()
    torch.manual_seed(0)
    mixed = not a.no_mixed
    if a.ours_only:
        print(json.dumps(measure_ours(a.table_tokens, a.batches, mixed, a.presets)))
        return
    times = {}
    for kernel in a.kernels:
        env = dict(os.environ)
        env.pop("TURBOQUANT_DECODE_KERNEL", None)
        if kernel != "default":
            env["TURBOQUANT_DECODE_KERNEL"] = kernel
        print(f"timing the {kernel} kernel choice ...", flush=True)
        args = ["--ours-only", "--table-tokens", str(a.table_tokens), "--batches", *map(str, a.batches),
                "--presets", *a.presets]
        run = subprocess.run([sys.executable, __file__, *args, *(["--no-mixed"] if not mixed else [])],
                             env=env, capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"the {kernel} kernel's run failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")
        times[kernel] = json.loads(run.stdout.strip().splitlines()[-1])
    names = {"default": "default", "heads": "per-head forced", "rows": "row forced"}
    columns = [names[k] for k in a.kernels]
    lines = [f"Decode with block tables of {a.table_tokens} tokens (a serving engine's), D={HEAD_DIM}, Hq {HQ}, "
             f"Hkv {HKV}, block size 16, {torch.cuda.get_device_name()}, graph replay, us; speed-up of the "
             f"{columns[0]} choice over SDPA bf16 (dense cache of L)", "",
             f"| B | L | SDPA bf16 | preset | {' | '.join(columns)} | {columns[0]} vs SDPA |",
             "|---|---|---|---|" + "---|" * (len(columns) + 1)]
    print("\n".join(lines), flush=True)
    for b in a.batches:
        for length in LENGTHS:
            sdpa, backend = sdpa_best_us(b, HQ, HKV, length, graphed=True)[2:4]
            for preset in a.presets:
                key = f"{b},{length},{preset}"
                us = [times[k][key] for k in a.kernels]
                row = (f"| {b} | {length} | {sdpa:.1f} | {preset.replace('turboquant_', '')} | "
                       f"{' | '.join(f'{t:.1f}' for t in us)} | {sdpa / us[0]:.2f}x |")
                lines.append(row)
                print(row, flush=True)
    if mixed:
        table = ["", "Batches of mixed lengths, the same tables, us", "",
                 f"| lengths | preset | {' | '.join(columns)} |", "|---|---|" + "---|" * len(columns)]
        for lens in MIXED_BATCHES:
            for preset in a.presets:
                us = [times[k][f"mixed {lens},{preset}"] for k in a.kernels]
                table.append(f"| {' '.join(str(n) for n in lens)} | {preset.replace('turboquant_', '')} | "
                             f"{' | '.join(f'{t:.1f}' for t in us)} |")
        print("\n".join(table), flush=True)
        lines += table
    append_markdown(a.out, lines)


if __name__ == "__main__":
    main()
