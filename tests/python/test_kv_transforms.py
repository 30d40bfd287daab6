"""The ops' per-head transforms (key_offset, key_scale, value_offset; csrc/kv_transform.h): a cache
holding (k - mu) / s and v - nu, and every op working in the original basis. Against the ops on
tensors transformed by hand (the same bytes) and float64 attention over the restored K/V."""

import pytest
import torch

import turboquant as tq
from conftest import requires_cuda
from reference import attention_options_reference, log_sum_exp_reference, rel_err

BS, HKV, GROUP, D = 16, 2, 3, 64
HQ = HKV * GROUP
LENS = [0, 1, 37, 70]
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


def _vectors(device, seed=1, hkv=HKV, head_dim=D):
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(hkv, head_dim, generator=g) * 3
    s = torch.exp(torch.randn(hkv, head_dim, generator=g) * 0.4)
    nu = torch.randn(hkv, head_dim, generator=g)
    return {"key_offset": mu.to(device), "key_scale": s.to(device), "value_offset": nu.to(device)}


def _batch(preset, device, transforms, dtype=torch.float32, lens=LENS, hkv=HKV, head_dim=D):
    """A cache of `lens` stored with `transforms`, and the raw K/V [B, L, Hkv, D] it came from."""
    g = torch.Generator().manual_seed(0)
    blocks = [max(1, -(-n // BS)) for n in lens]
    cache = tq.allocate_kv_cache(sum(blocks) + 2, BS, hkv, head_dim, preset, device)
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    keys, values = (torch.zeros(len(lens), max(lens), hkv, head_dim) for _ in range(2))
    first = 1  # block 0 left unused
    for b, n in enumerate(lens):
        table[b, :blocks[b]] = torch.arange(first, first + blocks[b])
        k = torch.randn(n, hkv, head_dim, generator=g) * 2 + torch.randn(hkv, head_dim, generator=g) * 4  # a per-head offset
        v = torch.randn(n, hkv, head_dim, generator=g)
        keys[b, :n], values[b, :n] = k, v
        slots = (table[b, torch.arange(n) // BS].long() * BS + torch.arange(n) % BS)
        tq.store_kv(k.to(device, dtype), v.to(device, dtype), cache, slots.to(device), preset, **transforms)
        first += blocks[b]
    return cache, table.to(device), torch.tensor(lens, dtype=torch.int32, device=device), keys, values


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_k8v4"])
@pytest.mark.parametrize("names", [("key_offset", "key_scale", "value_offset"), ("key_scale",), ("value_offset",)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [D, 96])  # on CUDA: the tiled store and the generic one
@pytest.mark.parametrize("device", DEVICES)
def test_store_writes_the_bytes_of_the_transformed_tensors_and_leaves_the_inputs(preset, names, dtype, head_dim,
                                                                                device):
    """The same bytes as the store of (k - mu) / s and v - nu computed in float32 beforehand: the
    CUDA store transforms what it reads, in any input dtype."""
    t = {name: x for name, x in _vectors(device, head_dim=head_dim).items() if name in names}
    g = torch.Generator().manual_seed(4)
    k, v = (torch.randn(40, HKV, head_dim, generator=g).to(device, dtype) for _ in range(2))
    k_in, v_in = k.clone(), v.clone()
    slots = torch.randperm(64, generator=g)[:40].to(device)
    ours, by_hand = (tq.allocate_kv_cache(4, BS, HKV, head_dim, preset, device) for _ in range(2))
    tq.store_kv(k, v, ours, slots, preset, **t)
    assert torch.equal(k, k_in) and torch.equal(v, v_in)  # the inputs are not transformed in place
    mu, s, nu = (t.get(name, 0.0) for name in ("key_offset", "key_scale", "value_offset"))
    tq.store_kv((k.float() - mu) / (s if torch.is_tensor(s) else 1.0), v.float() - nu, by_hand, slots, preset)
    assert torch.equal(ours, by_hand)


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
@pytest.mark.parametrize("device", DEVICES)
def test_dequantize_returns_the_original_basis_within_each_length(preset, device):
    t = _vectors(device)
    cache, table, lens, _, _ = _batch(preset, device, t)
    stored_k, stored_v = tq.dequantize(cache, table, lens, preset, torch.float32)
    k, v = tq.dequantize(cache, table, lens, preset, torch.float32, **t)
    within = (torch.arange(max(LENS), device=device)[None, :] < lens[:, None].long())[..., None, None]
    torch.testing.assert_close(k, torch.where(within, stored_k * t["key_scale"] + t["key_offset"], 0.0))
    torch.testing.assert_close(v, torch.where(within, stored_v + t["value_offset"], 0.0))
    k_out, v_out = torch.full_like(k, 7.0), torch.full_like(v, 7.0)
    tq.dequantize_into(cache, table, lens, preset, k_out, v_out, **t)
    assert torch.equal(k_out, k) and torch.equal(v_out, v)


def _restored(cache, table, lens, preset, t):
    k, v = tq.dequantize(cache, table, lens, preset, torch.float32, **t)
    return k.cpu().double(), v.cpu().double()


OPTIONS = {
    "plain": ({}, ("key_offset", "key_scale", "value_offset")),
    "window": ({"window_left": 9}, ("key_offset", "key_scale", "value_offset")),
    "softcap": ({"softcap": 2.0}, ("key_scale", "value_offset")),  # no key_offset with a cap
    "sinks": ({"sinks": torch.randn(HQ, generator=torch.Generator().manual_seed(3))}, ("key_scale",)),
}


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_k8v4"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("device", DEVICES)
def test_decode_decode_lse_and_varlen_attend_in_the_original_basis(preset, option, device):
    """float64 attention of the original queries over the restored K/V: what the cache means."""
    options, names = OPTIONS[option]
    t = {name: x for name, x in _vectors(device).items() if name in names}
    cache, table, lens, _, _ = _batch(preset, device, t)
    keys, values = _restored(cache, table, lens, preset, t)
    on_device = {k: (x.to(device) if torch.is_tensor(x) else x) for k, x in options.items()}
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    tol = 1e-5 if device == "cpu" else 2e-2
    scale = 0.3 if option == "softcap" else D ** -0.5
    q = torch.randn(len(LENS), HQ, D, generator=torch.Generator().manual_seed(6)).to(dtype)
    ref = attention_options_reference(q.double(), keys, values, LENS, [1] * len(LENS), scale, **options)
    ref_lse = log_sum_exp_reference(q.double(), keys, LENS, [1] * len(LENS), scale, **options)
    for num_splits in (0, 1, 3):
        out, lse = tq.decode(q.to(device), cache, table, lens, preset, scale, num_splits, return_lse=True,
                             **on_device, **t)
        assert rel_err(out.float().cpu(), ref) <= tol, num_splits
        assert (out[0] == 0).all()  # an empty sequence: no value_offset either
        seen = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse.cpu()), seen)
        torch.testing.assert_close(lse.cpu().double()[seen], ref_lse[seen], rtol=0, atol=50 * tol)
        plain = tq.decode(q.to(device), cache, table, lens, preset, scale, num_splits, **on_device, **t)
        if device == "cpu" or num_splits >= 3:  # the same kernel and splits: the same output
            torch.testing.assert_close(plain, out, rtol=0, atol=0)
        else:  # on CUDA the log-sum-exp takes 3 splits or more, so the sums differ in rounding
            assert rel_err(plain.float().cpu(), ref) <= tol, num_splits
    q_lens = [0, 1, 5, 12]
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    qv = torch.randn(sum(q_lens) + 2, HQ, D, generator=torch.Generator().manual_seed(7)).to(dtype)  # 2 rows past all
    ref = attention_options_reference(qv[:-2].double(), keys, values, LENS, q_lens, scale, **options)
    out = tq.decode_varlen(qv.to(device), cache, table, lens, starts.to(device), preset, scale, **on_device, **t)
    assert rel_err(out[:-2].float().cpu(), ref) <= tol
    assert (out[-2:] == 0).all()  # rows outside every sequence: zeros, no value_offset


@pytest.mark.parametrize("device", DEVICES)
def test_store_takes_vectors_at_any_offset(device):
    """Views of a larger tensor at a 4-byte offset (the CUDA store reads the vectors in 16-byte
    loads, and copies such views first): the bytes of the same vectors allocated alone."""
    t = _vectors(device)
    shifted = {}
    for name, x in t.items():
        storage = torch.zeros(x.numel() + 1, device=device)
        storage[1:] = x.flatten()
        shifted[name] = storage[1:].view(HKV, D)
    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn(40, HKV, D, generator=g).to(device, torch.bfloat16) for _ in range(2))
    slots = torch.randperm(64, generator=g)[:40].to(device)
    ours, aligned = (tq.allocate_kv_cache(4, BS, HKV, D, "turboquant_4bit_nc", device) for _ in range(2))
    tq.store_kv(k, v, ours, slots, "turboquant_4bit_nc", **shifted)
    tq.store_kv(k, v, aligned, slots, "turboquant_4bit_nc", **t)
    assert torch.equal(ours, aligned)


# (preset, head_dim, KV heads, GQA group, varlen query lengths or None for a decode): each CUDA
# kernel applies the transforms itself (kernels/launchers.h). "heads": the per-head kernel, its
# splits written directly (1), merged in a cluster (2, on sm_90) or by the merge kernel (5);
# "chunked": varlen chunks with total_q * group >= 32 * batch, the chunked kernel's shape
# (decode_plan.cu), and the per-head kernel's for the short chunks; "generic": a head dim without
# tiles. test_decode_rows.py covers the row kernel.
CUDA_KERNEL_CASES = {
    "heads": ("turboquant_4bit_nc", 64, 2, 3, None),
    "heads_k8v4": ("turboquant_k8v4", 128, 2, 4, None),
    "chunked": ("turboquant_k3v4_nc", 128, 2, 4, [40, 24, 0, 30]),
    "short_chunks": ("turboquant_4bit_nc", 64, 2, 3, [1, 2, 0, 3]),
    "generic": ("turboquant_4bit_nc", 96, 2, 3, None),
    "generic_varlen": ("turboquant_4bit_nc", 96, 2, 3, [5, 1, 0, 7]),
}


@requires_cuda
@pytest.mark.parametrize("case", list(CUDA_KERNEL_CASES))
@pytest.mark.parametrize("names", [("key_offset", "key_scale", "value_offset"), ("key_scale",), ("value_offset",)])
def test_each_cuda_kernel_attends_in_the_original_basis_as_the_cpu(case, names):
    """The CUDA decode of an fp16 query against the CPU's reference on the same bytes (the CPU's
    transforms are ATen passes around its kernels, tested against float64 above)."""
    preset, head_dim, hkv, group, q_lens = CUDA_KERNEL_CASES[case]
    lens = [0, 1, 37, 300]
    t = {name: x for name, x in _vectors("cpu", hkv=hkv, head_dim=head_dim).items() if name in names}
    cache, table, seq_lens, _, _ = _batch(preset, "cpu", t, lens=lens, hkv=hkv, head_dim=head_dim)
    on_gpu = {name: x.cuda() for name, x in t.items()}
    args = [cache.cuda(), table.cuda(), seq_lens.cuda()]
    scale = head_dim ** -0.5
    g = torch.Generator().manual_seed(8)
    if q_lens is None:
        q = torch.randn(len(lens), hkv * group, head_dim, generator=g).half()
        for num_splits in (1, 2, 5):
            ref, ref_lse = tq.decode(q.float(), cache, table, seq_lens, preset, scale, num_splits, return_lse=True, **t)
            out = tq.decode(q.cuda(), *args, preset, scale, num_splits, **on_gpu).cpu()
            assert rel_err(out, ref) <= 2e-3, num_splits
            assert (out[0] == 0).all()  # an empty sequence: no value_offset
            _, lse = tq.decode(q.cuda(), *args, preset, scale, num_splits, return_lse=True, **on_gpu)
            seen = torch.isfinite(ref_lse)
            assert torch.equal(torch.isfinite(lse.cpu()), seen)
            torch.testing.assert_close(lse.cpu()[seen], ref_lse[seen], rtol=0, atol=2e-2)
        return
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens) + 2, hkv * group, head_dim, generator=g).half()  # 2 rows past every sequence
    for num_splits in (1, 3):
        ref = tq.decode_varlen(q.float(), cache, table, seq_lens, starts, preset, scale, num_splits, **t)
        out = tq.decode_varlen(q.cuda(), *args, starts.cuda(), preset, scale, num_splits, **on_gpu).cpu()
        assert rel_err(out, ref) <= 2e-3, num_splits
        assert (out[-2:] == 0).all()  # rows outside every sequence: zeros, no value_offset


@pytest.mark.parametrize("device", DEVICES)
def test_without_the_transforms_the_attention_differs(device):
    """The transforms must matter for the tests above to test anything: the same cache read
    without them is another attention."""
    t = _vectors(device)
    cache, table, lens, _, _ = _batch("turboquant_4bit_nc", device, t)
    q = torch.randn(len(LENS), HQ, D).to(device, torch.float32 if device == "cpu" else torch.bfloat16)
    with_them = tq.decode(q, cache, table, lens, "turboquant_4bit_nc", 0.125, **t)
    assert rel_err(tq.decode(q, cache, table, lens, "turboquant_4bit_nc", 0.125).float(), with_them.float()) > 0.1


BAD = [
    ({"key_offset": torch.zeros(HKV, D, dtype=torch.float64)}, "key_offset must be float32"),
    ({"key_scale": torch.ones(HKV + 1, D)}, r"key_scale must be \[num_kv_heads, head_dim\] = \[2, 64\]"),
    ({"value_offset": torch.zeros(D)}, r"value_offset must be \[num_kv_heads, head_dim\]"),
]


@pytest.mark.parametrize("bad, match", BAD)
def test_bad_vectors_are_refused_naming_them_and_nothing_is_written(bad, match):
    cache = tq.allocate_kv_cache(2, BS, HKV, D, "turboquant_4bit_nc")
    x = torch.randn(3, HKV, D)
    with pytest.raises(RuntimeError, match=match):
        tq.store_kv(x, x, cache, torch.arange(3), "turboquant_4bit_nc", **bad)
    assert (cache == 0).all()
    table, lens = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=match):
        tq.decode(torch.randn(1, HQ, D), cache, table, lens, "turboquant_4bit_nc", 0.125, **bad)
    with pytest.raises(RuntimeError, match=match):
        tq.dequantize(cache, table, lens, "turboquant_4bit_nc", torch.float32, **bad)


def test_offsets_that_the_softcap_or_the_sinks_would_break_are_refused():
    cache = tq.allocate_kv_cache(2, BS, HKV, D, "turboquant_4bit_nc")
    table, lens, q = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3], dtype=torch.int32), torch.randn(1, HQ, D)
    zeros = torch.zeros(HKV, D)
    with pytest.raises(RuntimeError, match="key_offset cannot be combined with softcap or sinks"):
        tq.decode(q, cache, table, lens, "turboquant_4bit_nc", 0.125, softcap=5.0, key_offset=zeros)
    with pytest.raises(RuntimeError, match="key_offset cannot be combined with softcap or sinks"):
        tq.decode(q, cache, table, lens, "turboquant_4bit_nc", 0.125, sinks=torch.zeros(HQ), key_offset=zeros)
    with pytest.raises(RuntimeError, match="value_offset cannot be combined with sinks"):
        tq.decode_varlen(q, cache, table, lens, torch.tensor([0, 1], dtype=torch.int32), "turboquant_4bit_nc", 0.125,
                         sinks=torch.zeros(HQ), value_offset=zeros)


@requires_cuda
def test_cuda_refuses_a_vector_on_another_device():
    cache = tq.allocate_kv_cache(2, BS, HKV, D, "turboquant_4bit_nc", "cuda")
    x = torch.randn(3, HKV, D, device="cuda")
    with pytest.raises(RuntimeError, match="key_scale must be on the cache's device"):
        tq.store_kv(x, x, cache, torch.arange(3, device="cuda"), "turboquant_4bit_nc", key_scale=torch.ones(HKV, D))
    assert (cache == 0).all()
