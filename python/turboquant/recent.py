"""Tokens of each sequence kept exact beside the packed cache: its most recent ones, and its first ones.

Most of what a long generation loses to a 3-4-bit cache is lost on its last few tokens (local heads
weigh them most; docs/QUALITY.md, *Where the decode loss is*): SmolLM2's 4bit_nc decode loss is
+6.2 % with every token packed, +0.9 % with the last 64 raw. Every token is still packed (the cache
bytes do not change); ``RecentTokens`` also keeps the raw K/V of each sequence's last ``count``
positions, in a ring per sequence indexed by position mod ``count``. A decode step then attends to
positions ``[0, L - count)`` on the packed cache and to ``[L - count, L)`` exactly, and merges the
two by their log-sum-exps (``decode(..., return_lse=True)``); a chunk that attends to a dequantized
prefix gets the ring's tokens put back into it. Cost: ``count x 2 x D`` raw elements per sequence,
KV head and layer, whatever the context.

``FirstTokens`` keeps each sequence's first positions the same way (a calibrated layer's attention
sinks: ``turboquant.calibration``, ``Calibration.exact_first_block``); a decode step then reads the packed
cache from the block after them on, so they are a whole number of cache blocks.
"""

from __future__ import annotations

import torch


class RecentTokens:
    """Rings of the last ``count`` raw K/V per sequence id: ``keys``/``values`` ``[S + 1, count, Hkv, D]``
    and ``positions [S + 1, count]`` (the position each entry holds, -1 for none); the last row takes
    the writes of tokens that do not enter a ring (padding, or older than their sequence's last
    ``count`` in a long chunk), so a store needs no host synchronisation."""

    def __init__(self, count: int, num_kv_heads: int, head_dim: int, dtype, device):
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"turboquant: exact_recent must be an int >= 0, got {count!r}")
        self.count = count
        self.keys = torch.zeros(1, count, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.positions = torch.full((1, count), -1, dtype=torch.long, device=device)

    @property
    def sequences(self) -> int:
        return self.keys.shape[0] - 1

    def reserve(self, sequences: int) -> None:
        """Room for sequence ids ``< sequences`` (new rows hold nothing)."""
        extra = sequences - self.sequences
        if extra <= 0:
            return
        grow = lambda t, fill: torch.cat([t[:-1], t.new_full((extra, *t.shape[1:]), fill), t[-1:]])
        self.keys, self.values, self.positions = grow(self.keys, 0), grow(self.values, 0), grow(self.positions, -1)

    def enters(self, position: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        """Which tokens at ``position`` of sequences now ``length`` long the ring keeps: the last ``count``."""
        return position >= length - self.count

    def store(self, key: torch.Tensor, value: torch.Tensor, sequence: torch.Tensor, position: torch.Tensor,
              stored: torch.Tensor) -> None:
        """Token ``t`` (``key``/``value [T, Hkv, D]``) of sequence id ``sequence[t]`` at ``position[t]``
        enters the ring where ``stored[t]``."""
        rows = torch.where(stored, sequence, self.sequences)
        column = position.clamp_min(0) % self.count
        self.keys[rows, column] = key.to(self.keys.dtype)
        self.values[rows, column] = value.to(self.values.dtype)
        self.positions[rows, column] = torch.where(stored, position, -1)

    def select(self, rows: list[int]) -> None:
        """Sequence ``i`` becomes a copy of sequence ``rows[i]`` (beam search)."""
        index = torch.tensor(rows + [self.sequences], dtype=torch.long, device=self.keys.device)
        self.keys, self.values, self.positions = (t.index_select(0, index) for t in (self.keys, self.values, self.positions))

    def forget_from(self, lengths: list[int]) -> None:
        """Sequence ``i`` keeps positions ``< lengths[i]`` only."""
        limit = torch.tensor(lengths + [0], device=self.positions.device)[:, None]
        self.positions = torch.where(self.positions < limit, self.positions, -1)

    def visible(self, sequence: torch.Tensor, seq_lens: torch.Tensor, window_left: int = -1) -> torch.Tensor:
        """``[B, count]`` bool: which ring entries a decode row of each sequence attends to (its
        positions ``[max(L - count, 0), L)``, and within its window)."""
        pos = self.positions.index_select(0, sequence)
        lens = seq_lens.long()[:, None]
        seen = (pos >= 0) & self._attended(pos, lens)
        if window_left >= 0:
            seen &= pos >= lens - 1 - window_left
        return seen

    def _attended(self, pos: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """Which held positions a decode row of a sequence ``lens`` long reads from here."""
        return (pos < lens) & (pos >= lens - self.count)

    def attend(self, query: torch.Tensor, sequence: torch.Tensor, seq_lens: torch.Tensor, scale: float,
               window_left: int = -1, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step over the ring: ``query [B, Hq, D]`` -> (output ``[B, Hq, D]`` fp32, zeros
        where nothing is seen; log-sum-exp ``[B, Hq]``, -inf there)."""
        keys = self.keys.index_select(0, sequence).float()  # [B, R, Hkv, D]
        values = self.values.index_select(0, sequence).float()
        group = query.shape[1] // keys.shape[2]
        q = query.float().view(query.shape[0], keys.shape[2], group, -1)
        logits = torch.einsum("bkgd,brkd->bkgr", q, keys) * scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        seen = self.visible(sequence, seq_lens, window_left)[:, None, None, :]
        logits = logits.masked_fill(~seen, float("-inf"))
        lse = torch.logsumexp(logits, -1)  # -inf where nothing is seen
        weights = torch.where(seen, (logits - lse.clamp_min(torch.finfo(torch.float32).min)[..., None]).exp(), 0.0)
        out = torch.einsum("bkgr,brkd->bkgd", weights, values)
        return out.reshape(query.shape).float(), lse.reshape(query.shape[:2])

    def overlay(self, keys: torch.Tensor, values: torch.Tensor, sequence: int, first: int) -> torch.Tensor:
        """Puts the ring's entries of ``sequence`` into its dense prefix ``keys``/``values [N, Hkv, D]``
        (positions ``first .. first + N - 1``), in place, and returns the rows it put back (one host
        synchronisation: the long-chunk path that calls it has made one already)."""
        index = self.positions[sequence] - first
        inside = (self.positions[sequence] >= 0) & (index >= 0) & (index < keys.shape[0])
        keys[index[inside]] = self.keys[sequence][inside].to(keys.dtype)
        values[index[inside]] = self.values[sequence][inside].to(values.dtype)
        return index[inside]

    def refill(self, sequence: int, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Entries for the positions ``[length - count, length)`` of ``sequence`` that the ring lost
        (a crop forgot the newer positions that had overwritten them) from ``keys``/``values
        [length, Hkv, D]``, the sequence's dequantized cache: those few are then packed values."""
        first = max(length - self.count, 0)
        position = torch.arange(first, length, device=self.positions.device)
        held = self.positions[sequence, position % self.count] == position
        missing = position[~held]
        if missing.numel():
            ids = torch.full_like(missing, sequence)
            self.store(keys[missing], values[missing], ids, missing, torch.ones_like(missing, dtype=torch.bool))


def merge_by_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint sets of keys merged into the attention over both: ``out [B, H, D]``
    each normalized over its own set, ``lse [B, H]`` its log-sum-exp (-inf for an empty set)."""
    m = torch.maximum(lse_a, lse_b).clamp_min(torch.finfo(torch.float32).min)  # both empty: weights 0
    wa, wb = (lse_a - m).exp()[..., None], (lse_b - m).exp()[..., None]
    total = (wa + wb).clamp_min(torch.finfo(torch.float32).tiny)
    return (wa * out_a.float() + wb * out_b.float()) / total


class FirstTokens(RecentTokens):
    """The raw K/V of each sequence's first ``count`` positions (entry ``p`` holds position ``p``),
    attended exactly up to where a ``RecentTokens`` of ``recent`` entries takes over. A crop forgets
    the positions past it (``forget_from``); the sequence's next tokens there enter as they are stored."""

    def __init__(self, count: int, recent: int, num_kv_heads: int, head_dim: int, dtype, device):
        super().__init__(count, num_kv_heads, head_dim, dtype, device)
        self.recent = recent

    def enters(self, position: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        return position < self.count

    def _attended(self, pos: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        return pos < lens - self.recent  # the recent ring holds the rest
