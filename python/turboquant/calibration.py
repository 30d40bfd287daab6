"""Exact per-head transformations that make real K/V easier to quantize, at the same bytes per token.

Attention is invariant to transformations the quantizer is not. For one (layer, KV head):

* key centering: ``softmax(q·(k − μ))`` equals ``softmax(q·k)`` for any offset ``μ`` shared by the
  keys a query sees (it shifts every logit of that query by ``q·μ``). Real keys share a large
  per-channel offset (SmolLM2: |mean key| is 66-83 % of the rms in its worst heads), which the
  quantizer spends its levels and its error budget (the error scales with ``||k||``) on.
* per-channel key smoothing: ``q·k = (q ⊙ s)·(k ⊘ s)``; channels with a large spread stop dominating
  the norm the quantization error scales with.
* value centering: the attention weights sum to 1, so ``Σ p (v − ν) + ν = Σ p v``.

Key centering needs a softmax over the keys' logits alone: with soft-capping or attention sinks it
is not exact, nor is value centering with sinks (``Calibration.exact_for`` drops them there).

The cache stores ``(k − μ) ⊘ s`` and ``v − ν``; a query attends as ``q ⊙ s`` and the output gets
``ν`` added, so attention over the packed cache is the attention of the original K/V (up to the
quantization). ``μ, s, ν`` are fitted per (layer, KV head) from the first K/V a layer stores,
robustly: the first ``skip_first`` positions of each sequence (attention-sink tokens, whose norms
can be many times the others') and any token whose key norm exceeds ``outlier_norm`` times the
median are left out of the statistics.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Calibration:
    """Which transformations to fit. ``smooth_keys`` is the exponent ``α`` of ``s = σ^α`` (σ each
    channel's key standard deviation after centering, ``s`` normalized to geometric mean 1); 0 turns
    smoothing off. ``measure`` (the default): each KV head keeps, of no change, keys centered, and
    keys centered and smoothed, the one whose packed keys give the first chunk's own queries the
    smallest attention-output error (causal, over at most ``measure_tokens`` tokens of its longest
    sequence; ``fit``; a layer that keeps its last R tokens raw, ``exact_recent``, scores only the
    positions past them, where the packed keys are read: on one 2,048-token window decoded the
    last 256 tokens, with exact_recent=64, k3v4_nc on SmolLM2-135M went from +3.9 % to +1.0 %,
    where uncalibrated it is +2.2 %; RESULTS.md, "Keeping tokens unquantized"). Where no queries
    are at hand (a cache loaded from another), or with ``measure=False``, ``min_offset`` decides
    instead: center only the heads whose mean key is at least this fraction of their rms key norm
    (0: every head). The defaults are what measured best
    across three model families (benchmarks/targets.py, RESULTS.md, 3 windows): serving perplexity
    of 4bit_nc / k3v4_nc against the plain cache went from +3.6 / +22.9 % to +0.6 / +0.7 % on Gemma 3
    270M, from +2.3 / +4.7 % to -0.1 / +0.0 % on Qwen2.5-0.5B, and on SmolLM2-135M, whose serving
    loss is small without it, from +0.1 / +0.5 % to +0.2 / +0.3 %. ``min_tokens``: a first chunk
    with fewer usable tokens fits nothing (identity).

    ``exact_first_block``: where keys are centered, each sequence's first cache block (its
    attention-sink tokens, left out of the fit) is also kept raw beside the packed cache and
    attended exactly (``turboquant.hf``; ``PagedAttentionLayer(exact_first=...)``). Centering moves
    a low-norm sink key to a typical norm, and with it the quantization error of the key most of a
    head's attention goes to: SmolLM2-135M's serving k3v4_nc was +1.7 % calibrated without it and
    is +0.3 % with it, +0.5 % uncalibrated (docs/QUALITY.md). Costs ``block_size x 2 x D`` raw
    elements per sequence, KV head and layer."""

    center_keys: bool = True
    smooth_keys: float = 0.5
    center_values: bool = False
    min_offset: float = 0.0
    skip_first: int = 4
    outlier_norm: float = 4.0
    min_tokens: int = 16
    measure: bool = True
    measure_tokens: int = 512
    exact_first_block: bool = True

    def __post_init__(self):
        if not 0 <= self.min_offset < 1:
            raise ValueError(f"turboquant: Calibration.min_offset must be in [0, 1), got {self.min_offset}")
        if self.smooth_keys < 0 or self.smooth_keys > 1:
            raise ValueError(f"turboquant: Calibration.smooth_keys must be in [0, 1], got {self.smooth_keys}")
        if self.measure_tokens < 2:
            raise ValueError(f"turboquant: Calibration.measure_tokens must be >= 2, got {self.measure_tokens}")
        if self.skip_first < 0 or self.min_tokens < 1 or self.outlier_norm <= 1:
            raise ValueError("turboquant: Calibration needs skip_first >= 0, min_tokens >= 1 and outlier_norm > 1, got "
                             f"{self.skip_first}, {self.min_tokens}, {self.outlier_norm}")

    @property
    def enabled(self) -> bool:
        return self.center_keys or self.smooth_keys > 0 or self.center_values

    def exact_for(self, softcap: bool, sinks: bool) -> "Calibration":
        """The transformations of this recipe that stay exact for a layer's attention options: key
        centering shifts a query's logits by ``q·μ``, which soft-capping (not shift-invariant) and
        attention sinks (whose logit does not shift) do not allow; value centering needs weights
        that sum to 1, which sinks take from. Smoothing is exact under every option."""
        return replace(self, center_keys=self.center_keys and not (softcap or sinks),
                       center_values=self.center_values and not sinks)


def as_calibration(calibrate) -> Calibration | None:
    """``None``/``False``: none; ``True``: the default recipe; a ``Calibration``: itself."""
    if calibrate is None or calibrate is False:
        return None
    if calibrate is True:
        return Calibration()
    if isinstance(calibrate, Calibration):
        return calibrate if calibrate.enabled else None
    raise ValueError(f"turboquant: calibrate must be None, a bool or a turboquant.calibration.Calibration, got "
                     f"{type(calibrate).__name__}")


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 at least (float64 stays float64): the transformations' arithmetic."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class KVTransform:
    """``μ, s, ν`` ``[Hkv, D]``, float32 or wider (``None`` where a transformation is off)."""

    def __init__(self, key_offset=None, key_scale=None, value_offset=None):
        self.key_offset, self.key_scale, self.value_offset = key_offset, key_scale, value_offset

    # stored basis
    def keys(self, key: torch.Tensor) -> torch.Tensor:
        """``key [N, Hkv, D]`` -> ``(k − μ) ⊘ s`` in key's dtype."""
        k = _wide(key)
        if self.key_offset is not None:
            k = k - self.key_offset
        if self.key_scale is not None:
            k = k / self.key_scale
        return k.to(key.dtype)

    def values(self, value: torch.Tensor) -> torch.Tensor:
        if self.value_offset is None:
            return value
        return (_wide(value) - self.value_offset).to(value.dtype)

    # attention in the stored basis
    def query(self, query: torch.Tensor) -> torch.Tensor:
        """``query [T, Hq, D]`` -> ``q ⊙ s`` (query head ``h`` takes KV head ``h // group``)."""
        if self.key_scale is None:
            return query
        return (self._grouped(query) * self.key_scale[:, None]).reshape(query.shape).to(query.dtype)

    def output(self, out: torch.Tensor, attended: torch.Tensor | None = None) -> torch.Tensor:
        """Adds ``ν`` back to ``out [T, Hq, D]``; rows where ``attended`` (bool ``[T]``) is false
        (nothing to attend: the ops give zeros) stay zero."""
        if self.value_offset is None:
            return out
        shift = self.value_offset[:, None]  # [Hkv, 1, D]: every query head of a group
        if attended is not None:
            shift = shift * attended.to(shift.dtype)[:, None, None, None]
        return (self._grouped(out) + shift).reshape(out.shape).to(out.dtype)

    # back to the original basis
    def restore(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored-basis ``key, value [..., Hkv, D]`` -> the original basis."""
        k, v = _wide(key), value
        if self.key_scale is not None:
            k = k * self.key_scale
        if self.key_offset is not None:
            k = k + self.key_offset
        if self.value_offset is not None:
            v = (_wide(v) + self.value_offset).to(value.dtype)
        return k.to(key.dtype), v

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, Hq, D]`` -> ``[T, Hkv, group, D]`` in float32 or wider: query head ``h`` belongs to
        KV head ``h // group``, so the per-KV-head vectors broadcast without a copy per query head."""
        tokens, q_heads, dim = x.shape
        kv_heads = next(t for t in (self.key_scale, self.value_offset, self.key_offset) if t is not None).shape[0]
        return _wide(x).reshape(tokens, kv_heads, q_heads // kv_heads, dim)


def fit(key: torch.Tensor, value: torch.Tensor, query_start_loc: list[int], calibration: Calibration,
        query: torch.Tensor | None = None, preset: str | None = None, scale: float | None = None,
        exact_recent: int = 0, exact_first: int = 0) -> KVTransform:
    """Fits ``μ, s, ν`` from ``key, value [N, Hkv, D]``: the tokens of the sequences that start at
    ``query_start_loc[b]`` (their positions 0.. in the sequence), the first ``skip_first`` of each
    and outliers left out. With ``calibration.measure``, the chunk's ``query [N, Hq, D]``, the
    cache's ``preset`` and the attention's ``scale`` (default ``D ** -0.5``), each head keeps the
    candidate that ``_choose_per_head`` measures best (without them, ``min_offset`` decides), over the
    positions the layer reads packed (not its last ``exact_recent`` nor its first ``exact_first``)."""
    key_transforms = calibration.center_keys or calibration.smooth_keys > 0
    if calibration.measure and query is not None and preset is not None and key_transforms:
        everything = fit(key, value, query_start_loc, replace(calibration, measure=False, min_offset=0.0))
        if everything.key_offset is None and everything.key_scale is None:  # too few tokens: nothing to choose
            return everything
        return _choose_per_head(query, key, value, query_start_loc, preset, everything, calibration,
                                scale if scale is not None else key.shape[-1] ** -0.5, exact_recent, exact_first)
    keep = torch.ones(key.shape[0], dtype=torch.bool, device=key.device)
    for start, end in zip(query_start_loc[:-1], query_start_loc[1:]):
        keep[start:min(end, start + calibration.skip_first)] = False
    k, v = _wide(key[keep]), _wide(value[keep])  # [n, Hkv, D]
    if k.shape[0] < calibration.min_tokens:
        return KVTransform()
    norms = k.norm(dim=-1)  # [n, Hkv]
    typical = (norms <= calibration.outlier_norm * norms.median(dim=0).values).float()[..., None]  # [n, Hkv, 1]
    count = typical.sum(0).clamp_min(1)  # [Hkv, 1]
    mean_k = (k * typical).sum(0) / count
    key_offset = None
    if calibration.center_keys:
        rms = ((norms.square()[..., None] * typical).sum(0) / count).sqrt()  # [Hkv, 1]
        # A head whose offset is small against its keys' norm keeps it: centering gains little there
        # and moves its low-norm sink tokens, often most of the attention, to a typical norm
        # (SmolLM2 and Qwen2.5 per head: docs/QUALITY.md).
        key_offset = mean_k * (mean_k.norm(dim=-1, keepdim=True) >= calibration.min_offset * rms)
    key_scale = None
    if calibration.smooth_keys > 0:
        centered = k - mean_k
        std = ((centered.square() * typical).sum(0) / count).sqrt().clamp_min(1e-6)  # [Hkv, D]
        scale = std.pow(calibration.smooth_keys)
        key_scale = scale / scale.log().mean(dim=-1, keepdim=True).exp()  # geometric mean 1 per head
    value_offset = (v * typical).sum(0) / count if calibration.center_values else None
    return KVTransform(key_offset, key_scale, value_offset)


def _choose_per_head(query, key, value, query_start_loc, preset: str, fitted: KVTransform,
                     calibration: Calibration, scale: float, exact_recent: int = 0,
                     exact_first: int = 0) -> KVTransform:
    """Per KV head, the candidate of ``fitted`` (identity; its centering; its centering and
    smoothing, or its smoothing where centering is off) whose packed keys change the attention
    output of the chunk's longest sequence's first ``measure_tokens`` queries least (relative error
    over the head's query group, causal without the layer's window, values unquantized: the
    candidates differ in keys only). Ties keep the simpler one."""
    from .roundtrip import packed  # the ops: imported here, not at module load

    bounds = list(zip(query_start_loc[:-1], query_start_loc[1:])) or [(0, key.shape[0])]
    start, end = max(bounds, key=lambda b: b[1] - b[0])  # the longest sequence of the chunk
    end = min(end, start + calibration.measure_tokens)
    q, k = _wide(query[start:end]).double(), _wide(key[start:end]).double()  # [n, Hq, D], [n, Hkv, D]
    n, kv_heads = k.shape[0], k.shape[1]
    q = q.reshape(n, kv_heads, -1, q.shape[-1])  # [n, Hkv, group, D]
    causal = torch.ones(n, n, dtype=torch.bool, device=k.device).tril()
    v = _wide(value[start:end]).double()

    # With exact tokens, a query reads its last `exact_recent` positions and the sequence's first
    # `exact_first` raw: the packed keys' error only matters elsewhere, and the choice is measured
    # the same way (the measured sequence starts at position 0).
    position = torch.arange(n, device=k.device)
    raw = causal & ((position[:, None] - position[None, :] < exact_recent) | (position[None, :] < exact_first))

    def attend(keys):  # -> [Hkv, group, n, D]
        logits = torch.einsum("nhgd,mhd->hgnm", q, keys) * scale
        if exact_recent > 0 or exact_first > 0:
            logits = torch.where(raw, torch.einsum("nhgd,mhd->hgnm", q, k) * scale, logits)
        return torch.einsum("hgnm,mhd->hgnd", logits.masked_fill(~causal, float("-inf")).softmax(-1), v)

    reference = attend(k)
    candidates = [KVTransform()]  # (offset, scale) of each, simplest first
    if fitted.key_offset is not None:
        candidates.append(KVTransform(fitted.key_offset))
    if fitted.key_scale is not None:
        candidates.append(KVTransform(fitted.key_offset, fitted.key_scale))
    errors = []
    for t in candidates:
        stored = t.keys(key[start:end].float())
        restored, _ = t.restore(*packed(preset, stored, stored))
        out = attend(restored.double())
        errors.append((out - reference).square().sum((1, 2, 3)) / reference.square().sum((1, 2, 3)))  # [Hkv]
    choice = torch.stack(errors).argmin(0)  # first minimum: the simpler candidate on a tie
    chosen = [candidates[int(c)] for c in choice]  # per KV head
    offset = key_scale = None
    if fitted.key_offset is not None:
        offset = torch.stack([t.key_offset[h] if t.key_offset is not None else torch.zeros_like(fitted.key_offset[h])
                              for h, t in enumerate(chosen)])
    if fitted.key_scale is not None:
        key_scale = torch.stack([t.key_scale[h] if t.key_scale is not None else torch.ones_like(fitted.key_scale[h])
                              for h, t in enumerate(chosen)])
    return KVTransform(offset, key_scale, fitted.value_offset)
