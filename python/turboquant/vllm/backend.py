"""vLLM's TurboQuant attention backend, run on turboquant's ops.

vLLM allocates each layer's packed cache (one slot per token and KV head, the presets' bytes) and
hands the backend a logical ``[num_blocks, Hkv, block_size, slot]`` view of it every step, in the
layout the model's backends agreed on (``supported_kv_cache_layouts``): head-major next to vLLM's
CPU attention, token-major next to FlashAttention. The ops take either as ``[num_blocks,
block_size, Hkv, slot]`` with its strides, so the view is only transposed, never copied.

A step runs as vLLM orders its batch (decodes first, ``reorder_batch_threshold = 1``):
``do_kv_cache_update`` stores the step's K/V (``store_kv``; padding slots, -1, are skipped), then
``forward`` attends through ``turboquant.attention.PagedAttentionLayer.attend``: one ``decode`` for
the decode rows, SDPA on the raw K/V for first prefill chunks, ``decode_varlen`` or
dequantize + SDPA for continuation chunks (chunked prefill, prefix-cache hits). A pure-decode step
makes no host synchronisation (vLLM captures it in a CUDA graph); steps with prefill chunks read
their chunk bounds from the host copies vLLM's metadata carries.

Sliding windows (``window_left = sliding_window - 1``), soft-capping and attention sinks go to the
ops' attention options, so models with them (Gemma 2/3, Mistral, gpt-oss) keep their packed layers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl, AttentionMetadata,
                                       AttentionMetadataBuilder, AttentionType, CommonAttentionMetadata)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_layout import KVCacheLayout

from ..attention import PagedAttentionLayer, StepMetadata
from ..ops import store_kv
from ..presets import PRESETS, slot_layout
from . import check_vllm_version

BLOCK_SIZES = [16, 32, 64, 128]  # the ops' block sizes (turboquant.SUPPORTED_BLOCK_SIZES)


def _is_preset(kv_cache_dtype) -> bool:
    return kv_cache_dtype in PRESETS


def _slot_error(preset: str, head_size: int) -> str | None:
    """Why ``preset`` cannot pack heads of ``head_size`` (the library's message), or None."""
    try:
        slot_layout(preset, head_size)
        return None
    except ValueError as exc:
        return f"head_size not supported: {exc}"


class TurboQuantBackend(AttentionBackend):
    """Replaces vLLM's ``TURBOQUANT`` backend (``turboquant.vllm.register``)."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False  # vLLM calls do_kv_cache_update first
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(PRESETS)

    @staticmethod
    def get_name() -> str:
        return "TURBOQUANT"

    @staticmethod
    def get_impl_cls() -> type["TurboQuantImpl"]:
        return TurboQuantImpl

    @staticmethod
    def get_builder_cls() -> type["TurboQuantMetadataBuilder"]:
        return TurboQuantMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return list(BLOCK_SIZES)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Token-major first (a slot's heads side by side, what the store writes in one pass);
        # head-major too, which vLLM's CPU attention needs for the boundary layers.
        return (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC)

    @classmethod
    def customize_spec(cls, spec):
        """One packed slot per token and KV head: the preset's aligned slot size."""
        if spec.state_content_bytes is not None or not spec.kv_quant_mode.is_turboquant:
            return spec
        preset = spec.kv_quant_mode.name.lower()  # vLLM's KVQuantMode names are the preset names
        return replace(spec, state_content_bytes=slot_layout(preset, spec.head_size).slot_size_aligned)

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return _is_preset(kv_cache_dtype)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        """Whether some preset takes ``head_size`` (k8v4 takes any multiple of 8; the rotated
        presets fewer): ``validate_configuration`` checks the layer's own preset."""
        return any(_slot_error(p, head_size) is None for p in PRESETS)

    @classmethod
    def validate_configuration(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype, *args, **kwargs) -> list[str]:
        reasons = super().validate_configuration(head_size, dtype, kv_cache_dtype, *args, **kwargs)
        error = _slot_error(kv_cache_dtype, head_size) if _is_preset(kv_cache_dtype) else None
        return reasons + ([error] if error and "head_size not supported" not in reasons else [])

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return False  # prefill chunks are planned from the host's query bounds


@dataclass
class TurboQuantMetadata(AttentionMetadata):
    step: StepMetadata
    num_actual_tokens: int


class TurboQuantMetadataBuilder(AttentionMetadataBuilder[TurboQuantMetadata]):
    # Pure single-token decode steps only: they make no host synchronisation and their shapes fix
    # the ops' grids (the split count depends on shapes only).
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=False)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TurboQuantMetadata:
        m = common_attn_metadata
        num_decodes, num_prefills, _, _ = split_decodes_and_prefills(m, decode_threshold=self.reorder_batch_threshold)
        starts = lens = None
        if num_prefills:  # host bounds for the chunks (vLLM's host seq_lens are exact on prefill rows)
            starts = m.query_start_loc_cpu.tolist()
            lens = m.seq_lens_cpu_upper_bound.tolist() if m.seq_lens_cpu_upper_bound is not None else None
        step = StepMetadata(m.query_start_loc, m.seq_lens, m.block_table_tensor, m.slot_mapping, num_decodes,
                            query_start_loc_host=starts, seq_lens_host=lens)
        return TurboQuantMetadata(step=step, num_actual_tokens=m.num_actual_tokens)


class TurboQuantImpl(AttentionImpl[TurboQuantMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None, **kwargs):
        if not _is_preset(kv_cache_dtype):
            raise ValueError(f"turboquant: the TURBOQUANT backend serves kv_cache_dtype in {list(PRESETS)}, "
                             f"got {kv_cache_dtype!r}")
        if alibi_slopes is not None:
            raise NotImplementedError("turboquant: ALiBi slopes are not supported by the TURBOQUANT backend")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"turboquant: the TURBOQUANT backend serves decoder attention, got {attn_type}")
        check_vllm_version()
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        self.kv_cache_dtype = self.preset = kv_cache_dtype
        self.window_left = sliding_window - 1 if sliding_window else -1
        self.softcap = float(logits_soft_cap or 0.0)
        self.sinks = sinks  # the model's parameter, loaded after this: read at the first forward
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        model_config = get_current_vllm_config().model_config
        self._dtype = model_config.dtype if model_config is not None else torch.bfloat16
        self._layer: PagedAttentionLayer | None = None

    def _attention_over(self, kv_cache: torch.Tensor) -> PagedAttentionLayer:
        """The attention layer over this step's cache view ([num_blocks, block_size, Hkv, slot])."""
        cache = kv_cache.transpose(1, 2)
        if self._layer is None:
            self._layer = PagedAttentionLayer.over_cache(cache, self.preset, self._dtype, window_left=self.window_left,
                                                         softcap=self.softcap, sinks=self.sinks)
        self._layer.cache = cache
        return self._layer

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        n = slot_mapping.shape[0]
        if n == 0:
            return
        # vLLM's K and V are column slices of the fused QKV projection; the store reads rows whole.
        shape = (n, self.num_kv_heads, self.head_size)
        store_kv(key[:n].reshape(shape).contiguous(), value[:n].reshape(shape).contiguous(), kv_cache.transpose(1, 2),
                 slot_mapping, self.preset)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: TurboQuantMetadata | None, output: torch.Tensor | None = None,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("turboquant: fused output quantization is not supported by the TURBOQUANT backend")
        if output is None:
            output = torch.zeros(query.shape[0], self.num_heads * self.head_size, dtype=query.dtype, device=query.device)
        if attn_metadata is None:  # vLLM's profiling run
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        q = query[:n].reshape(n, self.num_heads, self.head_size).contiguous()
        k = key[:n].reshape(n, self.num_kv_heads, self.head_size)
        v = value[:n].reshape(n, self.num_kv_heads, self.head_size)
        out = self._attention_over(kv_cache).attend(q, k, v, attn_metadata.step, self.scale)
        output[:n] = out.reshape(n, -1).to(output.dtype) if output.dim() == 2 else out.to(output.dtype)
        return output
