"""End-to-end ``generate`` through transformers: TurboQuantCache against transformers' default cache.

A randomly initialized model of a real architecture (default: Llama-3-8B's layer shapes, bf16;
weights do not change speed), prompts of random tokens, greedy decoding of a fixed number of new
tokens (EOS ignored). Per (batch, prompt length, cache): prefill time (generate with one new
token), decode tokens/s over the remaining tokens, peak GPU memory, and the bytes the cache holds
per token; then how many tokens of cache each kind fits beside the weights in the card's memory.

    python benchmarks/bench_generate.py [--batches 1 8 32] [--prompts 1024 4096 8192] [--out f.md]
    python benchmarks/bench_generate.py --device cpu --model tiny   # a smoke run of the script
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import turboquant as tq  # noqa: E402
import turboquant.hf as tqhf  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

MODELS = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=32 * 2, vocab_size=1024),
}


def build_model(name: str, device: str, dtype: torch.dtype):
    config = LlamaConfig(max_position_embeddings=131072, attn_implementation="turboquant", **MODELS[name])
    torch.manual_seed(0)
    with torch.device(device):
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(default)
    return model.eval()


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run_generate(model, ids, new_tokens, preset, device):
    cache = None if preset is None else tqhf.TurboQuantCache(model.config, preset=preset)
    kw = {} if cache is None else {tqhf.CACHE_KWARG: cache}
    sync(device)
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0, **kw)
    sync(device)
    return time.perf_counter() - start, out, cache


def cache_bytes_per_token(model, preset, dtype) -> int:
    """K/V bytes one token takes in every layer: a plain layer 2 * Hkv * D * elem, a packed one
    Hkv * slot."""
    cfg = model.config
    plain = 2 * cfg.num_key_value_heads * cfg.head_dim * torch.finfo(dtype).bits // 8
    if preset is None:
        return cfg.num_hidden_layers * plain
    skipped = len(tq.boundary_skip_layers(cfg.num_hidden_layers))
    slot = tq.slot_layout(preset, cfg.head_dim).slot_size_aligned * cfg.num_key_value_heads
    return skipped * plain + (cfg.num_hidden_layers - skipped) * slot


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompts", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--presets", nargs="+", default=["plain", "turboquant_4bit_nc", "turboquant_k8v4"])
    p.add_argument("--out", default=None, help="append the markdown table to this file")
    a = p.parse_args()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    model = build_model(a.model, a.device, dtype)
    presets = [None if x == "plain" else x for x in a.presets]
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    name = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    lines = [f"### generate, {a.model} shapes (random weights, {str(dtype).replace('torch.', '')}), {name}",
             "", f"`python benchmarks/bench_generate.py --model {a.model} --batches {' '.join(map(str, a.batches))} "
             f"--prompts {' '.join(map(str, a.prompts))} --new-tokens {a.new_tokens}`; prefill = generate with one "
             "new token; decode tok/s = batch x (new tokens - 1) / (time - prefill time); each the faster of two runs "
             "after an untimed one.", "",
             "| batch | prompt | cache | prefill s | decode tok/s | vs plain | peak GB |", "|---|---|---|---|---|---|---|"]
    g = torch.Generator().manual_seed(0)
    run_generate(model, torch.randint(1, 100, (1, 16)).to(a.device), 4, presets[-1], a.device)  # warm-up
    for batch in a.batches:
        for prompt in a.prompts:
            ids = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=g).to(a.device)
            plain_rate = None
            for preset in presets:
                label = "plain (SDPA)" if preset is None else preset.replace("turboquant_", "")
                try:
                    if a.device == "cuda":
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()
                    # Untimed first: a shape's first run pays one-time set-up (measured on the H200 at
                    # batch 8: the first of three caches to run a shape read 2.7x slow whichever it was).
                    run_generate(model, ids, 4, preset, a.device)
                    t_prefill = min(run_generate(model, ids, 1, preset, a.device)[0] for _ in range(2))
                    t_all, out, cache = min((run_generate(model, ids, a.new_tokens, preset, a.device) for _ in range(2)),
                                            key=lambda r: r[0])
                    assert out.shape[1] == prompt + a.new_tokens
                    rate = batch * (a.new_tokens - 1) / max(t_all - t_prefill, 1e-9)
                    peak = torch.cuda.max_memory_allocated() / 1e9 if a.device == "cuda" else float("nan")
                    plain_rate = rate if preset is None else plain_rate
                    ratio = f"{rate / plain_rate:.2f}x" if plain_rate else "-"
                    row = f"| {batch} | {prompt} | {label} | {t_prefill:.2f} | {rate:.0f} | {ratio} | {peak:.1f} |"
                except torch.OutOfMemoryError:
                    row = f"| {batch} | {prompt} | {label} | OOM | - | - | - |"
                    if a.device == "cuda":
                        torch.cuda.empty_cache()
                print(row, flush=True)
                lines.append(row)
    if a.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        budget = 0.9 * total - weights  # a tenth kept for activations and the allocator
        lines += ["", f"Tokens of cache that fit beside the weights ({weights / 1e9:.1f} GB) in 90 % of the card's "
                  f"{total / 1e9:.0f} GB, from the bytes each cache holds per token (all layers):", "",
                  "| cache | bytes/token | tokens that fit | e.g. batch x context |", "|---|---|---|---|"]
        for preset in presets:
            per_token = cache_bytes_per_token(model, preset, dtype)
            fit = int(budget // per_token)
            label = "plain (bf16)" if preset is None else preset.replace("turboquant_", "")
            lines.append(f"| {label} | {per_token:,} | {fit:,} | {fit // 8192} x 8k |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
