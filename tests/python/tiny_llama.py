"""A small Llama-style decoder for end-to-end checks: RMSNorm, RoPE, GQA 4:1, D=128, SwiGLU,
seeded random weights; attention runs through turboquant.attention.PagedAttentionLayer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import turboquant as tq
from turboquant.attention import PagedAttentionLayer, StepMetadata

VOCAB, LAYERS, HQ, HKV, D, FFN, BLOCK = 512, 4, 4, 1, 128, 1024, 16


def rms_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos):
    inv = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
    ang = pos[:, None].float() * inv[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    out = torch.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
    return out


class TinyLlama:
    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        h = HQ * D

        def w(*shape, scale):
            return torch.randn(*shape, generator=g) * scale

        self.embed = w(VOCAB, h, scale=1.0)
        self.layers = [dict(wq=w(h, h, scale=2.0 * h ** -0.5), wk=w(HKV * D, h, scale=2.0 * h ** -0.5),
                            wv=w(HKV * D, h, scale=h ** -0.5), wo=w(h, h, scale=2.0 * h ** -0.5),
                            w1=w(FFN, h, scale=h ** -0.5), w3=w(FFN, h, scale=h ** -0.5),
                            w2=w(h, FFN, scale=FFN ** -0.5), n1=torch.ones(h), n2=torch.ones(h))
                       for _ in range(LAYERS)]
        self.norm = torch.ones(h)
        # Untied head with logits of a few nats of spread, so the next token depends on attention.
        self.head = w(VOCAB, h, scale=3.0 * h ** -0.5)

    def new_caches(self, preset: str | None, max_tokens: int):
        skip = set(tq.boundary_skip_layers(LAYERS))
        blocks = -(-max_tokens // BLOCK)
        return [PagedAttentionLayer(blocks, BLOCK, HKV, D, None if (preset is None or i in skip) else preset,
                                    dtype=torch.float32) for i in range(LAYERS)]

    def step(self, tokens: torch.Tensor, start: int, caches) -> torch.Tensor:
        """Runs new tokens at positions [start, start + n) of one sequence; returns logits [n, VOCAB]."""
        n = tokens.shape[0]
        pos = torch.arange(start, start + n)
        block_table = torch.arange(caches[0].cache.shape[0], dtype=torch.int32)[None]
        meta = StepMetadata(torch.tensor([0, n], dtype=torch.int32), torch.tensor([start + n], dtype=torch.int32),
                            block_table, pos.clone(), num_decodes=1 if (n == 1 and start > 0) else 0)
        x = self.embed[tokens]
        for layer, cache in zip(self.layers, caches):
            hdn = rms_norm(x, layer["n1"])
            q = rope((hdn @ layer["wq"].T).view(n, HQ, D), pos)
            k = rope((hdn @ layer["wk"].T).view(n, HKV, D), pos)
            v = (hdn @ layer["wv"].T).view(n, HKV, D)
            attn = cache.forward(q, k, v, meta, D ** -0.5)
            x = x + attn.reshape(n, HQ * D) @ layer["wo"].T
            hdn = rms_norm(x, layer["n2"])
            x = x + (F.silu(hdn @ layer["w1"].T) * (hdn @ layer["w3"].T)) @ layer["w2"].T
        return rms_norm(x, self.norm) @ self.head.T


def generate(model: TinyLlama, prompt: torch.Tensor, steps: int, preset: str | None, forced: torch.Tensor | None = None):
    """Greedy generation (or teacher-forced along `forced`); returns (tokens, per-step log-probs)."""
    caches = model.new_caches(preset, prompt.shape[0] + steps + 1)
    logits = model.step(prompt, 0, caches)[-1]
    out, logps = [], []
    for i in range(steps):
        logps.append(F.log_softmax(logits.double(), -1))
        tok = int(logits.argmax()) if forced is None else int(forced[i])
        out.append(tok)
        logits = model.step(torch.tensor([tok]), prompt.shape[0] + i, caches)[-1]
    return torch.tensor(out), torch.stack(logps)
