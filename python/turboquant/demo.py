"""Main job: a real model (SmolLM2-135M-Instruct) generating through each KV cache.

For the plain cache, every preset (``TurboQuantCache`` in Hugging Face transformers), and the 4-
and 3-bit-key presets with ``calibrate=True, exact_recent=64``: the text
generated for a few chat prompts (one batch, left-padded), the KV-cache bytes it held and its
compression, decode tokens/s, and the perplexity on a real text under the serving protocol.
Runs on the CPU in a few minutes; on a GPU with the CUDA ops it runs there (bf16).

    python -m turboquant.demo [--device auto|cpu|cuda] [--new-tokens 48] [--ppl-windows 2]
    python -m turboquant.demo --synthetic [...]    # the preset report on random K/V
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import turboquant as tq

PROMPTS = ["What is the capital of France? Answer in one sentence.",
           "Write a haiku about the sea.",
           "Give two tips for learning a new language."]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _plain_bytes(cache) -> int:
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers if layer.keys is not None)


def _progress(i: int, total: int, label: str) -> None:
    bar = "#" * (i * 24 // total) + "." * (24 - i * 24 // total)
    print(f"\r  [{bar}] {i}/{total} {label:<40}", end="" if i < total else "\n", file=sys.stderr, flush=True)


def real_model_report(device: str, new_tokens: int, ppl_windows: int, window: int) -> None:
    from transformers import DynamicCache

    from . import assets, evaluation
    from . import hf as tqhf

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    print(f"turboquant demo on {device}: SmolLM2-135M-Instruct (30 layers, 3 KV heads of D=64, "
          f"{str(dtype).replace('torch.', '')}) through Hugging Face transformers", flush=True)
    model, tok = assets.load_model(device, dtype)
    tok.padding_side = "left"
    chats = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in PROMPTS]
    batch = tok(chats, return_tensors="pt", padding=True).to(device)
    text_ids = tok(assets.text(), return_tensors="pt").input_ids
    windows = evaluation.windows(text_ids, window, ppl_windows)
    kinds = {"plain (transformers)": DynamicCache}
    kinds.update({p.replace("turboquant_", ""): (lambda p=p: tqhf.TurboQuantCache(model.config, preset=p))
                  for p in tq.PRESETS})
    # The options that take the rotated presets to the plain cache's quality on real models
    # (docs/QUALITY.md): calibration, and the last 64 tokens of each sequence kept exact.
    kinds.update({f"{p.replace('turboquant_', '')} +cal +recent64": (lambda p=p: tqhf.TurboQuantCache(
        model.config, preset=p, calibrate=True, exact_recent=64)) for p in ("turboquant_4bit_nc", "turboquant_k3v4_nc")})
    model.generate(**batch, max_new_tokens=2, do_sample=False)  # warm-up: first-call set-up out of the timings
    rows, texts = [], {}
    steps = len(kinds) * (1 + ppl_windows)
    done = 0
    for name, kind in kinds.items():
        _progress(done, steps, f"{name}: generating")
        cache = kind()
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id or 0, **{tqhf.CACHE_KWARG: cache})
        _sync(device)
        seconds = time.perf_counter() - start
        done += 1
        held = cache.packed_bytes() if hasattr(cache, "packed_bytes") else _plain_bytes(cache)
        texts[name] = tok.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
        nll = []
        for w in windows:
            _progress(done, steps, f"{name}: perplexity")
            nll.append(evaluation.serving_nll(model, w, kind))
            done += 1
        rows.append((name, held, out.shape[0] * new_tokens / seconds, evaluation.perplexity(nll)))
    _progress(steps, steps, "done")

    for i, prompt in enumerate(PROMPTS):
        print(f"\nPrompt: {prompt}")
        for name in kinds:
            line = " ".join(texts[name][i].split())
            print(f"  {name:<22} {line[:110]}{'...' if len(line) > 110 else ''}")
    plain_bytes, plain_ppl = rows[0][1], rows[0][3]
    dname = str(dtype).replace("torch.", "")
    print(f"\n| cache | KV bytes held | smaller than plain {dname} | tokens/s (batch {out.shape[0]}) | perplexity | vs plain |")
    print("|---|---|---|---|---|---|")
    for name, held, rate, ppl in rows:
        smaller = "-" if held == plain_bytes else f"{plain_bytes / held:.2f}x"
        print(f"| {name} | {held / 1024:,.0f} KiB | {smaller} | {rate:.1f} | {ppl:.3f} | {100 * (ppl / plain_ppl - 1):+.1f} % |")
    print(f"\nKV bytes: every layer's K/V for the batch's tokens after generation; the plain cache holds {dname} "
          f"K/V of every position, padding included, the packed caches only each sequence's tokens, and keep the first "
          f"and last two layers plain (as vLLM's TurboQuant does); +recent64 adds each sequence's last 64 tokens raw "
          f"(exact_recent=64, {dname}): for generations this short that is more than they hold, so those caches "
          f"outgrow the plain one, while over a 2,048-token context they add a fifth to a quarter of the packed "
          f"cache in float32 (an eighth in bf16). Perplexity: {ppl_windows} windows of {window} tokens of "
          "the Britannica 1911 article on Shakespeare, fed in 256-token chunks (each chunk attends to the cache and "
          "its own raw K/V). Full tables, baselines and passkey retrieval: benchmarks/real_model.py and "
          "benchmarks/RESULTS.md.")


def main() -> None:
    from . import synthetic_report

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--ppl-windows", type=int, default=2)
    p.add_argument("--ppl-window", type=int, default=1024)
    p.add_argument("--synthetic", action="store_true", help="the preset report on random K/V instead")
    synthetic_report.add_arguments(p)
    a = p.parse_args()
    device = a.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and tq.has_cuda_kernels() else "cpu"
    if a.synthetic:
        synthetic_report.main(a, device, p.error)
        return
    if a.new_tokens < 1 or a.ppl_windows < 1 or a.ppl_window < 2:
        p.error("--new-tokens and --ppl-windows must be >= 1, --ppl-window >= 2")
    real_model_report(device, a.new_tokens, a.ppl_windows, a.ppl_window)


if __name__ == "__main__":
    main()
