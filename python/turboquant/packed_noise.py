"""The logit noise of packed keys, and the shift that puts raw and packed keys on one footing in a softmax.

A packed key is ``k̂ = k + e``: the key rotated, each coordinate Lloyd-Max quantized, its norm kept
(SPEC §3). The error's expected size is ``E‖e‖² ≈ m ‖k‖²``, with ``m`` the codebook's mean squared
error for a unit Gaussian (``lloyd_max_gaussian(bits)["mse"]``: 0.0095 at 4 bits, 0.0345 at 3;
measured on real models' keys, 0.0085–0.0095 and 0.031). The rotation spreads ``e`` evenly over
the D coordinates, so the logit ``s q·k̂`` carries noise of variance ``σ² = s² ‖q‖² m ‖k‖² / D``, and
``exp(logit)`` overstates the key's softmax weight by ``exp(σ²/2)`` on average.

Where every key a query sees is packed, that factor divides out of the softmax. Where raw keys
share it (``exact_recent``, ``exact_first``, a continuation chunk's own K/V), the packed keys take
too much of the mass: on Qwen2.5-0.5B at k3v4_nc the packed part's log-sum-exp is 0.13–0.32 nats
too high in most layers. A layer built with ``shift_packed_logits=True`` lowers the packed keys'
logits by ``σ²/2``, with ``‖k‖²`` the mean over every key it has stored (per KV head, in the stored
basis): one shift per query and head, which the decode applies to the packed part's log-sum-exp and
a dense chunk to the packed columns, so the kernels are unchanged (a shift per key bought no more in
an emulated decode: docs/QUALITY.md, *Raw and packed keys in one softmax*).

It is off by default because it overshoots where keys are easy or calibrated. Serving (3 windows):
where keys are hard and uncalibrated, perplexity moves by up to −10 points (Gemma 3 270M k3v4_nc
+22.9 → +13.3 %; Qwen 4bit_nc with exact_recent=64 +2.8 → +0.1 %) and the KL to the plain cache
falls 1.5–4.5x; but SmolLM2's KL rises by up to a third, and with ``calibrate=True,
exact_recent=64`` the KL is nowhere lower (Qwen k3v4_nc 0.012 → 0.018). Neither a shift fitted on
the first prefill chunk nor one that also undoes the ``_nc`` norm's scaling did better (emulated:
docs/QUALITY.md).

FP8 keys (k8v4) get no shift: their relative error, 0.0007, moves the emulated KL by under 0.0001.
Nor do layers with soft-capping (the tanh squashes the noise) or sinks (the sink's logit shares the
packed part's log-sum-exp in the decode).
"""

from __future__ import annotations

import torch

from .codebook import lloyd_max_gaussian
from .presets import preset_info


def key_relative_mse(preset: str) -> float:
    """``E‖k̂ − k‖² / ‖k‖²`` of a preset's packed keys: the Lloyd-Max codebook's error for a unit
    Gaussian, 0 for FP8 keys (see the module docstring)."""
    info = preset_info(preset)
    return lloyd_max_gaussian(info.key_bits)["mse"] if info.key_format == "lloyd_max" else 0.0


class PackedKeyNoise:
    """A layer's running mean of its stored keys' squared norms per KV head, and the logit shift it gives."""

    def __init__(self, preset: str, num_kv_heads: int, head_dim: int, device):
        self.relative_mse = key_relative_mse(preset)
        self.head_dim = head_dim
        self.norm_sum = torch.zeros(num_kv_heads, dtype=torch.float64, device=device)
        self.count = torch.zeros((), dtype=torch.float64, device=device)

    @property
    def active(self) -> bool:
        return self.relative_mse > 0

    def observe(self, key: torch.Tensor, stored: torch.Tensor) -> None:
        """Keys ``[T, Hkv, D]`` as stored (the stored basis) where ``stored [T]`` (bool); no host sync."""
        norms = key.float().pow(2).sum(-1).double() * stored[:, None]
        self.norm_sum += norms.sum(0)
        self.count += stored.sum()

    def logit_shift(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """``σ²/2`` (float32 ``[..., Hq]``) for ``query [..., Hq, D]`` in the stored basis: what each
        packed key's logit is lowered by. Zeros before any key was stored."""
        mean = (self.norm_sum / self.count.clamp_min(1)).float()  # [Hkv]
        group = query.shape[-2] // mean.shape[0]
        q2 = query.float().pow(2).sum(-1)
        return 0.5 * self.relative_mse * scale * scale * q2 * mean.repeat_interleave(group) / self.head_dim
