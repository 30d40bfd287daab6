"""The quality targets on real models: each preset alone, with each of the cache's two quality
options (``calibrate=True``; ``exact_recent=64``) and with both, against the plain cache.

    python benchmarks/targets.py [--protocol decode|serving] [--models ...] [--presets ...] [--windows 3]
                                 [--columns ...] [--out benchmarks/RESULTS.md]

Protocols of turboquant/evaluation.py, over 2,048-token windows, the first and last two layers plain
(the library's default):

* ``decode`` (the default; the case that loses most): the window's last 256 tokens decoded one at
  a time, each step reading the cache. Writes the ``targets`` section.
* ``serving``: the window fed in 256-token chunks, each attending to its own raw K/V and the packed
  cache of the earlier chunks, as a serving engine's prefill does. Writes the ``targets-serving``
  section.

Each cell: the perplexity change against the plain cache and the mean KL(plain || cache) per
predicted token, in nats (in serving, over every token of the window: the first chunk's, which
attend to raw K/V only, add none).

Each perplexity change comes with its standard error, paired per token with the plain cache
(``evaluation.perplexity_change``); where the run has the ``preset alone`` column, each other
column of a preset is also paired with it, and a cell higher than it by more than ``WORSE_SE``
standard errors is marked (the targets' "never worse than without the option").

Same packed bytes per token in every column; ``exact_recent=64`` adds 64 raw tokens per sequence
and layer, whatever the context, and ``calibrate=True`` one block (16 tokens) where it centers keys
(``Calibration.exact_first_block``). ``--columns`` measures some of the columns only (a decode
table takes about 2 h on 2 CPU cores), or adds those with ``shift_packed_logits=True``
(``"both, shift"``, ...).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from transformers import DynamicCache

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import turboquant.hf as tqhf  # noqa: E402
from turboquant import PRESETS as ALL_PRESETS, assets, evaluation as ev  # noqa: E402
from real_model import model_sections, progress, write_model_sections  # noqa: E402

PRESETS = ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc"]
# column name -> TurboQuantCache keywords
OPTIONS = {
    "preset alone": {},
    "calibrate=True": {"calibrate": True},
    "exact_recent=64": {"exact_recent": 64},
    "both": {"calibrate": True, "exact_recent": 64},
}
# columns measured on request only (--columns): the same with the packed-logit shift (turboquant.packed_noise)
OPTIONS.update({f"{name}, shift": {**options, "shift_packed_logits": True} for name, options in list(OPTIONS.items())})
DEFAULT_COLUMNS = ["preset alone", "calibrate=True", "exact_recent=64", "both"]
# the quality targets: perplexity change at most this many percent per preset
TARGETS = {"turboquant_k8v4": 1.0, "turboquant_4bit_nc": 3.0, "turboquant_k3v4_nc": 8.0}
# An option is "worse than the preset alone" where its perplexity, paired per token with the preset
# alone's, is higher by more than this many standard errors.
WORSE_SE = 2.0


def worse_than_alone(alone_nlls: torch.Tensor, nlls: torch.Tensor) -> bool:
    """Whether ``nlls`` (an option's) lose more than ``WORSE_SE`` standard errors of perplexity to
    ``alone_nlls`` (the preset alone's, the same tokens)."""
    change, error = ev.perplexity_change(alone_nlls, nlls)
    return change > WORSE_SE * error


def model_table(name: str, windows: int, presets: list[str], protocol: str, columns: list[str]) -> tuple[list[str], str]:
    model, tok = assets.load_model(name=name)
    wins = ev.windows(tok(assets.text(), return_tensors="pt").input_ids, 2048, windows)
    start = time.time()

    def measure(make, reference=None):  # -> per-token NLLs of every window, their log-probs, KL or None
        log_probs_of = ev.serving_log_probs if protocol == "serving" else ev.decode_log_probs
        nlls, runs, kls = [], [], []
        for i, w in enumerate(wins):  # a window at a time: a serving window's log-probs take 2 GB at 262k tokens
            log_probs = log_probs_of(model, w, make)
            nlls.append(ev.token_nlls(log_probs, w))
            if reference is None:
                runs.append(log_probs)
            else:
                kls.append(ev.mean_kl(reference[i], log_probs))
        return torch.cat(nlls), runs, None if reference is None else sum(kls) / len(kls)

    reference_nlls, reference, _ = measure(DynamicCache)
    base = reference_nlls.double().mean().exp().item()
    cells, done, total = {}, 0, len(presets) * len(columns)
    # "preset alone" first, so that every other column of a preset is compared with it
    order = sorted(columns, key=lambda c: c != "preset alone")
    for preset in presets:
        alone_nlls = None
        for column in order:
            options = OPTIONS[column]
            nlls, _, kl = measure(lambda p=preset, o=options: tqhf.TurboQuantCache(model.config, preset=p, **o),
                                  reference)
            change, error = ev.perplexity_change(reference_nlls, nlls)
            mark = "" if change <= TARGETS.get(preset, float("inf")) else " ✗"
            if column == "preset alone":
                alone_nlls = nlls
            elif alone_nlls is not None and worse_than_alone(alone_nlls, nlls):
                mark += " ▲"
            cells[(preset, column)] = f"{change:+.1f} ± {error:.1f} %{mark} / {kl:.3f}"
            done += 1
            progress(done, total, f"{name}: {preset[11:]} {column}", start)
    lines = ["| preset (target) | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for preset in presets:
        target = f"+{TARGETS[preset]:.0f} %" if preset in TARGETS else "none"
        lines.append(f"| {preset.replace('turboquant_', '')} ({target}) | "
                     + " | ".join(cells[(preset, c)] for c in columns) + " |")
    return lines, f"plain-cache {protocol} perplexity {base:.2f}; {time.time() - start:.0f} s"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--protocol", choices=["decode", "serving"], default="decode")
    p.add_argument("--models", nargs="+", default=list(assets.MODEL_NAMES), choices=assets.MODEL_NAMES)
    p.add_argument("--presets", nargs="+", default=PRESETS, choices=list(ALL_PRESETS))
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--columns", nargs="+", default=DEFAULT_COLUMNS, choices=list(OPTIONS))
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"))
    a = p.parse_args()
    torch.manual_seed(0)
    sections = model_sections(a.models, lambda name: model_table(name, a.windows, a.presets, a.protocol, a.columns))
    cells = ("the perplexity change ± its standard error (paired per token with the plain cache) / the mean "
             "KL(plain || cache) per predicted token in nats")
    how = ("the last 256 decoded one at a time" if a.protocol == "decode" else
           "fed in 256-token chunks that attend to their own raw K/V and the packed earlier chunks")
    write_model_sections(
        a.out, "targets" if a.protocol == "decode" else "targets-serving", "benchmarks/targets.py",
        f"## Against the quality targets ({a.protocol}): each preset alone, calibrated, with exact recent tokens, "
        "and both",
        f"{a.protocol.capitalize()} perplexity against the plain cache, {a.windows} window(s) of 2,048 tokens, {how}; "
        f"each cell is {cells}; ✗ marks a cell past its preset's target (k8v4 +1 %, 4bit_nc +3 %, k3v4_nc +8 %), "
        f"▲ an option's perplexity above the preset alone's by more than {WORSE_SE:g} standard errors (paired per "
        "token with it). "
        "Columns: `TurboQuantCache(model.config, preset=..., calibrate=True, exact_recent=64)` and the parts of it.",
        sections)


if __name__ == "__main__":
    main()
