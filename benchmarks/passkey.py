"""Passkey retrieval per preset, without and with calibration (and exact recent tokens), on a model
that retrieves well with the plain cache (SmolLM2-135M finds 3-9 of 20 keys with it, too few to
tell the presets apart).

    python benchmarks/passkey.py [--model qwen2.5-coder-0.5b] [--lengths 2048 4096] [--trials 10]
                                 [--presets ...] [--exact-recent 64] [--section passkey]
                                 [--out benchmarks/RESULTS.md]

Protocol of turboquant/evaluation.py: a 5-digit key at a random depth of the text, the context
prefilled once with transformers' plain cache and loaded into each cache (calibrated caches fit
their transformations on it), the question fed as a later chunk, 8 tokens decoded greedily from the
cache; the first and last two layers stay plain. Writes the ``passkey`` section of RESULTS.md (or
the one ``--section`` names: long contexts take a run, and a section, of their own).
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import shlex
import sys
import time

from transformers import DynamicCache

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import turboquant as tq  # noqa: E402
import turboquant.hf as tqhf  # noqa: E402
from turboquant import assets, evaluation as ev  # noqa: E402
from speed import current_commit, replace_section  # noqa: E402


def kinds(model, presets, exact_recent: int = 0) -> dict:
    """The plain cache, and each preset alone and calibrated; with ``exact_recent``, also with that
    many exact recent tokens, alone and calibrated."""
    out = {"plain": DynamicCache}
    variants = {"": {}, " calibrated": {"calibrate": True}}
    if exact_recent:
        variants[f" exact_recent={exact_recent}"] = {"exact_recent": exact_recent}
        variants[f" calibrated, exact_recent={exact_recent}"] = {"calibrate": True, "exact_recent": exact_recent}
    for preset in presets:
        for suffix, options in variants.items():
            out[preset.replace("turboquant_", "") + suffix] = (
                lambda p=preset, o=options: tqhf.TurboQuantCache(model.config, preset=p, **o))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b", choices=assets.MODEL_NAMES)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--presets", nargs="+", choices=list(tq.PRESETS), default=list(tq.PRESETS))
    p.add_argument("--exact-recent", type=int, default=0,
                   help="also each preset with this many exact recent tokens, alone and calibrated")
    p.add_argument("--section", default="passkey", help="the RESULTS.md section the table replaces")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"))
    a = p.parse_args()
    assets.ensure_installed(a.model)
    started = time.time()
    model, tokenizer = assets.load_model(name=a.model)
    text = assets.text()
    caches = kinds(model, a.presets, a.exact_recent)
    hits = {name: {n: 0 for n in a.lengths} for name in caches}
    for n in a.lengths:
        rng = random.Random(n)
        for trial in range(a.trials):
            context, question, key = ev.passkey_prompt(tokenizer, text, n, rng)
            answers = ev.passkey_answers(model, tokenizer, context, question, caches)
            for name, answer in answers.items():
                hits[name][n] += ev.found(answer, key)
            print(f"{n} tokens, trial {trial + 1}/{a.trials} ({time.time() - started:.0f} s): "
                  + ", ".join(f"{name} {hits[name][n]}" for name in caches), flush=True)
    commit = current_commit()
    command = "python benchmarks/passkey.py " + shlex.join(sys.argv[1:])
    lines = [f"{datetime.date.today()}, CPU, commit {commit}, `{command.strip()}` ({time.time() - started:.0f} s). "
             f"Model {a.model} in float32; {a.trials} trials per length (keys found of {a.trials}); the protocol "
             "in the script's docstring. Calibrated: `TurboQuantCache(..., calibrate=True)`, fitted on the "
             "loaded context (no queries there: the offset rule picks each head's transformations); "
             "exact_recent: `TurboQuantCache(..., exact_recent=N)`.", "",
             "| cache | " + " | ".join(f"{n} tokens" for n in a.lengths) + " |",
             "|---|" + "---|" * len(a.lengths)]
    lines += [f"| {name} | " + " | ".join(f"{hits[name][n]}/{a.trials}" for n in a.lengths) + " |" for name in caches]
    span = f"{min(a.lengths):,}" + (f"-{max(a.lengths):,}" if max(a.lengths) > min(a.lengths) else "")
    title = f"## Passkey retrieval, {a.model}, {span} tokens"
    body = "\n".join([title, "", *lines])
    print(body)
    replace_section(a.out, a.section, body, "benchmarks/passkey.py")


if __name__ == "__main__":
    main()
