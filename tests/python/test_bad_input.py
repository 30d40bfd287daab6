"""Bad input raises errors naming the argument, and leaves the cache unchanged (SPEC §4)."""

import pytest
import torch

import turboquant as tq

P = "turboquant_4bit_nc"


def _store_args(**over):
    a = dict(key=torch.randn(4, 2, 128), value=torch.randn(4, 2, 128),
             kv_cache=tq.allocate_kv_cache(2, 16, 2, 128, P), slot_mapping=torch.arange(4, dtype=torch.int32),
             preset=P)
    a.update(over)
    return a


STORE_CASES = {
    "unknown preset": (dict(preset="turboquant_5bit"), "unknown preset 'turboquant_5bit'; valid presets: turboquant_k8v4"),
    "key dtype": (dict(key=torch.randint(0, 5, (4, 2, 128)), value=torch.randint(0, 5, (4, 2, 128))), "key must be float16, bfloat16 or float32"),
    "value dtype": (dict(value=torch.randn(4, 2, 128).half()), "value dtype must match key"),
    "key rank": (dict(key=torch.randn(4, 256), value=torch.randn(4, 256)), "key must be 3-D"),
    "value shape": (dict(value=torch.randn(4, 2, 64)), "value must have key's shape"),
    "head_dim not multiple of 8": (dict(key=torch.randn(4, 2, 100), value=torch.randn(4, 2, 100)), "multiple of 8"),
    "head_dim without a rotation": (dict(key=torch.randn(4, 2, 72), value=torch.randn(4, 2, 72)),
                                    r"m \* 2\^k, m in \{1, 12, 20, 28\}.*got head_dim 72"),
    "head_dim too large": (dict(key=torch.randn(1, 1, 2048), value=torch.randn(1, 1, 2048), preset="turboquant_k8v4"),
                           r"head_dim must be a multiple of 8 in \[8, 1024\], got 2048"),
    "non-contiguous key": (dict(key=torch.randn(4, 128, 2).transpose(1, 2)), "must be contiguous"),
    "cache dtype": (dict(kv_cache=torch.zeros(2, 16, 2, 134, dtype=torch.int8)), "kv_cache must be uint8"),
    "cache rank": (dict(kv_cache=torch.zeros(32, 2, 134, dtype=torch.uint8)), "kv_cache must be 4-D"),
    "cache slot size": (dict(kv_cache=torch.zeros(2, 16, 2, 196, dtype=torch.uint8)), "kv_cache last dim must be 134 bytes"),
    "cache heads": (dict(kv_cache=torch.zeros(2, 16, 4, 134, dtype=torch.uint8)), "key has 2 KV heads but kv_cache has 4"),
    "block size": (dict(kv_cache=torch.zeros(2, 24, 2, 134, dtype=torch.uint8)), "block_size (dim 1) must be 16, 32, 64 or 128, got 24"),
    "slot_mapping dtype": (dict(slot_mapping=torch.arange(4.0)), "slot_mapping must be int32 or int64"),
    "slot_mapping length": (dict(slot_mapping=torch.arange(3, dtype=torch.int32)), "slot_mapping must have 4 entries"),
}


@pytest.mark.parametrize("case", list(STORE_CASES))
def test_store_kv_bad_input(case):
    over, message = STORE_CASES[case]
    args = _store_args(**over)
    before = args["kv_cache"].clone()
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tq.store_kv(**args)
    assert torch.equal(args["kv_cache"], before)


def _decode_args(**over):
    a = dict(query=torch.randn(2, 8, 128), kv_cache=tq.allocate_kv_cache(4, 16, 2, 128, P),
             block_table=torch.zeros(2, 2, dtype=torch.int32), seq_lens=torch.tensor([3, 5], dtype=torch.int32),
             preset=P, scale=0.1)
    a.update(over)
    return a


DECODE_CASES = {
    "query rank": (dict(query=torch.randn(2, 1024)), "query must be 3-D"),
    "query dtype": (dict(query=torch.randn(2, 8, 128).double()), "query must be float16, bfloat16 or float32"),
    "heads not multiple": (dict(query=torch.randn(2, 7, 128)), "query heads \\(7\\) must be a positive multiple of kv_cache heads \\(2\\)"),
    "no query heads": (dict(query=torch.randn(2, 0, 128)), "query heads \\(0\\) must be a positive multiple"),
    # 2^23 + 1 blocks of 128 tokens (torch.empty: 64 MB never touched).
    "block_table past 2^30 tokens": (dict(kv_cache=tq.allocate_kv_cache(4, 128, 2, 128, P),
                                          block_table=torch.empty(2, 2**23 + 1, dtype=torch.int32)),
                                     r"covers at most 2\^30 tokens per sequence; got 8388609 blocks of 128"),
    "head_dim vs cache": (dict(query=torch.randn(2, 8, 64)), "kv_cache last dim must be 70 bytes"),
    "block_table dtype": (dict(block_table=torch.zeros(2, 2, dtype=torch.int64)), "block_table must be int32"),
    "block_table rows": (dict(block_table=torch.zeros(3, 2, dtype=torch.int32)), "block_table must have 2 rows"),
    "seq_lens dtype": (dict(seq_lens=torch.tensor([3, 5])), "seq_lens must be int32"),
    "seq_lens length": (dict(seq_lens=torch.tensor([3], dtype=torch.int32)), "seq_lens must have 2 entries"),
    "num_splits negative": (dict(num_splits=-1), r"num_splits must be in \[0, 256\] \(0 = the library chooses\), got -1"),
    "num_splits too many": (dict(num_splits=257), r"num_splits must be in \[0, 256\].*got 257"),
    "num_splits past int": (dict(num_splits=2**32 + 1), r"num_splits must be in \[0, 256\].*got 4294967297"),
    "preset": (dict(preset="q4"), "unknown preset 'q4'"),
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_bad_input(case):
    over, message = DECODE_CASES[case]
    with pytest.raises(RuntimeError, match=message):
        tq.decode(**_decode_args(**over))


def test_dequantize_bad_input():
    cache = tq.allocate_kv_cache(4, 16, 2, 128, P)
    bt, sl = torch.zeros(2, 2, dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="matches no head_dim"):
        tq.dequantize(torch.zeros(4, 16, 2, 135, dtype=torch.uint8), bt, sl, P)
    with pytest.raises(RuntimeError, match="dtype must be float16, bfloat16 or float32"):
        tq.dequantize(cache, bt, sl, P, torch.int32)
    with pytest.raises(RuntimeError, match="seq_lens must have 2 entries"):
        tq.dequantize(cache, bt, sl[:1], P)
    with pytest.raises(RuntimeError, match=r"block_table must be 2-D, got shape \[\]"):
        tq.dequantize(cache, torch.tensor(0, dtype=torch.int32), sl, P)


def test_out_of_range_indices_are_masked_without_checking_mode():
    cache = tq.allocate_kv_cache(4, 16, 2, 128, P)
    key = torch.randn(20, 2, 128)
    tq.store_kv(key, key, cache, torch.arange(20, dtype=torch.int32), P)
    q = torch.randn(1, 4, 128)
    good = tq.decode(q, cache, torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32), P, 0.1)
    # Second block replaced by invalid ids: its tokens are masked, the first block still counts.
    for bad in (-1, 4, 1 << 30):
        out = tq.decode(q, cache, torch.tensor([[0, bad]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32), P, 0.1)
        only_first = tq.decode(q, cache, torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([16], dtype=torch.int32), P, 0.1)
        torch.testing.assert_close(out, only_first)
    # seq_len beyond what the block table covers is clamped to it.
    long = tq.decode(q, cache, torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([10_000], dtype=torch.int32), P, 0.1)
    full = tq.decode(q, cache, torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([32], dtype=torch.int32), P, 0.1)
    torch.testing.assert_close(long, full)
    assert not torch.equal(good, full)


def test_checking_mode_raises_on_bad_indices(monkeypatch):
    monkeypatch.setenv("TURBOQUANT_CHECK_INDICES", "1")
    cache = tq.allocate_kv_cache(2, 16, 2, 128, P)
    before = cache.clone()
    key = torch.randn(2, 2, 128)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[1\] = 32 is outside the cache \(32 slots"):
        tq.store_kv(key, key, cache, torch.tensor([0, 32], dtype=torch.int32), P)
    assert torch.equal(cache, before)
    q = torch.randn(1, 4, 128)
    with pytest.raises(RuntimeError, match=r"block_table\[0, 1\] = 7 is outside \[0, 2\)"):
        tq.decode(q, cache, torch.tensor([[0, 7]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32), P, 0.1)
    with pytest.raises(RuntimeError, match=r"seq_lens\[0\] = 40 is outside \[0, 32\]"):
        tq.decode(q, cache, torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([40], dtype=torch.int32), P, 0.1)


def test_checking_mode_names_the_callers_entries_in_decode_varlen(monkeypatch):
    """decode_varlen's checks name the caller's block_table and seq_lens entries (the CPU path
    decodes per query row from copies of them) and refuse negative lengths as decode does."""
    monkeypatch.setenv("TURBOQUANT_CHECK_INDICES", "1")
    cache = tq.allocate_kv_cache(2, 16, 2, 128, P)
    q = torch.randn(5, 4, 128)
    starts = torch.tensor([0, 3, 5], dtype=torch.int32)
    bt = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"seq_lens\[1\] = 50 is outside \[0, 32\]"):
        tq.decode_varlen(q, cache, bt, torch.tensor([10, 50], dtype=torch.int32), starts, P, 0.1)
    with pytest.raises(RuntimeError, match=r"seq_lens\[0\] = -4 is outside \[0, 32\]"):
        tq.decode_varlen(q, cache, bt, torch.tensor([-4, 20], dtype=torch.int32), starts, P, 0.1)
    with pytest.raises(RuntimeError, match=r"block_table\[1, 1\] = 7 is outside \[0, 2\)"):
        tq.decode_varlen(q, cache, torch.tensor([[0, 1], [1, 7]], dtype=torch.int32),
                         torch.tensor([10, 20], dtype=torch.int32), starts, P, 0.1)


def test_a_block_table_of_2_30_tokens_is_accepted():
    """The widest table the checks take (2^30 tokens: 2^23 blocks of 128) decodes like a narrow one."""
    cache = tq.allocate_kv_cache(2, 128, 2, 128, P)
    key = torch.randn(100, 2, 128)
    tq.store_kv(key, key, cache, torch.arange(100, dtype=torch.int32), P)
    q, sl = torch.randn(1, 4, 128), torch.tensor([100], dtype=torch.int32)
    wide = torch.zeros(1, 2**23, dtype=torch.int32)
    narrow = torch.zeros(1, 1, dtype=torch.int32)
    torch.testing.assert_close(tq.decode(q, cache, wide, sl, P, 0.1, 256), tq.decode(q, cache, narrow, sl, P, 0.1, 256))
