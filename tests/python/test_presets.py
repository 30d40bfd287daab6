"""Preset/layout API, cache helpers and codebooks as Python sees them."""

import pytest
import torch

import turboquant as tq
from reference import hadamard_matrix

SLOT_SIZES = {
    "turboquant_k8v4": {64: 100, 128: 196, 256: 388},
    "turboquant_4bit_nc": {64: 70, 128: 134, 256: 262},
    "turboquant_k3v4_nc": {64: 62, 128: 118, 256: 230},
    "turboquant_3bit_nc": {64: 54, 128: 102, 256: 198},
}


@pytest.mark.parametrize("preset", list(SLOT_SIZES))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_slot_sizes(preset, head_dim):
    assert tq.slot_layout(preset, head_dim).slot_size_aligned == SLOT_SIZES[preset][head_dim]


def test_k8v4_accepts_d96_and_rotated_presets_refuse_it():
    assert tq.slot_layout("turboquant_k8v4", 96).slot_size_aligned == 148
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        tq.slot_layout("turboquant_4bit_nc", 96)
    with pytest.raises(ValueError, match="multiple of 8"):
        tq.slot_layout("turboquant_k8v4", 100)


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError) as e:
        tq.preset_info("fp8")
    for name in tq.PRESETS:
        assert name in str(e.value)


def test_boundary_skip_layers():
    assert tq.boundary_skip_layers(32) == [0, 1, 30, 31]
    assert tq.boundary_skip_layers(36, n=3) == [0, 1, 2, 33, 34, 35]
    assert tq.boundary_skip_layers(4) == [0, 3]  # capped at half of the layers
    assert tq.boundary_skip_layers(6) == [0, 1, 5]
    assert tq.boundary_skip_layers(1) == []
    assert tq.boundary_skip_layers(8, n=0) == []
    for layers in range(0, 40):
        assert len(tq.boundary_skip_layers(layers)) <= layers // 2


def test_allocate_head_major_is_a_strided_view():
    c = tq.allocate_kv_cache(4, 16, 8, 128, "turboquant_4bit_nc", head_major=True)
    assert c.shape == (4, 16, 8, 134)
    assert c.stride() == (8 * 16 * 134, 134, 16 * 134, 1)
    with pytest.raises(ValueError, match="block_size"):
        tq.allocate_kv_cache(4, 24, 8, 128, "turboquant_4bit_nc")
    assert tq.kv_cache_bytes(4, 16, 8, 128, "turboquant_4bit_nc") == c.numel()


def test_codebook_is_symmetric_gaussian_levels_over_sqrt_d():
    c, m = tq.codebook(4, 128)
    levels = torch.tensor(tq.lloyd_max_gaussian(4)["levels"], dtype=torch.float64)
    torch.testing.assert_close(c.double(), levels / 128 ** 0.5, rtol=1e-6, atol=0)
    torch.testing.assert_close(c, -c.flip(0))
    torch.testing.assert_close(m, (c[1:] + c[:-1]) / 2)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_hadamard_is_the_sylvester_matrix(d):
    """The exposed rotation is SPEC's: the Sylvester (natural-order) Hadamard matrix / sqrt(D),
    against the popcount formula of the independent reference; orthonormal and symmetric."""
    h = tq.hadamard(d).double()
    torch.testing.assert_close(h, hadamard_matrix(d), atol=1e-7, rtol=0)
    torch.testing.assert_close(h @ h.T, torch.eye(d, dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(h, h.T)
