"""store_kv on CPU against the independent plain-torch reference, and key quality (SPEC §6)."""

import pytest
import torch

import turboquant as tq
from helpers import compare_slot, slot_bytes
from reference import hadamard_matrix, unpack_bits

PRESETS = list(tq.PRESETS)
HEAD_DIMS = [64, 80, 96, 112, 128, 160, 192, 256]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_major", [False, True])
def test_store_matches_reference_and_touches_nothing_else(preset, head_dim, dtype, head_major):
    torch.manual_seed(head_dim + len(preset))
    num_tokens, heads, block_size, num_blocks = 12, 2, 16, 4
    cache = tq.allocate_kv_cache(num_blocks, block_size, heads, head_dim, preset, head_major=head_major)
    cache.copy_(torch.randint(0, 256, cache.shape, dtype=torch.uint8))  # poison
    before = cache.clone()
    key = (torch.randn(num_tokens, heads, head_dim) * 3).to(dtype)
    value = torch.randn(num_tokens, heads, head_dim).to(dtype)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[3] = -1  # padding
    slots[7] = -5
    tq.store_kv(key, value, cache, slots.to(torch.int32), preset)
    written = set()
    flips = total = 0
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        written.add(s)
        for h in range(heads):
            f, n = compare_slot(slot_bytes(cache, s, h), key[i, h], value[i, h], preset)
            flips, total = flips + f, total + n
    assert flips <= max(1, total // 1000)
    for s in range(num_blocks * block_size):
        if s not in written:
            assert torch.equal(cache[s // block_size, s % block_size], before[s // block_size, s % block_size]), s


def test_store_skips_out_of_range_slots_and_int64_mapping():
    cache = tq.allocate_kv_cache(2, 16, 1, 64, "turboquant_4bit_nc")
    cache.fill_(0xAB)
    key = torch.randn(3, 1, 64)
    slots = torch.tensor([5, 32, 10_000], dtype=torch.int64)  # 32 slots exist
    tq.store_kv(key, key, cache, slots, "turboquant_4bit_nc")
    assert not torch.equal(cache[0, 5], torch.full_like(cache[0, 5], 0xAB))
    others = torch.ones(2, 16, dtype=torch.bool)
    others[0, 5] = False
    assert (cache[others] == 0xAB).all()


@pytest.mark.parametrize("preset,expected", [("turboquant_3bit_nc", 0.0340), ("turboquant_4bit_nc", 0.00931)])
def test_key_direction_error_on_unit_vectors(preset, expected):
    """E||x - c~(x)||^2 without norm correction on 10k random unit vectors, D=128 (SPEC §6)."""
    d, n = 128, 10_000
    torch.manual_seed(0)
    x = torch.randn(n, 1, d, dtype=torch.float64)
    x = x / x.norm(dim=-1, keepdim=True)
    cache = tq.allocate_kv_cache(n // 16, 16, 1, d, preset)
    tq.store_kv(x.float(), x.float(), cache, torch.arange(n, dtype=torch.int32), preset)
    info, layout = tq.preset_info(preset), tq.slot_layout(preset, d)
    centroids, _ = tq.codebook(info.key_bits, d)
    raw = cache.view(n, -1)[:, :layout.key_data_bytes]
    # Unpack every index at once: little-endian bit stream.
    bits = ((raw[:, :, None].to(torch.int64) >> torch.arange(8)) & 1).reshape(n, -1)
    weights = 1 << torch.arange(info.key_bits)
    idx = (bits[:, :d * info.key_bits].reshape(n, d, info.key_bits) * weights).sum(-1)
    assert idx[0].tolist() == unpack_bits(bytes(raw[0].tolist()), d, info.key_bits)
    c = centroids.double()[idx]
    y = x[:, 0] @ hadamard_matrix(d)  # R symmetric: rows are R x
    err = ((y - c) ** 2).sum(-1).mean().item()
    # 1 %: 10k samples leave ~0.2 % noise (seeds 0-3: within 0.4 %); at 3 % the test could not
    # tell SPEC's 0.0340 from the 0.0345 of Gaussian inputs (SPEC §6).
    assert abs(err - expected) / expected < 0.01, err


@pytest.mark.parametrize("preset", PRESETS)
def test_signed_zero_values_store_a_positive_zero(preset):
    """Value vectors of zeros of either sign: scale 0, every code 0 and zero = +0 (0x0000) whatever
    the signs, so the bytes do not depend on the order a min reduction meets +0 and -0."""
    d = 64 if preset != "turboquant_k8v4" else 96
    layout = tq.slot_layout(preset, d)
    mixed = torch.zeros(d)
    mixed[::3] = -0.0
    values = torch.stack([torch.full((d,), -0.0), mixed, torch.zeros(d)])[:, None]
    keys = torch.randn(3, 1, d)
    cache = tq.allocate_kv_cache(1, 16, 1, d, preset)
    tq.store_kv(keys, values, cache, torch.arange(3, dtype=torch.int32), preset)
    for i in range(3):
        slot = slot_bytes(cache, i, 0)
        compare_slot(slot, keys[i, 0], values[i, 0], preset)
        assert slot[layout.value_data_offset:layout.slot_size] == bytes(layout.slot_size - layout.value_data_offset), i
    k, v = tq.dequantize(cache, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32), preset)
    assert (v == 0).all() and not torch.signbit(v).any()
