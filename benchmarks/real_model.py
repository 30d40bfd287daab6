"""Quality of every preset on a real model (SmolLM2-135M-Instruct), against the plain cache and the
caches a user would otherwise pick, through transformers (turboquant.hf). CPU; the GPU when there is one.

    python benchmarks/real_model.py [--windows 4] [--trials 20] [--out benchmarks/RESULTS.md]
    python benchmarks/real_model.py --quick            # a few minutes: fewer windows and trials

Columns (protocols in turboquant/evaluation.py): serving perplexity (2,048-token windows fed in
256-token chunks), decode perplexity (the last 256 tokens of each window decoded one at a time),
greedy agreement and mean KL per token against the plain cache over 128 generated tokens, passkey
retrieval at 1k-7k tokens, and bytes per token and KV head. Then which layers and heads lose most
under 3-bit keys, with a plot. Writes a section of RESULTS.md and benchmarks/real_model_layers.png.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import shlex
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import turboquant as tq  # noqa: E402
from turboquant import assets, evaluation as ev  # noqa: E402
from turboquant.roundtrip import packed  # noqa: E402
from speed import current_commit, replace_section  # noqa: E402

PRESETS = list(tq.PRESETS)
CHAT = ["Explain in two sentences why the sky is blue.", "Write a short poem about the sea.",
        "List three facts about the planet Mars."]


def model_sections(models: list[str], table) -> list[str]:
    """``table(name) -> (markdown lines, about)`` for each model, its packages installed first; each
    table printed as it is done. Returns the markdown of them all, one titled block per model."""
    sections = []
    for name in models:
        assets.ensure_installed(name)
        lines, about = table(name)
        print(f"{name} ({about})", *lines, sep="\n", flush=True)
        sections += [f"**{name}** ({about}):", "", *lines, ""]
    return sections


def write_model_sections(out: str, section: str, source: str, title: str, about: str, sections: list[str]) -> None:
    """The RESULTS.md section `section` of a per-model run (model_sections): `title`, then today's
    date, the commit and the command line before `about`, then the tables."""
    body = "\n".join([title, "", f"{datetime.date.today()}, CPU, commit {current_commit()}, `python {shlex.join(sys.argv)}`. "
                      + about, "", *sections]).rstrip()
    replace_section(out, section, body, source)
    print(f"wrote {out}")


def progress(done: int, total: int, label: str, start: float) -> None:
    width = 30
    filled = int(width * done / total)
    eta = (time.time() - start) / max(done, 1) * (total - done)
    print(f"\r  {label:<38} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}  eta {eta:5.0f} s",
          end="" if done < total else "\n", file=sys.stderr, flush=True)


def bytes_per_token_head(kind: str, head_dim: int) -> str:
    if kind == "plain":
        return f"{4 * head_dim} (bf16)"
    if kind == "fp8 e4m3":
        return str(2 * head_dim)
    if kind == "int4 g32":
        return str(2 * (head_dim // 2 + 4 * head_dim // 32))
    if kind.startswith("quanto"):
        return f"{2 * (head_dim // 2 + 4 * head_dim // 64)} + last 128 tokens bf16"
    return str(tq.slot_layout("turboquant_" + kind.split(" ")[0], head_dim).slot_size_aligned)


def quanto_kind(model):
    """transformers' own QuantizedCache (quanto backend, 4 bits, its defaults), if it runs here."""
    try:
        from transformers.cache_utils import QuantizedCache
        make = lambda: QuantizedCache(backend="quanto", config=model.config, nbits=4, axis_key=0,  # noqa: E731
                                      axis_value=0, q_group_size=64, residual_length=128)
        ev.serving_nll(model, torch.randint(0, 1000, (1, 300)), make)
        return make
    except Exception as exc:  # noqa: BLE001 - reported in the table's notes
        print(f"  transformers' QuantizedCache (quanto) does not run here: {exc}", file=sys.stderr)
        return None


def perplexity_table(model, text_ids, kinds, n_windows, window, tail) -> list[str]:
    wins = ev.windows(text_ids, window, n_windows)
    rows, base = [], {}
    start, total, done = time.time(), len(kinds) * n_windows * 2, 0
    for name, kind in kinds.items():
        serving, decode = [], []
        for w in wins:
            serving.append(ev.serving_nll(model, w, kind))
            done += 1
            progress(done, total, f"perplexity: {name}", start)
            decode.append(ev.decode_nll(model, w, kind, tail=tail))
            done += 1
            progress(done, total, f"perplexity: {name}", start)
        ppl_s, ppl_d = ev.perplexity(serving), ev.perplexity(decode)
        if name == "plain":
            base = {"s": ppl_s, "d": ppl_d}
        rows.append((name, ppl_s, ppl_d))
    head_dim = model.config.head_dim
    lines = ["| cache | bytes/token/head | serving ppl | vs plain | decode ppl | vs plain |", "|---|---|---|---|---|---|"]
    for name, s, d in rows:
        lines.append(f"| {name} | {bytes_per_token_head(name, head_dim)} | {s:.3f} | {100 * (s / base['s'] - 1):+.1f} % | "
                     f"{d:.3f} | {100 * (d / base['d'] - 1):+.1f} % |")
    return lines


def agreement_table(model, tok, kinds, steps) -> list[str]:
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)["input_ids"] for c in CHAT]
    plain = [ev.greedy_tokens(model, p, steps) for p in prompts]
    refs = [ev.teacher_forced_logits(model, p, t, kinds["plain"]) for p, t in zip(prompts, plain)]
    lines = ["| cache | greedy agreement | mean KL (nats/token) |", "|---|---|---|"]
    start = time.time()
    names = [n for n in kinds if n != "plain"]
    for i, name in enumerate(names):
        agree, kl = zip(*(ev.agreement_and_kl(r, ev.teacher_forced_logits(model, p, t, kinds[name]))
                          for p, t, r in zip(prompts, plain, refs)))
        lines.append(f"| {name} | {100 * sum(agree) / len(agree):.1f} % | {sum(kl) / len(kl):.4f} |")
        progress(i + 1, len(names), "agreement and KL", start)
    return lines


def passkey_table(model, tok, text, kinds, lengths, trials) -> list[str]:
    rng = random.Random(0)
    hits = {name: {n: 0 for n in lengths} for name in kinds}
    start, total, done = time.time(), len(lengths) * trials, 0
    for n in lengths:
        for _ in range(trials):
            context, question, key = ev.passkey_prompt(tok, text, n, rng)
            for name, answer in ev.passkey_answers(model, tok, context, question, kinds).items():
                hits[name][n] += ev.found(answer, key)
            done += 1
            progress(done, total, f"passkey at {n} tokens", start)
    lines = ["| cache | " + " | ".join(f"{n} tokens" for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for name in kinds:
        lines.append(f"| {name} | " + " | ".join(f"{hits[name][n]}/{trials}" for n in lengths) + " |")
    return lines


def record_qkv(model, ids):
    """Per layer: the post-RoPE query, key and value of one forward, [H, T, D] each."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    seen = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = (query[0].float(), key[0].float(), value[0].float())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("turboquant_record", record)
    model.set_attn_implementation("turboquant_record")
    try:
        with torch.no_grad():
            model(ids.to(next(model.parameters()).device))
    finally:
        model.set_attn_implementation("turboquant")
    return [seen[i] for i in range(len(seen))]


def layer_analysis(model, text_ids, window, out_png) -> list[str]:
    """Per layer and KV head, for 3-bit keys (k3v4_nc) and 4bit_nc: relative key error, and the
    attention-output error of the last 256 queries over the whole window with the quantized K/V."""
    qkv = record_qkv(model, text_ids[:, :window])
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    scale = model.config.head_dim ** -0.5
    stats = {p: torch.zeros(len(qkv), model.config.num_key_value_heads, 2) for p in ("turboquant_k3v4_nc", "turboquant_4bit_nc")}
    norm_ratio = torch.zeros(len(qkv), model.config.num_key_value_heads)
    mean_ratio = torch.zeros_like(norm_ratio)
    for layer, (q, k, v) in enumerate(qkv):
        t = k.shape[1]
        causal = torch.ones(256, t, dtype=torch.bool).tril(t - 256)
        for preset, s in stats.items():
            kq, vq = packed(preset, k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous())
            kq, vq = kq.transpose(0, 1), vq.transpose(0, 1)
            for h in range(k.shape[0]):
                s[layer, h, 0] = ((kq[h] - k[h]).pow(2).sum(-1) / k[h].pow(2).sum(-1)).mean()
                qs = q[h * group:(h + 1) * group, -256:].double()
                ref = ((qs @ k[h].double().T * scale).masked_fill(~causal, -1e30).softmax(-1)) @ v[h].double()
                got = ((qs @ kq[h].double().T * scale).masked_fill(~causal, -1e30).softmax(-1)) @ vq[h].double()
                s[layer, h, 1] = (got - ref).norm() / ref.norm()
        for h in range(k.shape[0]):
            norms = k[h].norm(dim=-1)
            norm_ratio[layer, h] = norms.max() / norms.median()
            mean_ratio[layer, h] = (k[h].mean(0).norm() / norms.pow(2).mean().sqrt())
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
        for ax, preset in zip(axes, stats):
            im = ax.imshow(stats[preset][:, :, 1].numpy(), aspect="auto", cmap="magma_r", vmin=0)
            ax.set_title(f"{preset.replace('turboquant_', '')}: attention-output rel. error")
            ax.set_xlabel("KV head")
            fig.colorbar(im, ax=ax)
        axes[0].set_ylabel("layer")
        fig.suptitle("SmolLM2-135M-Instruct, last 256 queries of a 2,048-token window")
        fig.tight_layout()
        fig.savefig(out_png, dpi=110)
        plt.close(fig)
    except ImportError:
        pass
    s3 = stats["turboquant_k3v4_nc"]
    order = s3[:, :, 1].flatten().argsort(descending=True)
    heads = model.config.num_key_value_heads
    lines = ["| layer | KV head | k3v4_nc key rel. MSE | k3v4_nc attn-out err | 4bit_nc attn-out err | max/median key norm | |mean key| / rms |",
             "|---|---|---|---|---|---|---|"]
    for idx in order[:6].tolist():
        layer, h = divmod(idx, heads)
        lines.append(f"| {layer} | {h} | {s3[layer, h, 0]:.4f} | {s3[layer, h, 1]:.3f} | "
                     f"{stats['turboquant_4bit_nc'][layer, h, 1]:.3f} | {norm_ratio[layer, h]:.1f} | {mean_ratio[layer, h]:.2f} |")
    med = s3[:, :, 1].median()
    corr = torch.corrcoef(torch.stack([s3[:, :, 1].flatten(), mean_ratio.flatten(), norm_ratio.flatten()]))
    lines += ["", f"Median over all {s3.shape[0]} x {heads} (layer, head): k3v4_nc attention-output error {med:.3f}, "
              f"key rel. MSE {s3[:, :, 0].median():.4f} (Gaussian theory 0.0345). Correlation of the attention-output "
              f"error with |mean key| / rms (a per-channel key offset): {corr[0, 1]:+.2f}; with the max/median key "
              f"norm (sink tokens): {corr[0, 2]:+.2f}."]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--tail", type=int, default=256)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 7168])
    p.add_argument("--quick", action="store_true", help="2 windows, 4 passkey trials, 32 generated tokens")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() and tq.has_cuda_kernels() else "cpu")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"))
    a = p.parse_args()
    if a.quick:
        a.windows, a.trials, a.steps = 2, 4, 32
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    model, tok = assets.load_model(a.device, dtype)
    text = assets.text()
    text_ids = tok(text, return_tensors="pt").input_ids
    kinds = ev.cache_kinds(model, PRESETS)
    no_boundary = {f"{n} (all layers)": k for n, k in ev.cache_kinds(model, PRESETS, boundary=False, baselines=False).items()
                   if n != "plain"}
    quanto = quanto_kind(model)
    if quanto is not None:
        kinds["quanto int4 (transformers)"] = quanto
    began = time.time()
    print("== perplexity", file=sys.stderr)
    ppl = perplexity_table(model, text_ids, {**kinds, **no_boundary}, a.windows, a.window, a.tail)
    print("\n".join(ppl))
    print("== greedy agreement and KL", file=sys.stderr)
    agree = agreement_table(model, tok, kinds, a.steps)
    print("\n".join(agree))
    print("== passkey", file=sys.stderr)
    passkey = passkey_table(model, tok, text, kinds, a.lengths, a.trials)
    print("\n".join(passkey))
    print("== layers", file=sys.stderr)
    png = os.path.join(os.path.dirname(os.path.abspath(a.out)), "real_model_layers.png")
    layers = layer_analysis(model, text_ids, a.window, png)
    print("\n".join(layers))
    commit = current_commit()
    device = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    quanto_note = ("transformers' `QuantizedCache` (quanto, 4 bits, groups of 64, the last 128 tokens kept in bf16) "
                   "quantizes every layer." if quanto is not None else
                   "transformers' `QuantizedCache` did not run here (neither backend), so it has no row.")
    body = "\n".join([
        "## Quality on a real model: SmolLM2-135M-Instruct", "",
        f"{datetime.date.today()}, {device}, commit {commit}, `python benchmarks/real_model.py"
        f"{' --quick' if a.quick else ''}` ({time.time() - began:.0f} s). Text: the Britannica 1911 article on "
        f"Shakespeare ({text_ids.shape[1]:,} tokens; `turboquant.assets`). The model in "
        f"{str(dtype).replace('torch.', '')}, 30 layers, 3 KV heads of D=64. Every kind keeps the first and last two "
        f"layers plain (as vLLM does) unless marked (all layers); fp8 e4m3 (unit scale) and int4 g32 (asymmetric per "
        f"token and 32 channels, fp16 scale and zero, no rotation) are round-trip caches. {quanto_note}", "",
        f"**Perplexity** ({a.windows} windows of {a.window} tokens; serving: fed in 256-token chunks, each attending to "
        f"the cache and its own raw K/V; decode: the last {a.tail} tokens of each window one step at a time, every "
        "step reading the cache):", "", *ppl, "",
        f"**Greedy agreement and KL** against the plain cache, {a.steps} tokens generated by the plain cache for each "
        f"of {len(CHAT)} chat prompts, fed back through each cache:", "", *agree, "",
        f"**Passkey retrieval** ({a.trials} trials per length: a 5-digit key at a random depth of the text, the "
        "context prefilled once, the question a later chunk through each cache, the answer decoded from it):", "",
        *passkey, "",
        "**Where 3-bit keys lose** (one 2,048-token window; the six (layer, KV head) with the largest k3v4_nc "
        "attention-output error; plot: `real_model_layers.png`):", "", *layers, "",
        "![attention-output error per layer and head](real_model_layers.png)"])
    replace_section(a.out, "real-model", body, "benchmarks/real_model.py")
    print(f"wrote {a.out} and {png}")


if __name__ == "__main__":
    main()
