"""What the ops' per-head transforms (key_offset, key_scale, value_offset; csrc/kv_transform.h) cost
on the GPU: decode and store with all three against without, same shapes, graph replay, in
alternating rounds in one process (median of the rounds).

    python benchmarks/bench_transforms.py [--rounds 5] [--out results.md]
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
from bench_decode import alternating_rounds_us, build_cache  # noqa: E402
from timing import append_markdown, copies_to_defeat_l2, graph_replays  # noqa: E402

PRESET, D = "turboquant_4bit_nc", 128
SHAPES = [(1, 32, 8, 8192), (8, 32, 8, 8192), (32, 32, 8, 2048)]  # (B, Hq, Hkv, L)


def transforms(hkv):
    g = torch.Generator(device="cuda").manual_seed(1)
    return {"key_offset": torch.randn(hkv, D, device="cuda", generator=g),
            "key_scale": torch.rand(hkv, D, device="cuda", generator=g) + 0.5,
            "value_offset": torch.randn(hkv, D, device="cuda", generator=g)}


def decode_replays(b, hq, hkv, length, with_transforms, return_lse=False):
    read = b * hkv * length * tq.slot_layout(PRESET, D).slot_size_aligned
    caches = [build_cache(PRESET, b, hkv, length, s, head_dim=D) for s in range(copies_to_defeat_l2(read))]
    q = torch.randn(b, hq, D, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    t = transforms(hkv) if with_transforms else {}
    return graph_replays([lambda c=c: tq.decode(q, c[0], c[1], seq_lens, PRESET, D ** -0.5, return_lse=return_lse, **t)
                          for c in caches])


def store_replays(tokens, hkv, with_transforms, only=None):
    """Graph replays of a store, with all three transforms, or with the one named `only`."""
    cache = tq.allocate_kv_cache(tokens // 16, 16, hkv, D, PRESET, "cuda")
    k = torch.randn(tokens, hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.arange(tokens, device="cuda")
    t = {name: x for name, x in transforms(hkv).items() if only in (None, name)} if with_transforms else {}
    return graph_replays([lambda: tq.store_kv(k, v, cache, slots, PRESET, **t)])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.manual_seed(0)
    lines = [f"Per-head transforms, {torch.cuda.get_device_name()}, {datetime.date.today()}: {PRESET}, D = {D}, "
             "bf16, graph replay, alternating rounds, median", "",
             "| op | B or tokens | Hq | Hkv | L | plain us | with transforms us | ratio |", "|---|---|---|---|---|---|---|---|"]
    print(lines[0], flush=True)
    for (b, hq, hkv, length) in SHAPES:
        plain, ours, _ = alternating_rounds_us(decode_replays(b, hq, hkv, length, False),
                                               decode_replays(b, hq, hkv, length, True), a.rounds)
        lines.append(f"| decode | {b} | {hq} | {hkv} | {length} | {plain:.1f} | {ours:.1f} | {ours / plain:.2f} |")
        print(lines[-1], flush=True)
    # With the log-sum-exp (what a layer with exact_recent asks): key_offset shifts it outside the kernel.
    b, hq, hkv, length = SHAPES[0]
    plain, ours, _ = alternating_rounds_us(decode_replays(b, hq, hkv, length, False, True),
                                           decode_replays(b, hq, hkv, length, True, True), a.rounds)
    lines.append(f"| decode_lse | {b} | {hq} | {hkv} | {length} | {plain:.1f} | {ours:.1f} | {ours / plain:.2f} |")
    print(lines[-1], flush=True)
    for tokens in (16, 4096):
        plain, ours, _ = alternating_rounds_us(store_replays(tokens, 8, False), store_replays(tokens, 8, True), a.rounds)
        lines.append(f"| store_kv | {tokens} | | 8 | | {plain:.1f} | {ours:.1f} | {ours / plain:.2f} |")
        print(lines[-1], flush=True)
    for only in ("key_offset", "key_scale", "value_offset"):  # which of them a store pays for
        plain, ours, _ = alternating_rounds_us(store_replays(4096, 8, False), store_replays(4096, 8, True, only),
                                               a.rounds)
        lines.append(f"| store_kv, {only} only | 4096 | | 8 | | {plain:.1f} | {ours:.1f} | {ours / plain:.2f} |")
        print(lines[-1], flush=True)
    append_markdown(a.out, lines)


if __name__ == "__main__":
    main()
