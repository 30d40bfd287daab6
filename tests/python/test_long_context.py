"""Long contexts and large caches: a 131k-token sequence against float64 attention, and a cache
larger than 2 GiB whose far blocks need 64-bit byte offsets (SPEC: int64 address math)."""

import torch

import turboquant as tq
from conftest import requires_cuda
from helpers import make_paged_batch
from reference import attention_reference, rel_err

PRESET = "turboquant_4bit_nc"
LONG = 131072 + 77  # past 128k, not a multiple of the block size


def _long_batch():
    return make_paged_batch([LONG], 128, 1, 64, PRESET, extra_blocks=0)


def test_131k_token_decode_matches_float64_attention():
    cache, bt, sl, _, _ = _long_batch()
    q = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(3))
    k, v = tq.dequantize(cache, bt, sl, PRESET, torch.float32)
    ref = attention_reference(q.double(), k.double(), v.double(), sl, 0.125)
    for splits in (1, 0):
        out = tq.decode(q, cache, bt, sl, PRESET, 0.125, splits)
        assert rel_err(out, ref) <= 1e-4, splits


@requires_cuda
def test_131k_token_decode_cuda_matches_cpu():
    cache, bt, sl, _, _ = _long_batch()
    q = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(3)).half().float()  # as the GPU gets it
    ref = tq.decode(q, cache, bt, sl, PRESET, 0.125)
    out = tq.decode(q.half().cuda(), cache.cuda(), bt.cuda(), sl.cuda(), PRESET, 0.125)
    assert rel_err(out.cpu().float(), ref) <= 2e-3


def _far_blocks_agree(device):
    """Tokens stored in the last blocks of a > 2 GiB cache decode and dequantize exactly like
    the same tokens in a small cache: byte offsets past 2^31 are computed in 64 bits."""
    head_dim, block, heads = 64, 128, 1
    slot = tq.slot_layout(PRESET, head_dim).slot_size_aligned
    num_blocks = (2**31 // (block * heads * slot)) + 8
    big = torch.empty(num_blocks, block, heads, slot, dtype=torch.uint8, device=device)  # pages stay untouched
    assert big.numel() > 2**31
    small = tq.allocate_kv_cache(2, block, heads, head_dim, PRESET, device)
    n = 200
    g = torch.Generator().manual_seed(5)
    key, value = torch.randn(n, heads, head_dim, generator=g), torch.randn(n, heads, head_dim, generator=g)
    far = torch.tensor([num_blocks - 1, num_blocks - 2], dtype=torch.int32)
    pos = torch.arange(n)
    far_slots = far[pos // block].long() * block + pos % block
    tq.store_kv(key.to(device), value.to(device), big, far_slots.to(device), PRESET)
    tq.store_kv(key.to(device), value.to(device), small, pos.to(device), PRESET)
    sl = torch.tensor([n], dtype=torch.int32, device=device)
    q = torch.randn(1, 4, head_dim, generator=g).to(device, torch.float32 if device == "cpu" else torch.float16)
    near_bt = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    far_bt = far.view(1, 2).to(device)
    assert torch.equal(tq.decode(q, big, far_bt, sl, PRESET, 0.125), tq.decode(q, small, near_bt, sl, PRESET, 0.125))
    kb, vb = tq.dequantize(big, far_bt, sl, PRESET, torch.float32)
    ks, vs = tq.dequantize(small, near_bt, sl, PRESET, torch.float32)
    assert torch.equal(kb, ks) and torch.equal(vb, vs)


def test_cache_past_2gib_uses_64bit_offsets():
    _far_blocks_agree("cpu")


@requires_cuda
def test_cache_past_2gib_uses_64bit_offsets_cuda():
    _far_blocks_agree("cuda")
