"""The synthetic preset report (``python -m turboquant.demo --synthetic``): a paged cache shaped
like a real model's, filled with random keys and values.

For every preset: store random keys/values (32 query / 8 KV heads, D=128, a few thousand tokens)
into a paged cache, decode one step, and print bytes per token per head, compression vs bf16,
key reconstruction error and attention-output error against float64 attention on the original
K/V. Runs on the CPU; on a GPU with the CUDA ops it runs there and adds decode speed vs SDPA bf16.

    python -m turboquant.demo --synthetic [--device cpu|cuda] [--batch 4] [--context 1024]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

import turboquant as tq


def _attention_f64(q, k, v, scale):
    """q [B, Hq, D]; k, v [B, L, Hkv, D] -> [B, Hq, D] in float64 (GQA by repetition)."""
    group = q.shape[1] // k.shape[2]
    k = k.double().repeat_interleave(group, dim=2)
    v = v.double().repeat_interleave(group, dim=2)
    s = torch.einsum("bhd,blhd->bhl", q.double(), k) * scale
    return torch.einsum("bhl,blhd->bhd", s.softmax(-1), v)


def _model_like_keys(shape, gen, device):
    """Keys with per-channel scales and a few large channels, as real models' keys have."""
    d = shape[-1]
    channel_scale = torch.exp(0.5 * torch.randn(d, generator=gen))
    channel_scale[torch.randperm(d, generator=gen)[:4]] *= 6.0
    k = torch.randn(*shape, generator=gen) * channel_scale + 0.3 * torch.randn(d, generator=gen)
    return k.to(device)


def _time_cuda(fn, iters=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2] * 1e3  # median, microseconds


def run(device: str, batch: int, context: int, q_heads: int, kv_heads: int, head_dim: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens = batch * context
    print(f"turboquant demo on {device}: batch {batch} x context {context} = {tokens} tokens, "
          f"{q_heads} query / {kv_heads} KV heads, head_dim {head_dim}, block_size {block_size}")
    keys = _model_like_keys((batch, context, kv_heads, head_dim), gen, "cpu")
    values = torch.randn(batch, context, kv_heads, head_dim, generator=gen)
    query = torch.randn(batch, q_heads, head_dim, generator=gen)
    scale = 1.0 / math.sqrt(head_dim)
    reference = _attention_f64(query, keys, values, scale)
    blocks_per_seq = context // block_size
    block_table = torch.randperm(batch * blocks_per_seq, generator=gen).view(batch, blocks_per_seq).int()
    pos = torch.arange(context)
    slots = (block_table[:, pos // block_size].long() * block_size + pos % block_size).reshape(-1)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    dense_bytes = 2 * 2 * head_dim  # bf16 K + V per token per head

    rows = []
    for preset in tq.PRESETS:
        layout = tq.slot_layout(preset, head_dim)
        cache = tq.allocate_kv_cache(batch * blocks_per_seq, block_size, kv_heads, head_dim, preset, device)
        k_in = keys.reshape(tokens, kv_heads, head_dim).to(device, torch.bfloat16 if device == "cuda" else torch.float32)
        v_in = values.reshape(tokens, kv_heads, head_dim).to(device, k_in.dtype)
        t0 = time.perf_counter()
        tq.store_kv(k_in, v_in, cache, slots.to(device), preset)
        q_in = query.to(device, k_in.dtype)
        out = tq.decode(q_in, cache, block_table.to(device), seq_lens.to(device), preset, scale)
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        k_hat, _ = tq.dequantize(cache, block_table.to(device), seq_lens.to(device), preset, torch.float32)
        k_hat = k_hat.cpu()
        key_err = ((k_hat - k_in.float().cpu().view_as(k_hat)) ** 2).sum(-1) / (k_in.float().cpu().view_as(k_hat) ** 2).sum(-1)
        attn_err = ((out.double().cpu() - reference).norm() / reference.norm()).item()
        row = dict(preset=preset, bytes=layout.slot_size_aligned, compression=dense_bytes / layout.slot_size_aligned,
                   key_mse=key_err.mean().item(), attn_err=attn_err, seconds=elapsed)
        if device == "cuda":
            bt, sl = block_table.to(device), seq_lens.to(device)
            row["decode_us"] = _time_cuda(lambda: tq.decode(q_in, cache, bt, sl, preset, scale))
        rows.append(row)
        print(f"  {preset}: done in {elapsed:.2f} s", flush=True)

    speed = ""
    if device == "cuda":
        dense_k = keys.to(device, torch.bfloat16).transpose(1, 2).repeat_interleave(q_heads // kv_heads, dim=1)
        dense_v = values.to(device, torch.bfloat16).transpose(1, 2).repeat_interleave(q_heads // kv_heads, dim=1)
        q4 = query.to(device, torch.bfloat16).unsqueeze(2)
        sdpa_us = _time_cuda(lambda: torch.nn.functional.scaled_dot_product_attention(q4, dense_k, dense_v, scale=scale))
        speed = (f"SDPA bf16 decode on a dense cache (GQA expanded): {sdpa_us:.1f} us per step. Both timed as single "
                 "eager calls, which launch overhead dominates at this size; under CUDA-graph replay SDPA's best "
                 "backend is faster than turboquant below ~4k tokens at small batch (benchmarks/RESULTS.md).")
    print()
    header = "| preset | bytes/token/head | vs bf16 | key rel. MSE | attention rel. error |"
    if device == "cuda":
        header += " decode us | speed-up vs SDPA bf16 |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for r in rows:
        line = (f"| {r['preset']} | {r['bytes']} | {r['compression']:.2f}x | {r['key_mse']:.5f} | "
                f"{r['attn_err']:.4f} |")
        if device == "cuda":
            line += f" {r['decode_us']:.1f} | {sdpa_us / r['decode_us']:.2f}x |"
        print(line)
    print(f"| bf16 (reference) | {dense_bytes} | 1.00x | 0 | 0 |" + (" - | 1.00x |" if device == "cuda" else ""))
    if speed:
        print(speed)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--synthetic report")
    g.add_argument("--batch", type=int, default=4)
    g.add_argument("--context", type=int, default=1024)
    g.add_argument("--q-heads", type=int, default=32)
    g.add_argument("--kv-heads", type=int, default=8)
    g.add_argument("--head-dim", type=int, choices=[64, 128, 256], default=128)
    g.add_argument("--block-size", type=int, choices=list(tq.SUPPORTED_BLOCK_SIZES), default=16)


def main(a: argparse.Namespace, device: str, error) -> None:
    if a.context % a.block_size:
        error("--context must be a multiple of --block-size")
    run(device, a.batch, a.context, a.q_heads, a.kv_heads, a.head_dim, a.block_size)
