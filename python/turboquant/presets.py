"""Presets and the byte layout of one packed slot (SPEC §2), from the C++ core."""

from __future__ import annotations

from dataclasses import dataclass

from ._library import _core

PRESETS: tuple[str, ...] = tuple(_core.preset_names())


@dataclass(frozen=True)
class PresetInfo:
    name: str
    key_format: str  # "fp8_e4m3" or "lloyd_max"
    key_bits: int
    value_bits: int
    norm_correction: bool


@dataclass(frozen=True)
class SlotLayout:
    """Byte offsets of the fields of one slot; ``slot_size_aligned`` is the cache's last dim."""

    head_dim: int
    key_format: str
    key_bits: int
    value_bits: int
    key_data_bytes: int
    key_norm_offset: int  # -1 when keys are FP8 (no norm)
    key_packed_size: int
    value_data_offset: int
    value_data_bytes: int
    value_scale_offset: int
    value_zero_offset: int
    value_packed_size: int
    slot_size: int
    slot_size_aligned: int

    @property
    def bytes_per_element(self) -> float:
        """Average bytes per K or V element (fp16 K+V would be 2.0)."""
        return self.slot_size_aligned / (2 * self.head_dim)


def preset_info(preset: str) -> PresetInfo:
    """Describes a preset; raises ValueError listing the valid names for an unknown one."""
    return PresetInfo(**_core.preset_info(preset))


def slot_layout(preset: str, head_dim: int) -> SlotLayout:
    """Slot layout of ``preset`` at ``head_dim``; raises ValueError when unsupported."""
    return SlotLayout(**_core.slot_layout(preset, int(head_dim)))
