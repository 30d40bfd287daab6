"""Quality report: what each preset does to keys, inner products and attention, against float64
references and two baselines computed in the same script (per-token min/max INT4 without rotation,
KIVI-style, and FP8 e4m3 for K and V). Runs on the CPU.

    python benchmarks/quality.py [--tokens 2048] [--out docs/QUALITY.md]

Key sets: (a) random Gaussian; (b) model-like — a few large channels, a non-zero per-channel mean,
RoPE applied at varied positions; (c) adversarial — constant vectors and Hadamard rows.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import turboquant as tq  # noqa: E402
from turboquant.roundtrip import fp8_e4m3, int4_per_token, packed  # noqa: E402
from speed import current_commit  # noqa: E402

HEAD_DIMS = (64, 128, 256)
KV_HEADS, Q_PER_KV = 2, 4


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions[:, None].double() * inv[None, :]  # [T, d/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


def key_sets(tokens: int, d: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    shape = (tokens, KV_HEADS, d)
    gaussian = torch.randn(shape, generator=gen, dtype=torch.float64)
    scale = torch.exp(0.5 * torch.randn(d, generator=gen, dtype=torch.float64))
    scale[torch.randperm(d, generator=gen)[:4]] *= 8.0  # a few outlier channels
    mean = 0.5 * torch.randn(d, generator=gen, dtype=torch.float64)
    model_like = rope(torch.randn(shape, generator=gen, dtype=torch.float64) * scale + mean,
                      torch.randint(0, 32768, (tokens,), generator=gen))
    h = tq.hadamard(d).double() * math.sqrt(d)  # +-1 rows
    adversarial = torch.empty(shape, dtype=torch.float64)
    half = tokens // 2
    adversarial[:half] = torch.randn(half, KV_HEADS, 1, generator=gen, dtype=torch.float64)  # constant vectors
    rows = torch.randint(0, d, (tokens - half, KV_HEADS), generator=gen)
    adversarial[half:] = h[rows] * torch.randn(tokens - half, KV_HEADS, 1, generator=gen, dtype=torch.float64)
    return {"gaussian": gaussian, "model-like": model_like, "adversarial": adversarial}


def roundtrip(preset: str, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Store K/V [T, H, D] through the packed cache and read them back (float64)."""
    k, v = packed(preset, keys.float(), values.float())
    return k.double(), v.double()


def metrics(k: torch.Tensor, v: torch.Tensor, kq: torch.Tensor, vq: torch.Tensor, q: torch.Tensor) -> dict:
    """Relative key MSE, inner-product error, attention-output error, top-8 agreement."""
    d = k.shape[-1]
    key_mse = (((kq - k) ** 2).sum(-1) / (k ** 2).sum(-1).clamp_min(1e-30)).mean().item()
    kr, kqr = k.repeat_interleave(Q_PER_KV, 1), kq.repeat_interleave(Q_PER_KV, 1)
    vr, vqr = v.repeat_interleave(Q_PER_KV, 1), vq.repeat_interleave(Q_PER_KV, 1)
    s = torch.einsum("hd,thd->ht", q, kr) / math.sqrt(d)
    sq = torch.einsum("hd,thd->ht", q, kqr) / math.sqrt(d)
    ip_err = ((sq - s).norm() / s.norm()).item()
    p, pq = s.softmax(-1), sq.softmax(-1)
    out = torch.einsum("ht,thd->hd", p, vr)
    outq = torch.einsum("ht,thd->hd", pq, vqr)
    attn_err = ((outq - out).norm() / out.norm()).item()
    k8 = 8
    top, topq = p.topk(k8, -1).indices, pq.topk(k8, -1).indices
    agree = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(top, topq)) / (k8 * top.shape[0])
    return dict(key_mse=key_mse, ip_err=ip_err, attn_err=attn_err, top8=agree)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="replace the generated quality section of this markdown file")
    a = p.parse_args()
    gen = torch.Generator().manual_seed(a.seed)
    rows = []
    methods = list(tq.PRESETS) + ["kivi_int4 (baseline)", "fp8_e4m3 (baseline)"]
    for d in HEAD_DIMS:
        sets = key_sets(a.tokens, d, gen)
        values = torch.randn(a.tokens, KV_HEADS, d, generator=gen, dtype=torch.float64)
        q = torch.randn(KV_HEADS * Q_PER_KV, d, generator=gen, dtype=torch.float64)
        for set_name, keys in sets.items():
            for method in methods:
                if method.startswith("kivi"):
                    kq, vq = (int4_per_token(x, group=x.shape[-1]) for x in (keys, values))
                elif method.startswith("fp8"):
                    kq, vq = fp8_e4m3(keys), fp8_e4m3(values)
                else:
                    kq, vq = roundtrip(method, keys, values)
                m = metrics(keys, values, kq, vq, q)
                rows.append((d, set_name, method.replace("turboquant_", ""), m))
                print(f"D={d} {set_name:12s} {method:22s} key MSE {m['key_mse']:.5f}  q.k err {m['ip_err']:.4f}  "
                      f"attn err {m['attn_err']:.4f}  top-8 {m['top8']:.3f}", flush=True)
    commit = current_commit()
    lines = ["<!-- quality:begin (generated by benchmarks/quality.py) -->",
             f"## Quality (CPU, {datetime.date.today()}, commit {commit}, `python benchmarks/quality.py --tokens {a.tokens}`)",
             "",
             f"{a.tokens} tokens x {KV_HEADS} KV heads, GQA {Q_PER_KV}:1, float64 references. Key MSE is relative "
             "(||k - k~||^2 / ||k||^2); q.k and attention errors are relative norms; top-8 is the overlap of the "
             "8 largest attention weights per query head.",
             "",
             "| D | keys | method | key rel. MSE | q.k rel. error | attention rel. error | top-8 agreement |",
             "|---|---|---|---|---|---|---|"]
    for d, set_name, method, m in rows:
        lines.append(f"| {d} | {set_name} | {method} | {m['key_mse']:.5f} | {m['ip_err']:.4f} | {m['attn_err']:.4f} | {m['top8']:.3f} |")
    lines.append("<!-- quality:end -->")
    section = "\n".join(lines) + "\n"
    if a.out:
        text = open(a.out).read() if os.path.exists(a.out) else ""
        if "<!-- quality:begin" in text:
            start = text.index("<!-- quality:begin")
            end = text.index("<!-- quality:end -->") + len("<!-- quality:end -->\n")
            text = text[:start] + section + text[end:]
        else:
            text = text.rstrip("\n") + "\n\n" + section
        open(a.out, "w").write(text)


if __name__ == "__main__":
    main()
