"""Raw and packed keys in one softmax: what lowering the packed keys' logits by their expected noise buys.

    python benchmarks/packed_shift.py MODEL [--presets ...] [--configs RECENT:SHIFT ...] [--windows 1] [--excess]

An emulation, not the cache: one forward of each 2,048-token window in which every attention layer
(but the first and last two) lets query ``t`` attend to the raw K/V of its last RECENT positions
(itself included; 0: none) and to the packed-then-dequantized K/V (``roundtrip.packed``) of the
others, as a decode step with ``exact_recent=RECENT`` does at every position. RECENT ``serving``
instead keeps raw the keys of the query's own 256-token chunk, as the serving protocol of
benchmarks/targets.py does (preset alone). SHIFT lowers the
packed keys' logits by half their noise variance ``s² ‖q‖² m ‖k‖² / D`` (turboquant.packed_noise),
``m`` the preset's relative key error measured on the model's keys:

* ``none``: no shift;
* ``query``: one shift per query and head, ``‖k‖²`` the mean over the packed keys it sees (what
  the cache does, with the mean over the keys it stored);
* ``key``: a shift per key, its own ``‖k‖²`` (what a kernel change would give);
* ``shrink``: no shift; the packed logits times ``√(1 − m)``, the mean norm of the codebook's
  reconstruction, which the ``_nc`` presets' stored norm divides by (SPEC §1): the centroid's logit;
* ``centroid``: ``shrink``, then raised by ``σ²/2`` (the centroid model: the exact logit is the
  centroid's plus independent noise, whose exp the centroid's understates);
* ``regression``: the packed logits over ``√(1 − m)``, then lowered by ``σ²/2`` (the packed logit
  as ``√(1 − m)`` times the exact one plus independent noise);
* ``fit``: ``c s² ‖q‖²``, ``c`` fitted per query head on the window's first 256 queries (from the
  17th on), all their keys packed: the measured excess of their packed log-sum-exp over the exact
  one, summed, over their summed ``s² ‖q‖²`` (a shift measured on the first prefill chunk).

Prints the perplexity change against the unquantized model on the tokens past the first 256 of
each window, ± its standard error, and the mean KL(plain || emulated) per token in nats. The table
of docs/QUALITY.md, *Raw and packed keys in one softmax*. ``--excess`` first prints, per layer, how
far the packed keys' log-sum-exp lies above the same keys' exact one (no shift; the last 256
queries of the first window, each with its last 64 keys raw, mean over queries and heads).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from turboquant import assets, evaluation as ev  # noqa: E402
from turboquant.roundtrip import packed  # noqa: E402

SKIP = 256  # positions scored from here on: each query then sees at least this many keys
CHUNK = 256  # a serving chunk; ``fit`` measures on the first
FIT_FROM = 16  # fit on queries that see at least this many keys
SERVING = -1  # RECENT "serving": chunks of CHUNK, each attending to its own raw keys
EXCESS_RECENT = 64


class Emulation:
    """The attention function the model runs: plain while ``config`` is None, else
    ``(preset, recent, shift, relative_mse)``. Records the first window's keys when ``record``."""

    def __init__(self):
        self.num_layers, self.config, self.record = 0, None, False
        self.keys, self.queries, self.scales = {}, {}, {}  # the first window's, per layer

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
        scale = scaling if scaling is not None else module.scaling
        q, k, v = query[0].float(), key[0].float(), value[0].float()  # [H, T, D]
        heads, tokens, dim = q.shape
        if self.record:
            self.keys.setdefault(module.layer_idx, k)
            self.queries.setdefault(module.layer_idx, q)
            self.scales.setdefault(module.layer_idx, scale)
        q = q.view(k.shape[0], heads // k.shape[0], tokens, dim)
        pos = torch.arange(tokens)
        if attention_mask is not None:  # a sliding window's mask (sdpa_mask gives None where causal suffices)
            mask = attention_mask[0, 0, :, -tokens:]
            allowed = mask if mask.dtype == torch.bool else mask == 0
        else:
            allowed = pos[None, :] <= pos[:, None]

        def logits_of(keys):
            s = torch.einsum("hgqd,htd->hgqt", q, keys) * scale
            return softcap * torch.tanh(s / softcap) if softcap else s

        logits = logits_of(k)
        if self.config is None or not 2 <= module.layer_idx < self.num_layers - 2:
            weights = logits.masked_fill(~allowed, -float("inf")).softmax(-1)
            out = torch.einsum("hgqt,htd->hgqd", weights, v)
        else:
            preset, recent, shift, mse = self.config
            k_hat, v_hat = (x.transpose(0, 1) for x in packed(preset, k.transpose(0, 1).contiguous(),
                                                                     v.transpose(0, 1).contiguous()))
            if recent == SERVING:  # a serving chunk: its own keys raw, the earlier chunks' packed
                is_packed = pos[None, :] // CHUNK < pos[:, None] // CHUNK
            else:
                is_packed = pos[None, :] <= pos[:, None] - recent  # [query, key]
            packed_logits = logits_of(k_hat)
            norms = k.pow(2).sum(-1)  # [Hkv, T]
            q2 = scale * scale * q.pow(2).sum(-1, keepdim=True)  # [Hkv, g, T, 1]
            noise = 0.5 * mse * q2 / dim  # x ‖k‖²
            seen = is_packed.float()  # the mean ‖k‖² over the packed keys each query sees: [Hkv, T, 1]
            mean = (torch.einsum("qt,ht->hq", seen, norms) / seen.sum(-1).clamp(min=1))[:, None, :, None]
            if shift == "query":
                packed_logits = packed_logits - noise * mean
            elif shift == "key":
                packed_logits = packed_logits - noise * norms[:, None, None, :]
            elif shift == "regression":  # the packed logit regressed on the exact one: a ℓ + noise
                packed_logits = packed_logits / (1 - mse) ** 0.5 - noise * mean
            elif shift in ("shrink", "centroid"):  # the centroid's logit, whose exp understates the key's weight
                packed_logits = packed_logits * (1 - mse) ** 0.5 + (noise * mean if shift == "centroid" else 0)
            elif shift == "fit":
                first = slice(FIT_FROM, CHUNK)  # the first chunk's queries, every key before them packed
                causal = (pos[None, :CHUNK] <= pos[:CHUNK, None])[FIT_FROM:]
                excess = (packed_logits[:, :, first, :CHUNK].masked_fill(~causal, -float("inf")).logsumexp(-1)
                          - logits[:, :, first, :CHUNK].masked_fill(~causal, -float("inf")).logsumexp(-1))
                fit = excess.sum(-1) / q2[:, :, first, 0].sum(-1)  # [Hkv, g]
                packed_logits = packed_logits - fit[:, :, None, None] * q2
            logits = torch.where(is_packed, packed_logits, logits).masked_fill(~allowed, -float("inf"))
            weights = logits.softmax(-1)
            out = (torch.einsum("hgqt,htd->hgqd", weights * ~is_packed, v)
                   + torch.einsum("hgqt,htd->hgqd", weights * is_packed, v_hat))
        return out.reshape(heads, tokens, dim).transpose(0, 1)[None].to(query.dtype), None


def log_mass_excess(emulation: Emulation, preset: str) -> list[float]:
    """Per quantized layer: the mean over the first window's last 256 queries and their heads of
    log-sum-exp over the packed keys (all but each query's last EXCESS_RECENT) of the packed logits,
    less that of the exact ones."""
    excess = []
    for layer in range(2, emulation.num_layers - 2):
        k, q, scale = emulation.keys[layer], emulation.queries[layer], emulation.scales[layer]  # [Hkv, T, D], [H, T, D]
        k_hat = packed(preset, k.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous())[0].transpose(0, 1)
        tokens = k.shape[1]
        rows = torch.arange(tokens - 256, tokens)
        q = q[:, rows].view(k.shape[0], -1, len(rows), k.shape[-1])
        is_packed = torch.arange(tokens)[None, :] <= rows[:, None] - EXCESS_RECENT

        def packed_lse(keys):
            s = torch.einsum("hgqd,htd->hgqt", q, keys) * scale
            return s.masked_fill(~is_packed, -float("inf")).logsumexp(-1)

        excess.append((packed_lse(k_hat) - packed_lse(k)).mean().item())
    return excess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=assets.MODEL_NAMES)
    parser.add_argument("--presets", nargs="+", default=["turboquant_4bit_nc", "turboquant_k3v4_nc"])
    parser.add_argument("--configs", nargs="+", default=["64:none", "64:query", "64:key", "0:none", "0:key"])
    parser.add_argument("--windows", type=int, default=1)
    parser.add_argument("--excess", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    emulation = Emulation()
    AttentionInterface.register("packed_shift", emulation)
    AttentionMaskInterface.register("packed_shift", sdpa_mask)  # sliding-window layers get their masks
    model, tok = assets.load_model(name=args.model, attn_implementation="packed_shift")
    emulation.num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    wins = ev.windows(tok(assets.text(), return_tensors="pt").input_ids, 2048, args.windows)
    targets = torch.cat([w[0, SKIP:] for w in wins])

    def log_probs():
        with torch.no_grad():
            return torch.cat([model(w).logits[0, SKIP - 1:-1].float().log_softmax(-1) for w in wins])

    def nlls(lp):
        return -lp.gather(-1, targets[:, None])[:, 0]

    emulation.record = True
    reference = log_probs()
    emulation.record = False
    for preset in args.presets:
        error = norm = 0.0
        for layer in range(2, emulation.num_layers - 2):
            k = emulation.keys[layer].transpose(0, 1).contiguous()
            k_hat, _ = packed(preset, k, k)
            error, norm = error + (k_hat - k).pow(2).sum().item(), norm + k.pow(2).sum().item()
        print(f"{preset}: relative key error {error / norm:.5f}", flush=True)
        if args.excess:
            excess = log_mass_excess(emulation, preset)
            print("  packed log-sum-exp excess per layer (nats): " + " ".join(f"{x:+.2f}" for x in excess), flush=True)
        for config in args.configs:
            recent, shift = config.split(":")
            emulation.config = (preset, SERVING if recent == "serving" else int(recent), shift, error / norm)
            lp = log_probs()
            change, se = ev.perplexity_change(nlls(reference), nlls(lp))
            print(f"  {preset[11:]} recent={recent} shift={shift}: {change:+.2f} ± {se:.2f} %  KL "
                  f"{ev.mean_kl(reference, lp):.4f}", flush=True)
        emulation.config = None


if __name__ == "__main__":
    main()
