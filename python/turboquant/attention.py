"""A reference attention layer for one engine step's mixed batch, in plain PyTorch around the ops.

Batch order follows vLLM: the first ``num_decodes`` sequences decode one token each, the rest are
prefill chunks. For every step the layer:
  1. stores the step's new K/V into the layer's paged cache (``slot_mapping``),
  2. decodes the decode sequences on the packed cache (one ``decode`` call),
  3. first prefill chunks (nothing cached before them) run SDPA, causal, on the raw K/V,
  4. continuation chunks run ``decode_varlen`` on the packed cache when short (<=
     ``varlen_threshold`` tokens; the chunk's own keys are read back packed, as the kernel reads
     only the cache), else dequantize the tokens cached before the chunk and run SDPA over them and
     the chunk's own raw K/V, causal aligned to the bottom right (the chunk's last token sees the
     whole context). Raw own K/V is what vLLM's TurboQuant backend attends to in a chunked prefill,
     and it keeps a long chunk's attention to itself exact.
A layer built with ``calibration`` (``turboquant.calibration``) fits exact per-head transformations
of K/V from the first K/V it stores and keeps the packed cache in their basis: stores take
``(k − μ) ⊘ s`` and ``v − ν``, the ops attend with ``q ⊙ s`` and ``ν`` is added to their output,
dequantized K/V are restored to the original basis.
A layer built with ``preset=None`` keeps a plain paged bf16/fp16 cache (the boundary layers that
``boundary_skip_layers`` selects) and runs every part with SDPA over the gathered cache.
A layer built with attention options (``window_left``, ``softcap``, ``sinks``: see
``turboquant.ops.decode``) applies them on every path: the ops take them, and the dense paths
(first chunks, long continuation chunks, the plain cache) use SDPA with a windowed mask, or
eager attention in fp32 where soft-capping or sinks are set (SDPA has neither). Calibration keeps
only the transformations that stay exact under them (``Calibration.exact_for``).

A layer built with ``exact_recent=R`` also keeps each sequence's last R raw K/V beside the packed
cache (``turboquant.recent``): decode steps attend to the older positions on the packed cache and
to the last R exactly, merged by their log-sum-exps; a continuation chunk gets the R positions
before it put back into its dequantized prefix (it takes that path at every length; its own K/V
are raw). Its steps name their sequences (``StepMetadata.sequence_ids``).
``exact_first=F`` (a whole number of blocks) keeps each sequence's first F raw K/V the same way:
decode steps read the packed cache from the block after them on. A calibrated layer keeps its
attention sinks so (``Calibration.exact_first_block``; turboquant.hf sets it to one block).
``shift_packed_logits=True`` lowers the packed keys' logits by their expected quantization noise
wherever raw keys share their softmax (exact tokens, a long chunk's own K/V): the decode's packed
log-sum-exp before the merge, the packed columns of the dense paths (``turboquant.packed_noise``).

A pure-decode step (every sequence decodes one token) makes no host synchronisation, for either
kind of layer, so it can be captured in a CUDA graph and replayed with new seq_lens, block tables
and slot mappings written into the captured tensors.

The default threshold, 64 query tokens, is measured (benchmarks/bench_continuation.py, H200,
Hq=32, Hkv=8, D=128, 4bit_nc, one sequence, bf16): decode_varlen shares each key tile across the
query tokens of a CTA (2 on the decode kernel, 16 on the chunked kernel it picks for long chunks
at GQA 4), so it wins for short chunks and loses for long ones at long contexts. At L=32k: 324 vs
355 us at 64 tokens, 624 vs 442 us at 128; at L=8k: 99 vs 141 us at 64, 181 vs 163 at 128; at
L=2k it wins at every length up to 128 (65 vs 126 us; commit aee6a9d).
Tables in benchmarks/RESULTS.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from .cache import allocate_kv_cache
from .calibration import Calibration, KVTransform, fit
from .ops import decode, decode_varlen, dequantize, head_dim_for_slot, store_kv
from .packed_noise import PackedKeyNoise
from .recent import FirstTokens, RecentTokens, merge_by_lse


@dataclass
class StepMetadata:
    """One engine step. ``query_start_loc [B+1]`` int32 (cumulative new tokens per sequence),
    ``seq_lens [B]`` int32 (cached tokens including this step's), ``block_table [B, W]`` int32,
    ``slot_mapping [T]`` (cache slot of each new token), ``num_decodes`` leading decode sequences."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int
    # Host copies, where the caller has them (a serving engine does): a step with prefill chunks
    # then reads its chunk bounds without copying them back from the GPU.
    query_start_loc_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    # Each sequence's id [B] int64 among num_sequences, stable across steps: what per-sequence state
    # beside the cache (a layer's exact recent tokens) is kept by.
    sequence_ids: torch.Tensor | None = None
    num_sequences: int = 0

    def host_bounds(self) -> tuple[list[int], list[int]]:
        """(query_start_loc, seq_lens) as host ints."""
        starts = self.query_start_loc_host if self.query_start_loc_host is not None else self.query_start_loc.tolist()
        lens = self.seq_lens_host if self.seq_lens_host is not None else self.seq_lens.tolist()
        return starts, lens


def visible_keys(key_position: torch.Tensor, query_position: torch.Tensor, window_left: int = -1) -> torch.Tensor:
    """Which keys a query at ``query_position`` sees (broadcasting): causal, and with
    ``window_left >= 0`` from ``query_position - window_left`` on (the ops' window)."""
    visible = key_position <= query_position
    if window_left >= 0:
        visible &= key_position >= query_position - window_left
    return visible


def bottom_right_mask(queries: int, keys: int, window_left: int = -1, device=None) -> torch.Tensor:
    """[queries, keys] bool: the last query at the last key, each query at its position
    ``keys - queries + i`` seeing causally (``visible_keys``)."""
    position = torch.arange(keys - queries, keys, device=device)[:, None]
    return visible_keys(torch.arange(keys, device=device)[None, :], position, window_left)


def _sdpa_gqa(q, k, v, mask, scale: float):
    """SDPA with GQA ([B, Hq, M, D] against [B, Hkv, N, D]) without copying K/V per query head where
    torch has enable_gqa (2.5 on), in q's dtype."""
    try:
        return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                              enable_gqa=True)
    except TypeError:  # torch < 2.5 has no enable_gqa: copy K/V once per query head
        group = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.to(q.dtype).repeat_interleave(group, 1),
                                              v.to(q.dtype).repeat_interleave(group, 1), attn_mask=mask, scale=scale)


def dense_attention(q, k, v, mask, scale: float, softcap: float = 0.0, sinks=None):
    """q [B, Hq, M, D] attends k, v [B, Hkv, N, D] where the bool ``mask`` [B or 1, 1, M, N] allows:
    SDPA (GQA without copies) when neither soft-capping nor sinks are set, else eager attention in
    fp32 with the ops' definitions. Rows that see nothing (and have no sink) are zeros. -> [B, Hq, M, D]
    in q's dtype."""
    if not softcap and sinks is None:
        out = _sdpa_gqa(q, k, v, mask, scale)
        return torch.where(mask.any(-1, keepdim=True), out, 0.0)  # SDPA gives NaN rows where all is masked
    group = q.shape[1] // k.shape[1]
    logits = torch.einsum("bhmd,bhnd->bhmn", q.float(), k.float().repeat_interleave(group, 1)) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(*logits.shape[:3], 1)
        weights = torch.cat([logits, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        weights = logits.softmax(-1)
    weights = torch.where(mask.any(-1, keepdim=True), weights, 0.0)  # nothing visible: zeros, as the ops give
    return torch.einsum("bhmn,bhnd->bhmd", weights, v.float().repeat_interleave(group, 1)).to(q.dtype)


class PagedAttentionLayer:
    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, preset: str | None,
                 device="cpu", dtype=torch.bfloat16, varlen_threshold: int = 64,
                 calibration: Calibration | None = None, window_left: int = -1, softcap: float = 0.0,
                 sinks: torch.Tensor | None = None, cache: torch.Tensor | None = None, exact_recent: int = 0,
                 exact_first: int = 0, shift_packed_logits: bool = False):
        """``cache``: a packed cache to attend over instead of allocating one (see ``over_cache``).
        ``exact_recent``, ``exact_first``: the last and the first this many tokens of each sequence
        attend exactly (module docstring); ``exact_first`` is a multiple of ``block_size``.
        ``shift_packed_logits``: where raw and packed keys share a softmax, lower the packed keys'
        logits by their expected quantization noise (``turboquant.packed_noise``)."""
        self.preset, self.block_size, self.head_dim, self.dtype = preset, block_size, head_dim, dtype
        self.recent = (RecentTokens(exact_recent, num_kv_heads, head_dim, dtype, device)
                       if exact_recent != 0 and preset is not None else None)
        if isinstance(exact_first, bool) or not isinstance(exact_first, int) or exact_first < 0 or exact_first % block_size:
            raise ValueError(f"turboquant: exact_first must be a multiple of block_size ({block_size}) >= 0, got "
                             f"{exact_first!r}")
        self.first = (FirstTokens(exact_first, exact_recent, num_kv_heads, head_dim, dtype, device)
                      if exact_first and preset is not None else None)
        # Every store of raw tokens beside the packed cache, first tokens first.
        self.exact_tokens = [t for t in (self.first, self.recent) if t is not None]
        noise = PackedKeyNoise(preset, num_kv_heads, head_dim, device) if shift_packed_logits and preset else None
        self.noise = noise if noise is not None and noise.active else None  # FP8 keys: nothing to shift
        self.varlen_threshold = varlen_threshold
        self._recipe = calibration if preset is not None else None
        self.transform: KVTransform | None = None  # fitted on the first store when calibrating
        self.window_left = self.softcap = self._sinks_source = None  # set_attention_options sets them
        self.set_attention_options(window_left, softcap, sinks, device)
        if preset is None:  # plain paged cache: [num_blocks, block_size, 2 (K, V), Hkv, D]
            rows = num_blocks * block_size
            # One spare row past the cache takes the writes of padding / out-of-range slots, so a
            # store needs no data-dependent indexing (no host sync).
            self._rows = torch.zeros(rows + 1, 2, num_kv_heads, head_dim, dtype=dtype, device=device)
            self.cache = self._rows[:rows].view(num_blocks, block_size, 2, num_kv_heads, head_dim)
        elif cache is not None:
            self.cache = cache
        else:
            self.cache = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, preset, device)

    @classmethod
    def over_cache(cls, cache: torch.Tensor, preset: str, dtype=torch.bfloat16, varlen_threshold: int = 64,
                   window_left: int = -1, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> "PagedAttentionLayer":
        """A layer that attends over a packed cache it does not own (``[num_blocks, block_size, Hkv,
        slot]``, any strides for the first three dims): a serving engine allocates the cache and may
        hand a new view of it every step (assign ``layer.cache``). No calibration: the cache holds
        the presets' bytes only. No packed-logit shift either: the engine stores the keys, so the
        layer never sees the key norms the shift is taken from."""
        num_blocks, block_size, num_kv_heads, slot = cache.shape
        return cls(num_blocks, block_size, num_kv_heads, head_dim_for_slot(preset, slot), preset, cache.device, dtype,
                   varlen_threshold, None, window_left, softcap, sinks, cache=cache, shift_packed_logits=False)

    def set_attention_options(self, window_left: int = -1, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                              device=None) -> None:
        """The layer's attention options (see ``turboquant.ops.decode``); fixed once the layer has
        stored K/V through a calibration, whose exact transformations depend on them. A model calls
        this every step with the same options: that returns at once."""
        if (window_left, softcap) == (self.window_left, self.softcap) and sinks is self._sinks_source:
            return
        if not isinstance(window_left, int) or window_left < -1:
            raise ValueError(f"turboquant: window_left must be -1 (no window) or an int >= 0, got {window_left!r}")
        if not isinstance(softcap, (int, float)) or not 0 <= softcap < float("inf"):
            raise ValueError(f"turboquant: softcap must be a finite number >= 0 (0 = none), got {softcap!r}")
        if sinks is not None and (not torch.is_tensor(sinks) or sinks.dim() != 1):
            raise ValueError(f"turboquant: sinks must be a 1-D tensor [num_q_heads] or None, got {sinks!r}")
        calibration = None
        if self._recipe is not None:
            calibration = self._recipe.exact_for(softcap=softcap > 0, sinks=sinks is not None)
            if self.transform is not None and calibration != self.calibration:
                raise ValueError("turboquant: a calibrated layer's soft-capping and sinks cannot change after it has "
                                 "stored K/V (its transformations were fitted for the options it had)")
        self.calibration = calibration
        self.window_left, self.softcap = window_left, float(softcap)
        if sinks is None:
            self.sinks = self._sinks_source = None
        elif sinks is not self._sinks_source:  # a model passes the same parameter every step: convert it once
            target = device if device is not None else sinks.device
            self.sinks = sinks.detach().to(device=target, dtype=torch.float32).contiguous()
            self._sinks_source = sinks

    def grow(self, num_blocks: int) -> None:
        """Enlarges a packed cache to ``num_blocks`` blocks, keeping the blocks it holds (block ids
        stay valid). A cache that serves a growing conversation calls this instead of reserving
        the longest context up front."""
        if self.preset is None:
            raise ValueError("turboquant: only a packed cache (preset given) grows; the plain cache is sized at creation")
        have = self.cache.shape[0]
        if num_blocks <= have:
            return
        grown = allocate_kv_cache(num_blocks, self.block_size, self.cache.shape[2], self.head_dim, self.preset,
                                  self.cache.device)
        grown[:have].copy_(self.cache)
        self.cache = grown

    # ---- cache access
    def _store(self, key, value, slot_mapping, query_start_loc: list[int], query=None, scale=None):
        """``query_start_loc``: where each sequence's new tokens start in ``key`` (host ints);
        ``query``, ``scale``: the step's queries and softmax scale, which a measuring calibration
        chooses its transformations by."""
        if self.preset is None:
            spare = self._rows.shape[0] - 1
            slots = slot_mapping.long()
            rows = torch.where((slots >= 0) & (slots < spare), slots, spare)
            self._rows.index_copy_(0, rows, torch.stack([key, value], dim=1).to(self.dtype))
        else:
            if self.calibration is not None and self.transform is None:
                self.transform = fit(key, value, query_start_loc, self.calibration, query, self.preset, scale,
                                     self.recent.count if self.recent is not None else 0,
                                     self.first.count if self.first is not None else 0)
            store_kv(key, value, self.cache, slot_mapping, self.preset, **self._transform_args)
            if self.noise is not None:
                stored = key if self.transform is None else self.transform.keys(key)
                self.noise.observe(stored, slot_mapping[:key.shape[0]] >= 0)

    def _exact_entries(self, key, meta: StepMetadata):
        """Where the step's tokens are in their sequences, for the stores of exact tokens:
        ``(sequence, position, length, stored)``, one entry per token of the step's rows in order
        (None without such stores)."""
        if not self.exact_tokens:
            return None
        if meta.sequence_ids is None:
            raise ValueError("turboquant: a layer with exact_recent or exact_first needs steps that name their "
                             "sequences (StepMetadata.sequence_ids and num_sequences; turboquant.hf gives them)")
        for exact in self.exact_tokens:
            exact.reserve(meta.num_sequences)
        rows = meta.seq_lens.shape[0]
        stored = meta.slot_mapping >= 0
        if meta.num_decodes == rows:  # one token per sequence, at its last position
            length = meta.seq_lens.long()
            return meta.sequence_ids, length - 1, length, stored
        starts, _ = meta.host_bounds()
        counts = torch.tensor([starts[i + 1] - starts[i] for i in range(rows)], device=key.device)
        row = torch.repeat_interleave(torch.arange(rows, device=key.device), counts)
        length = meta.seq_lens.long().index_select(0, row)
        chunk_end = meta.query_start_loc.long()[1:].index_select(0, row)
        position = length - (chunk_end - torch.arange(starts[-1], device=key.device))
        return meta.sequence_ids.index_select(0, row), position, length, stored[:starts[-1]]

    def _put_exact(self, key, value, entries, tokens: slice = slice(None)) -> None:
        """The step's tokens ``tokens`` into the stores of exact tokens at their ``entries``
        (``_exact_entries``). Only the tokens a store keeps enter it (a sequence's last ``count``,
        or its first): they take distinct entries, where index_put would keep an unspecified one
        of several writes to one entry."""
        if entries is None:
            return
        sequence, position, length, stored = (t[tokens] for t in entries)
        if position.numel():
            count = entries[1].shape[0]
            for exact in self.exact_tokens:
                exact.store(key[:count][tokens], value[:count][tokens], sequence, position,
                            stored & exact.enters(position, length))

    def _store_exact(self, key, value, meta: StepMetadata) -> None:
        """The step's tokens into the stores of exact tokens (a no-op without them)."""
        self._put_exact(key, value, self._exact_entries(key, meta))

    def store(self, key, value, meta: StepMetadata) -> None:
        """Stores a step's K/V without attending (a cache filled from another one)."""
        self._store(key, value, meta.slot_mapping, meta.host_bounds()[0])
        self._store_exact(key, value, meta)

    def refill_recent(self, block_table: torch.Tensor, seq_lens: list[int]) -> None:
        """After positions were forgotten (a crop): sequence id ``i`` (``block_table`` row ``i``) keeps
        its positions ``< seq_lens[i]``, and the ring entries it lost come back from its packed
        cache, so its last ``exact_recent`` positions are all in the ring again (those few packed).
        Its first tokens (``exact_first``) past the crop are forgotten."""
        if self.first is not None:
            self.first.forget_from(seq_lens)
        if self.recent is None:
            return
        self.recent.forget_from(seq_lens)
        keys, values = self._dense(block_table, torch.tensor(seq_lens, dtype=torch.int32, device=block_table.device))
        for sequence, length in enumerate(seq_lens):
            self.recent.refill(sequence, keys[sequence, :length], values[sequence, :length], length)

    def _dense(self, block_table, seq_lens):
        """Dense K, V [B, W * block_size, Hkv, D] for the given sequences."""
        if self.preset is None:
            g = self.cache[block_table.long()]  # [B, W, bs, 2, H, D]
            g = g.flatten(1, 2)
            return g[:, :, 0], g[:, :, 1]
        return dequantize(self.cache, block_table, seq_lens, self.preset, self.dtype, **self._transform_args)

    @property
    def _options(self) -> dict:
        return {"window_left": self.window_left, "softcap": self.softcap, "sinks": self.sinks}

    @property
    def _transform_args(self) -> dict:
        """The fitted transformations as the ops take them (fp32 ``key_offset``, ``key_scale``,
        ``value_offset``): every op on the cache applies them, so the layer works in the original basis."""
        t = self.transform
        if t is None:
            return {}
        return {name: (x.float() if x is not None else None) for name, x in
                (("key_offset", t.key_offset), ("key_scale", t.key_scale), ("value_offset", t.value_offset))}

    def _sdpa(self, q, k, v, scale, packed_shift=None, packed=None):
        """q [m, Hq, D] attends k, v [n, Hkv, D] (n >= m), causal aligned to the bottom right: query i
        sees keys < n - m + i + 1 (and, with a window, from n - m + i - window_left on). In q's
        dtype, so the flash kernel takes it on the GPU, and with enable_gqa: flash reads each KV head
        once for its whole group (no repeat_interleave copy of the context, Hq / Hkv times its size).
        ``packed_shift [m, Hq]`` (``_packed_shift``) lowers the logits of the keys where ``packed
        [n]`` (bool): one more coordinate, ``-shift / scale`` on the query and 1 on a packed key, so
        SDPA keeps its kernels and causal mask."""
        m, n = q.shape[0], k.shape[0]
        if packed_shift is not None:
            q = torch.cat([q, (-packed_shift / scale).to(q.dtype)[..., None]], -1)
            k = torch.cat([k, packed.to(k.dtype)[:, None, None].expand(n, k.shape[1], 1)], -1)
        q4, k4, v4 = (t.transpose(0, 1).to(q.dtype).unsqueeze(0) for t in (q, k, v))
        if self.window_left < 0 and not self.softcap and self.sinks is None:
            out = _sdpa_gqa(q4, k4, v4, causal_lower_right(m, n), scale)
        else:
            mask = bottom_right_mask(m, n, self.window_left, q.device)[None, None]
            out = dense_attention(q4, k4, v4, mask, scale, self.softcap, self.sinks)
        return out[0].transpose(0, 1)

    def _packed_shift(self, query, scale):
        """``[T, Hq]``: how much a packed key's logit is lowered for each row of ``query [T, Hq, D]``
        where raw keys share its softmax (``turboquant.packed_noise``); None where the layer does
        not shift (no noise to undo, or soft-capping or sinks)."""
        if self.noise is None or self.softcap or self.sinks is not None:
            return None
        return self.noise.logit_shift(query if self.transform is None else self.transform.query(query), scale)

    def _decode_with_exact(self, query, block_table, seq_lens, scale, sequence):
        """``_decode`` with exact tokens: positions ``[F, L - R)`` on the packed cache (with its
        log-sum-exp; the table from the block after the first F tokens on), the first F and the
        last R from their stores, merged. The packed call's window is the layer's less R, so that
        it still starts at the query's ``L - 1 - window_left`` (the F skipped positions shift the
        query and the keys alike)."""
        r = self.recent.count if self.recent is not None else 0
        f = self.first.count if self.first is not None else 0
        window = self.window_left
        packed_lens = (seq_lens - r - f).clamp_min(0).to(seq_lens.dtype)
        packed_window = window - r if window >= 0 else -1
        if window >= 0 and packed_window < 0:  # the whole window lies among the exact tokens
            packed_lens, packed_window = torch.zeros_like(packed_lens), -1
        if f and block_table.shape[1] > f // self.block_size:  # else nothing is packed past them
            block_table = block_table[:, f // self.block_size:].contiguous()
        out, lse = decode(query, self.cache, block_table, packed_lens, self.preset, scale, window_left=packed_window,
                          softcap=self.softcap, sinks=self.sinks, return_lse=True, **self._transform_args)
        shift = self._packed_shift(query, scale)
        if shift is not None:
            lse = lse - shift
        for exact in self.exact_tokens:
            exact_out, exact_lse = exact.attend(query, sequence, seq_lens, scale, window, self.softcap)
            out = merge_by_lse(out, lse, exact_out, exact_lse)
            lse = torch.logaddexp(lse, exact_lse)
        return out.to(query.dtype)

    def _decode(self, query, block_table, seq_lens, scale, sequence=None):
        """One new token per sequence, query [B, Hq, D], without host synchronisation."""
        if self.exact_tokens:
            return self._decode_with_exact(query, block_table, seq_lens, scale, sequence)
        if self.preset is not None:
            return decode(query, self.cache, block_table, seq_lens, self.preset, scale, **self._options,
                          **self._transform_args)
        k, v = self._dense(block_table, seq_lens)  # [B, N, Hkv, D]
        key_position = torch.arange(k.shape[1], device=query.device)[None, :]
        visible = visible_keys(key_position, seq_lens[:, None].long() - 1, self.window_left)  # [B, N]; none at seq_len 0
        out = dense_attention(query.float().unsqueeze(2), k.transpose(1, 2).float(), v.transpose(1, 2).float(),
                              visible[:, None, None, :], scale, self.softcap, self.sinks)
        return out[:, :, 0].to(query.dtype)

    def forward(self, query, key, value, meta: StepMetadata, scale: float) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D] -> [T, Hq, D]: stores the step's K/V, then attends."""
        if meta.num_decodes == meta.seq_lens.shape[0]:  # pure decode: capturable in a CUDA graph
            self._store(key, value, meta.slot_mapping, [])  # positions unknown: no skip_first
            self._store_exact(key, value, meta)
            return self.attend(query, key, value, meta, scale)
        self._store(key, value, meta.slot_mapping, meta.host_bounds()[0], query, scale)
        # A decoding token is among its own exact recent ones; a chunk attends to itself raw and
        # gets the R tokens before it exact from the ring, so its own tokens enter the ring after it
        # attended. Stored first, a chunk of R or more tokens pushed every token before it out of the
        # ring: fed in 256-token chunks, SmolLM2-135M's per-token losses with exact_recent=64 were
        # bit-identical to those without it.
        entries, decodes = self._exact_entries(key, meta), meta.num_decodes  # decodes: the first rows, a token each
        self._put_exact(key, value, entries, slice(0, decodes))
        out = self.attend(query, key, value, meta, scale)
        self._put_exact(key, value, entries, slice(decodes, None))
        return out

    def attend(self, query, key, value, meta: StepMetadata, scale: float) -> torch.Tensor:
        """The attention of ``forward`` over a cache that already holds the step's K/V (a serving
        engine stores them in a step of its own); ``key``/``value`` are the step's raw K/V, which
        first prefill chunks attend to."""
        nd = meta.num_decodes
        if nd == meta.seq_lens.shape[0]:  # pure decode: capturable in a CUDA graph
            return self._decode(query, meta.block_table, meta.seq_lens, scale, meta.sequence_ids)
        starts, lens = meta.host_bounds()
        out = torch.zeros_like(query)  # rows past the last sequence (a padded batch): zeros, as decode_varlen
        # Short continuation chunks the packed cache serves in one decode_varlen launch, rows
        # gathered contiguously. The decodes get their own decode launch: decode_varlen picks its
        # kernel by the average chunk, and one-token rows riding along would send long chunks to
        # the kernel that is slower for them (H200: 604 vs 349 us for 64 tokens at L=32k).
        on_packed = []
        for b in range(nd, len(lens)):
            s, e = starts[b], starts[b + 1]
            q_len, cached_before = e - s, lens[b] - (e - s)
            if cached_before == 0:  # first chunk: raw K/V, causal
                out[s:e] = self._sdpa(query[s:e], key[s:e], value[s:e], scale)
            elif self.preset is not None and q_len <= self.varlen_threshold and not self.exact_tokens:
                on_packed.append(b)
            else:  # the cached prefix dequantized, then the chunk's own raw K/V
                # With a window, from the block of the first query's window start on: blocks wholly
                # before it are never attended, and a serving engine frees them (vLLM's sliding-window
                # layers), so they may hold another sequence's bytes or NaNs that a masked-out
                # weight of 0 would still turn into NaN.
                skip = max(0, cached_before - self.window_left) // self.block_size if self.window_left >= 0 else 0
                kept = cached_before - skip * self.block_size
                k, v = self._dense(meta.block_table[b:b + 1, skip:], meta.seq_lens[b:b + 1] - q_len - skip * self.block_size)
                k, v = k[0, :kept], v[0, :kept]
                shift = self._packed_shift(query[s:e], scale)
                packed = None if shift is None else torch.arange(kept + q_len, device=k.device) < kept
                for exact in self.exact_tokens:
                    raw = exact.overlay(k, v, int(meta.sequence_ids[b]), skip * self.block_size)
                    if packed is not None:
                        packed[raw] = False
                k = torch.cat([k.to(key.dtype), key[s:e]])
                v = torch.cat([v.to(value.dtype), value[s:e]])
                out[s:e] = self._sdpa(query[s:e], k, v, scale, shift, packed)
        if nd > 0:
            sequence = None if meta.sequence_ids is None else meta.sequence_ids[:nd]
            out[:nd] = self._decode(query[:nd], meta.block_table[:nd], meta.seq_lens[:nd], scale, sequence)
        if on_packed:
            rows = [r for b in on_packed for r in range(starts[b], starts[b + 1])]
            loc = [0]
            for b in on_packed:
                loc.append(loc[-1] + starts[b + 1] - starts[b])
            device = query.device
            rows_t = torch.tensor(rows, dtype=torch.long, device=device)
            seqs_t = torch.tensor(on_packed, dtype=torch.long, device=device)
            chunk_q = query.index_select(0, rows_t)
            out[rows_t] = decode_varlen(chunk_q, self.cache, meta.block_table.index_select(0, seqs_t).contiguous(),
                                        meta.seq_lens.index_select(0, seqs_t).contiguous(),
                                        torch.tensor(loc, dtype=torch.int32, device=device), self.preset, scale,
                                        **self._options, **self._transform_args)
        return out
