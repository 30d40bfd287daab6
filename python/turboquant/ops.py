"""Typed wrappers over ``torch.ops.turboquant.*`` and their fake (meta) implementations.

The C++ ops validate every argument with messages naming it; these wrappers add docstrings and
defaults and keep the call sites readable.
"""

from __future__ import annotations

import torch

from ._library import _core  # also loads the op library
from .presets import PRESETS, slot_layout


def head_dim_for_slot(preset: str, slot_bytes: int) -> int:
    """Recovers head_dim from a cache's last dimension (the aligned slot size)."""
    for head_dim in range(8, _core.max_head_dim + 1, 8):
        try:
            if slot_layout(preset, head_dim).slot_size_aligned == slot_bytes:
                return head_dim
        except ValueError:
            continue
    raise ValueError(f"turboquant: kv_cache slot size {slot_bytes} bytes matches no head_dim for preset {preset}")


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             preset: str, *, key_offset: torch.Tensor | None = None, key_scale: torch.Tensor | None = None,
             value_offset: torch.Tensor | None = None) -> None:
    """Quantizes ``key``/``value`` ``[N, Hkv, D]`` (fp16/bf16/fp32) into ``kv_cache`` in place.

    ``kv_cache``: uint8 ``[num_blocks, block_size, Hkv, slot_size_aligned]`` (any strides for the
    first three dims, e.g. a head-major tensor viewed in this order). ``slot_mapping [N]`` int32 or
    int64: token ``i`` goes to block ``s // block_size``, offset ``s % block_size``; ``s < 0``
    (padding) and ``s`` beyond the cache are skipped. With the per-head transforms (``decode``'s docstring) it stores
    ``(key - key_offset) / key_scale`` and ``value - value_offset``.
    """
    torch.ops.turboquant.store_kv(key, value, kv_cache, slot_mapping, preset, key_offset, key_scale, value_offset)


_TRANSFORMS_DOC = """
    Per-head transforms (``turboquant.calibration``; the same three tensors for every op on a
    cache, each fp32 ``[Hkv, D]`` or ``None``): the cache holds each KV head's keys as
    ``(k - key_offset) / key_scale`` and its values as ``v - value_offset``, and the ops work in
    the original basis. ``store_kv`` applies them; a decode multiplies each query by its KV head's
    ``key_scale``, adds ``value_offset`` to every row with ``seq_len > 0`` (its weights sum to 1)
    and returns the log-sum-exp of the original scores (``key_offset`` only moves every score of a
    row by ``scale * q . key_offset``); ``dequantize`` returns ``k~ * key_scale + key_offset`` and
    ``v~ + value_offset`` within each length. Exact, and no more bytes read from the cache: the CUDA
    kernels apply them as they read K/V and the query and write the output; the CPU ops run
    elementwise passes around their reference code.
    ``key_offset`` with ``softcap`` or ``sinks``, and ``value_offset`` with ``sinks``, are refused
    (the cap and the sink do not move with the scores). ``key_scale`` must be positive and finite
    (not checked: that would read it back from the device).
"""

_OPTIONS_DOC = """
    Attention options (any combination; the defaults are plain causal attention):

    * ``window_left``: a query at position ``p`` attends to positions ``[p - window_left, p]``
      (FlashAttention's ``window_size[0]``); ``-1`` for no window. A transformers model's
      ``sliding_window`` ``W`` is ``window_left = W - 1``. A windowed decode reads only the
      window's blocks.
    * ``softcap``: logits ``s`` become ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2);
      ``0`` for none.
    * ``sinks``: fp32 ``[Hq]``, one logit per query head that joins every softmax's denominator
      and carries no value (gpt-oss); ``None`` for none.
"""


def decode(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
           preset: str, scale: float, num_splits: int = 0, *, window_left: int = -1, softcap: float = 0.0,
           sinks: torch.Tensor | None = None, return_lse: bool = False, key_offset: torch.Tensor | None = None,
           key_scale: torch.Tensor | None = None, value_offset: torch.Tensor | None = None):
    """One decode step of attention over the packed cache.

    ``query [B, Hq, D]``; ``block_table [B, max_blocks] int32``; ``seq_lens [B] int32``. Query head
    ``h`` reads KV head ``h // (Hq / Hkv)``. Returns ``[B, Hq, D]`` in the query's dtype;
    ``softmax(scale * q k~^T) v~`` over positions ``[0, seq_len)``; zeros where ``seq_len == 0``.
    ``num_splits=0`` lets the library choose a split-KV count from the shapes only.

    ``return_lse=True`` returns ``(out, lse)``: ``lse [B, Hq]`` fp32 is the natural log of the
    softmax's denominator (the sink included; ``-inf`` where nothing is attended), the weight that
    merges this attention with one over other keys (``turboquant::decode_lse``; on CUDA it takes the
    per-head kernel with at least 3 splits, or the generic one with 2, whose splits report theirs).
    """
    args = (query, kv_cache, block_table, seq_lens, preset, float(scale), int(num_splits), int(window_left),
            float(softcap), sinks, key_offset, key_scale, value_offset)
    return torch.ops.turboquant.decode_lse(*args) if return_lse else torch.ops.turboquant.decode(*args)


def decode_varlen(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, preset: str, scale: float, num_splits: int = 0, *,
                  window_left: int = -1, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                  key_offset: torch.Tensor | None = None, key_scale: torch.Tensor | None = None,
                  value_offset: torch.Tensor | None = None) -> torch.Tensor:
    """Several query tokens per sequence over the packed cache (continuation chunks, speculative
    verification, multi-turn follow-ups).

    ``query [total_q, Hq, D]``; ``query_start_loc [B+1]`` int32 cumulative starts; ``seq_lens [B]``
    count the cached tokens including the chunk's own (store the chunk first). Query token ``i`` of
    sequence ``b`` attends causally to positions ``< seq_len_b - q_len_b + 1 + i``.

    One launch on CUDA: the decode kernel with its 8 query columns filled by (token, head) pairs
    of one sequence (``8 // group`` tokens per CTA for GQA groups up to 8), so each key tile it
    reads serves several query tokens; the grid depends only on shapes (graph-capturable, no host
    sync). Rows outside every ``[query_start_loc[b], query_start_loc[b+1])`` are zeros. The CPU
    implementation runs each row as a decode row with its own causal length. A window counts back
    from each query token's own position.
    """
    return torch.ops.turboquant.decode_varlen(query, kv_cache, block_table, seq_lens, query_start_loc, preset,
                                              float(scale), int(num_splits), int(window_left), float(softcap), sinks,
                                              key_offset, key_scale, value_offset)


if decode.__doc__ is not None:  # None under python -OO
    decode.__doc__ += _OPTIONS_DOC + _TRANSFORMS_DOC
    decode_varlen.__doc__ += _OPTIONS_DOC + _TRANSFORMS_DOC


def dequantize(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, preset: str,
               dtype: torch.dtype = torch.bfloat16, *, key_offset: torch.Tensor | None = None,
               key_scale: torch.Tensor | None = None,
               value_offset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decodes the cache back to dense keys and values ``[B, max(seq_lens), Hkv, D]`` in ``dtype``,
    in the original (un-rotated, un-transformed) basis, zeros past each sequence's length."""
    return torch.ops.turboquant.dequantize(kv_cache, block_table, seq_lens, preset, dtype, key_offset, key_scale,
                                           value_offset)


def dequantize_into(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, preset: str,
                    key_out: torch.Tensor, value_out: torch.Tensor, *, key_offset: torch.Tensor | None = None,
                    key_scale: torch.Tensor | None = None, value_offset: torch.Tensor | None = None) -> None:
    """``dequantize`` into caller-provided ``[B, L, Hkv, D]`` buffers (reserve them once): zeros
    past each sequence's length, positions ``>= L`` not written. No host sync on CUDA."""
    torch.ops.turboquant.dequantize_into(kv_cache, block_table, seq_lens, preset, key_out, value_out, key_offset,
                                         key_scale, value_offset)


# ---- fake implementations, so the ops trace under torch.compile / FakeTensor ------------------
@torch.library.register_fake("turboquant::store_kv")
def _store_kv_fake(key, value, kv_cache, slot_mapping, preset, key_offset=None, key_scale=None, value_offset=None):
    return None


@torch.library.register_fake("turboquant::dequantize_into")
def _dequantize_into_fake(kv_cache, block_table, seq_lens, preset, key_out, value_out, key_offset=None,
                          key_scale=None, value_offset=None):
    return None


@torch.library.register_fake("turboquant::decode")
def _decode_fake(query, kv_cache, block_table, seq_lens, preset, scale, num_splits=0, window_left=-1, softcap=0.0,
                 sinks=None, key_offset=None, key_scale=None, value_offset=None):
    return torch.empty_like(query)


@torch.library.register_fake("turboquant::decode_lse")
def _decode_lse_fake(query, kv_cache, block_table, seq_lens, preset, scale, num_splits=0, window_left=-1, softcap=0.0,
                     sinks=None, key_offset=None, key_scale=None, value_offset=None):
    return torch.empty_like(query), query.new_empty(query.shape[:2], dtype=torch.float32)


@torch.library.register_fake("turboquant::decode_varlen")
def _decode_varlen_fake(query, kv_cache, block_table, seq_lens, query_start_loc, preset, scale, num_splits=0,
                        window_left=-1, softcap=0.0, sinks=None, key_offset=None, key_scale=None, value_offset=None):
    return torch.empty_like(query)


@torch.library.register_fake("turboquant::dequantize")
def _dequantize_fake(kv_cache, block_table, seq_lens, preset, dtype, key_offset=None, key_scale=None,
                     value_offset=None):
    head_dim = head_dim_for_slot(preset, kv_cache.shape[3])
    max_len = torch.library.get_ctx().new_dynamic_size()
    shape = (block_table.shape[0], max_len, kv_cache.shape[2], head_dim)
    return (kv_cache.new_empty(shape, dtype=dtype), kv_cache.new_empty(shape, dtype=dtype))


__all__ = ["PRESETS", "store_kv", "decode", "decode_varlen", "dequantize", "dequantize_into", "head_dim_for_slot"]
