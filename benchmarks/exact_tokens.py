"""What keeping some tokens unquantized buys: the first tokens of each sequence (attention sinks)
and the most recent ones, on real models, without and with calibration.

    python benchmarks/exact_tokens.py [--models ...] [--windows 1] [--choices 0+0 4+0 0+64 ...]
                                      [--out benchmarks/RESULTS.md]

The last tokens are the cache's own option (``TurboQuantCache(..., exact_recent=N)``: the packed
decode merged with an exact attention over them). Keeping the first tokens is an emulation, not a
cache the library offers: its layers attend over the dequantized packed cache with those positions'
raw K/V put back (dense attention, every step). The packed bytes are the presets' own; what a kept
token costs is its raw K/V beside them (2 x D x 2 bytes per KV head in bf16, per layer and
sequence, whatever the context). Decode protocol of turboquant/evaluation.py (every
token of the window's last 256 read back from the cache, the case that loses most), 2,048-token
windows, the first and last two layers plain. Writes the ``exact-tokens`` section of RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch
from transformers import DynamicCache

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import turboquant.hf as tqhf  # noqa: E402
from turboquant import PRESETS as ALL_PRESETS, assets, evaluation as ev  # noqa: E402
from turboquant.attention import PagedAttentionLayer, dense_attention, visible_keys  # noqa: E402
from real_model import model_sections, progress, write_model_sections  # noqa: E402

PRESETS = ["turboquant_4bit_nc", "turboquant_k3v4_nc"]
# (first tokens kept, last tokens kept)
CHOICES = [(0, 0), (4, 0), (0, 64), (4, 64), (0, 16)]


def emulated_layer(first: int, recent: int):
    """A PagedAttentionLayer whose attention sees the raw K/V of each sequence's first ``first`` and
    last ``recent`` positions (kept by slot when stored) in place of their packed ones."""

    class KeepsTokens(PagedAttentionLayer):
        def _store(self, key, value, slot_mapping, query_start_loc, query=None, scale=None):
            super()._store(key, value, slot_mapping, query_start_loc, query, scale)
            if not hasattr(self, "raw"):
                self.raw = {}
            for i in (slot_mapping >= 0).nonzero().flatten().tolist():
                self.raw[int(slot_mapping[i])] = (key[i].clone(), value[i].clone())

        def _dense(self, block_table, seq_lens):
            # A windowed layer's long chunk passes its table from the window's first block on:
            # "first" then keeps that block's first positions (never attended sinks), a small
            # overstatement for the sliding layers of Gemma 3 only.
            k, v = (t.clone() for t in super()._dense(block_table, seq_lens))
            bs = self.block_size
            for b in range(block_table.shape[0]):
                n = int(seq_lens[b])
                for p in sorted(set(range(min(first, n))) | set(range(max(0, n - recent), n))):
                    slot = int(block_table[b, p // bs]) * bs + p % bs
                    k[b, p], v[b, p] = (t.to(k.dtype) for t in self.raw[slot])
            return k, v

        def _decode(self, query, block_table, seq_lens, scale):  # dense over _dense's K/V
            k, v = self._dense(block_table, seq_lens)
            position = torch.arange(k.shape[1], device=query.device)[None, :]
            visible = visible_keys(position, seq_lens[:, None].long() - 1, self.window_left)
            out = dense_attention(query.float().unsqueeze(2), k.transpose(1, 2).float(), v.transpose(1, 2).float(),
                                  visible[:, None, None, :], scale, self.softcap, self.sinks)
            return out[:, :, 0].to(query.dtype)

    return KeepsTokens


@contextlib.contextmanager
def layers_keeping(first: int, recent: int):
    """turboquant.hf builds its attention layers from this class while the context is open (the
    emulation where first tokens are kept; the library's own layers otherwise)."""
    saved = tqhf.PagedAttentionLayer
    tqhf.PagedAttentionLayer = emulated_layer(first, recent) if first else saved
    try:
        yield
    finally:
        tqhf.PagedAttentionLayer = saved


def model_rows(name: str, windows: int, choices: list[tuple[int, int]], presets: list[str]) -> tuple[list[str], str]:
    model, tok = assets.load_model(name=name)
    wins = ev.windows(tok(assets.text(), return_tensors="pt").input_ids, 2048, windows)
    base = ev.perplexity([ev.decode_nll(model, w, DynamicCache) for w in wins])
    rows, start, done = {}, time.time(), 0
    total = len(presets) * 2 * len(choices)
    for preset in presets:
        for calibrate in (None, True):
            for first, recent in choices:
                # varlen_threshold=0: continuation chunks take the dequantized-prefix path, which
                # the emulation covers (decode_varlen would read the packed cache alone).
                make = lambda p=preset, c=calibrate, r=0 if first else recent: tqhf.TurboQuantCache(
                    model.config, preset=p, calibrate=c, varlen_threshold=0, exact_recent=r)
                with layers_keeping(first, recent):
                    ppl = ev.perplexity([ev.decode_nll(model, w, make) for w in wins])
                rows[(preset, calibrate, first, recent)] = 100 * (ppl / base - 1)
                done += 1
                progress(done, total, f"{name}: {preset[11:]} {'cal ' if calibrate else ''}{first}+{recent}", start)
    head = "| preset | calibrate | " + " | ".join(choice_name(f, r) for f, r in choices) + " |"
    lines = [head, "|---|---|" + "---|" * len(choices)]
    for preset in presets:
        for calibrate in (None, True):
            cells = [f"{rows[(preset, calibrate, f, r)]:+.1f} %" for f, r in choices]
            lines.append(f"| {preset.replace('turboquant_', '')} | {'yes' if calibrate else 'no'} | " + " | ".join(cells) + " |")
    return lines, f"plain-cache decode perplexity {base:.2f}; {time.time() - start:.0f} s"


def choice_name(first: int, recent: int) -> str:
    if not first and not recent:
        return "all packed"
    return " + ".join(([f"first {first}"] if first else []) + ([f"last {recent}"] if recent else [])) + " exact"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(assets.MODEL_NAMES), choices=assets.MODEL_NAMES)
    p.add_argument("--windows", type=int, default=1)
    p.add_argument("--choices", nargs="+", default=[f"{f}+{r}" for f, r in CHOICES],
                   help="FIRST+LAST: tokens kept exact at each sequence's start and end")
    p.add_argument("--presets", nargs="+", default=PRESETS, choices=list(ALL_PRESETS))
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"))
    a = p.parse_args()
    torch.manual_seed(0)
    choices = [tuple(int(n) for n in c.split("+")) for c in a.choices]
    sections = model_sections(a.models, lambda name: model_rows(name, a.windows, choices, a.presets))
    write_model_sections(
        a.out, "exact-tokens", "benchmarks/exact_tokens.py",
        "## Keeping tokens unquantized: attention sinks and the most recent tokens (emulated)",
        f"Decode perplexity against the plain cache, {a.windows} window(s) of 2,048 tokens, the last 256 decoded "
        "one at a time; each column keeps those positions of every sequence as raw K/V and the rest packed "
        "(the last ones: `exact_recent`; the first ones: an emulation by dense attention, the script's "
        "docstring); calibrate: `calibrate=True`.",
        sections)

if __name__ == "__main__":
    main()
