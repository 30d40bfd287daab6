"""The row-staged CUDA decode (kernels/decode_rows.cu: one CTA per 8 KV heads, whole token rows by
bulk copies) against the CPU reference, on the shapes it serves: plain decodes of token-major
caches with KV heads in 8s, GQA groups up to 8, head dims up to 128. launch_decode picks it by
shape; test_each_decode_kernel_passes_these_tests reruns the file with each kernel forced
(TURBOQUANT_DECODE_KERNEL, read once per process; "rows" fails a decode it cannot serve), so the
row kernel provably ran and the per-head kernel sees the same shapes. Skipped without a GPU."""

import os
import subprocess
import sys

import pytest
import torch

import turboquant as tq
from conftest import requires_cuda
from helpers import captured_decode, make_paged_batch, poisoned_cuda_decode, rerun_tests_with, serving_table
from reference import rel_err

pytestmark = requires_cuda

PRESETS = list(tq.PRESETS)
SEQ_LENS = [0, 1, 17, 300, 1000, 64]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("num_splits", [1, 5, 0])
def test_rows_decode_matches_cpu(preset, head_dim, group, num_splits):
    heads = 8
    cache, bt, sl, _, _ = make_paged_batch(SEQ_LENS, 16, heads, head_dim, preset, seed=group + head_dim)
    q = torch.randn(len(SEQ_LENS), heads * group, head_dim).half()
    ref = tq.decode(q.float(), cache, bt, sl, preset, head_dim ** -0.5, num_splits)
    out = poisoned_cuda_decode(q, cache, bt, sl, preset, head_dim ** -0.5, num_splits, workspace=True)
    assert not out.isnan().any()
    assert (out[0] == 0).all()  # seq_len 0
    assert rel_err(out, ref) <= 2e-3


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
@pytest.mark.parametrize("num_splits", [1, 5, 0])
def test_rows_decode_applies_the_per_head_transforms_as_the_cpu(preset, num_splits):
    """key_scale times the staged query columns, value_offset added where one partial per row is
    written (or by the split merge), for rows that attend to something only."""
    heads, group, head_dim = 8, 4, 128
    cache, bt, sl, _, _ = make_paged_batch(SEQ_LENS, 16, heads, head_dim, preset, seed=5)
    g = torch.Generator().manual_seed(9)
    t = {"key_scale": torch.exp(torch.randn(heads, head_dim, generator=g) * 0.4),
         "value_offset": torch.randn(heads, head_dim, generator=g)}
    q = torch.randn(len(SEQ_LENS), heads * group, head_dim, generator=g).half()
    ref = tq.decode(q.float(), cache, bt, sl, preset, head_dim ** -0.5, num_splits, **t)
    out = tq.decode(q.cuda(), cache.cuda(), bt.cuda(), sl.cuda(), preset, head_dim ** -0.5, num_splits,
                    **{name: x.cuda() for name, x in t.items()}).cpu()
    assert (out[0] == 0).all()  # seq_len 0: no value_offset
    assert rel_err(out, ref) <= 2e-3


@pytest.mark.parametrize("preset, lens", [
    ("turboquant_4bit_nc", [0, 1, 2047, 2048, 4000, 130]),
    ("turboquant_k8v4", [5000, 3071, 3072, 100]),
    ("turboquant_3bit_nc", [40, 700, 256]),
    ("turboquant_k3v4_nc", [9000, 4100, 5000, 4096, 6000]),
])
def test_rows_decode_serving_block_tables(preset, lens):
    """Block tables sized for 32k tokens, as a serving engine allocates them: the row kernel (8 KV
    heads, 3 or more rows) divides every row over the grid's splits, so most CTAs of a short row
    find no tokens and leave after marking their partial empty (-inf), and a row of length 0 has
    no CTA with tokens at all. Each sequence against the CPU, the output and the workspace poisoned
    with NaN first; the file's rerun with the row kernel forced proves it ran."""
    head_dim = 128
    cache, bt, sl, _, _ = make_paged_batch(lens, 16, 8, head_dim, preset, seed=len(lens))
    q = torch.randn(len(lens), 32, head_dim).half()
    ref = tq.decode(q.float(), cache, bt, sl, preset, head_dim ** -0.5, 1)
    out = poisoned_cuda_decode(q, cache, serving_table(bt, cache), sl, preset, head_dim ** -0.5, 0, workspace=True)
    assert not out.isnan().any()
    for i, n in enumerate(lens):
        if n == 0:
            assert (out[i] == 0).all()
        else:
            assert rel_err(out[i], ref[i]) <= 2e-3, (i, n)


@pytest.mark.parametrize("preset", PRESETS)
def test_rows_decode_long_context_in_one_split(preset):
    """16,384 tokens accumulated by one split (the caller may force num_splits=1): the fp32 sums of
    the tensor cores run over 1,024 tiles. A change that costs accumulator bits (biased value
    codes did: rel. error 5e-3 at 2,000 tokens) fails here first."""
    cache, bt, sl, _, _ = make_paged_batch([16384, 3000], 16, 8, 128, preset, seed=7)
    q = torch.randn(2, 32, 128).half()
    ref = tq.decode(q.float(), cache, bt, sl, preset, 128 ** -0.5, 4)
    for splits in (1, 0):
        out = poisoned_cuda_decode(q, cache, bt, sl, preset, 128 ** -0.5, splits)
        assert rel_err(out, ref) <= 2e-3, splits


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4", "turboquant_3bit_nc"])
@pytest.mark.parametrize("kv_heads, head_dim", [(16, 128), (24, 128), (16, 64)])
def test_rows_decode_several_head_groups(preset, kv_heads, head_dim):
    """More than 8 KV heads: several CTAs per token row, each copying its 8 heads' run of every
    row (rows not adjacent: one bulk copy per token)."""
    cache, bt, sl, _, _ = make_paged_batch([333, 40, 1], 16, kv_heads, head_dim, preset, seed=kv_heads)
    q = torch.randn(3, kv_heads * 4, head_dim).half()
    ref = tq.decode(q.float(), cache, bt, sl, preset, 0.1, 3)
    for splits in (1, 3, 0):
        out = poisoned_cuda_decode(q, cache, bt, sl, preset, 0.1, splits)
        assert rel_err(out, ref) <= 2e-3, splits


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4", "turboquant_3bit_nc"])
def test_rows_decode_folds_a_ctas_two_splits(preset):
    """A Lloyd-Max-key CTA (4- and 3-bit keys) serves two splits and folds their results into one partial (none where its
    two are the row's only splits: 2 writes the output directly; 3 leaves the last CTA's second
    half without a split); the merge then combines one partial per CTA, over dim slices from 64
    partials up (256: 128 CTAs per row). 150 sequences of 0 to 3000 tokens, so short ones leave
    whole halves and CTAs empty. k8v4 (one split per CTA) goes through the same epilogue unfolded."""
    g = torch.Generator().manual_seed(11)
    lens = torch.randint(0, 3001, (150,), generator=g).tolist()
    lens[:4] = [0, 1, 16, 3000]
    cache, bt, sl, _, _ = make_paged_batch(lens, 16, 8, 128, preset, seed=12)
    q = torch.randn(150, 32, 128, generator=g).half()
    ref = tq.decode(q.float(), cache, bt, sl, preset, 0.1, 1)
    for splits in (2, 3, 4, 0, 256):
        out = poisoned_cuda_decode(q, cache, bt, sl, preset, 0.1, splits, workspace=True)
        assert not out.isnan().any(), splits
        assert (out[0] == 0).all(), splits  # seq_len 0
        assert rel_err(out, ref) <= 2e-3, splits


@pytest.mark.parametrize("splits", [1, 2, 3, 4, 0])
def test_rows_decode_nan_key_reaches_only_its_heads(splits):
    """A NaN key (one token of one KV head) makes exactly that head's 4 query heads NaN, through
    the fold of a CTA's two splits and the merge: a NaN result must not be weighted away as an
    empty split's is, also where every other split of the row is empty (sequence 3, 5 tokens in
    split 0: fmaxf skips the NaN, so the maximum log-sum-exp is -inf). Every other output matches
    the CPU. Sequence 4 holds one token, its key NaN: a split whose only score is NaN keeps the
    running max at -inf and must still come out NaN, not empty (a kernel that
    tested only the running max returned zeros there; column_saw_tokens guards it)."""
    preset = "turboquant_4bit_nc"
    cache, bt, sl, _, _ = make_paged_batch([1300, 1300, 700, 5, 1], 16, 8, 128, preset, seed=13)
    key = torch.randn(3, 8, 128)
    key[:, 3, 9] = float("nan")
    # token 700 of sequence 1, 2 of 3, 0 of 4
    slots = [bt[1, 700 // 16].item() * 16 + 700 % 16, bt[3, 0].item() * 16 + 2, bt[4, 0].item() * 16]
    tq.store_kv(key, torch.randn(3, 8, 128), cache, torch.tensor(slots), preset)
    q = torch.randn(5, 32, 128).half()
    ref = tq.decode(q.float(), cache, bt, sl, preset, 0.1, 1)
    out = poisoned_cuda_decode(q, cache, bt, sl, preset, 0.1, splits)
    nan_heads = torch.zeros(5, 32, dtype=torch.bool)
    nan_heads[1, 12:16] = nan_heads[3, 12:16] = nan_heads[4, 12:16] = True
    assert torch.equal(ref.isnan().any(-1), nan_heads)  # the reference agrees on where it lands
    assert torch.equal(out.isnan().any(-1), nan_heads) and out[nan_heads].isnan().all()
    assert rel_err(out[~nan_heads], ref[~nan_heads]) <= 2e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
def test_rows_decode_dtypes_block_sizes(dtype, block_size):
    """Tiles at every offset inside larger blocks, both query types."""
    preset = "turboquant_4bit_nc"
    cache, bt, sl, _, _ = make_paged_batch([700, 5, 129, 2000], block_size, 8, 128, preset, seed=block_size)
    q = torch.randn(4, 32, 128).to(dtype)
    ref = tq.decode(q.float(), cache, bt, sl, preset, 0.09, 3)
    for splits in (1, 3, 0):
        out = poisoned_cuda_decode(q, cache, bt, sl, preset, 0.09, splits)
        assert out.dtype == dtype
        assert rel_err(out.float(), ref) <= 2e-3, splits


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
def test_rows_decode_masks_block_ids_outside_the_cache(preset):
    """Block ids past the cache or negative: those tiles copy nothing and every score in them is
    masked (on both devices), and nothing outside the cache is read."""
    cache, bt, sl, _, _ = make_paged_batch([90, 40], 16, 8, 128, preset)
    bt = torch.cat([bt, torch.full((2, 2), -7, dtype=torch.int32)], dim=1)
    bt[0, 2] = 1 << 30
    bt[1, 3] = -7  # sequence 1 reads columns 0..4: one negative id inside its 70 tokens
    sl = torch.tensor([90, 70], dtype=torch.int32)
    q = torch.randn(2, 32, 128).half()
    ref = tq.decode(q.float(), cache, bt, sl, preset, 0.1, 2)
    for splits in (1, 2):
        out = poisoned_cuda_decode(q, cache, bt, sl, preset, 0.1, splits)
        assert not out.isnan().any()
        assert rel_err(out, ref) <= 2e-3, splits


def test_rows_decode_seq_lens_past_the_block_table():
    """seq_lens beyond max_blocks_per_seq * block_size are clamped to what the table holds."""
    preset = "turboquant_4bit_nc"
    cache, bt, sl, _, _ = make_paged_batch([64, 30], 16, 8, 128, preset, seed=5)
    q = torch.randn(2, 16, 128).half()
    long = torch.tensor([64 + 500, 30], dtype=torch.int32)
    ref = tq.decode(q.float(), cache, bt, sl, preset, 0.1, 1)
    out = poisoned_cuda_decode(q, cache, bt, long, preset, 0.1, 1)
    assert rel_err(out, ref) <= 2e-3


@pytest.mark.parametrize("table", ["exact", "serving"])
def test_rows_decode_graph_replay_follows_new_lengths(table):
    """The grid depends only on shapes: a captured decode replays with new seq_lens and queries. With a
    serving engine's 32k-token table the lengths alone decide each row's splits and which CTAs leave
    at once, on the device at every replay."""
    preset = "turboquant_4bit_nc"
    cache, bt, sl, _, _ = make_paged_batch([500, 260], 16, 8, 128, preset, seed=3)
    if table == "serving":
        bt = serving_table(bt, cache)
    cache, bt = cache.cuda(), bt.cuda()
    q = torch.randn(2, 32, 128, device="cuda").half()
    lens = sl.cuda()
    graph, out = captured_decode(q, cache, bt, lens, preset, 0.1)
    for new_lens in ([500, 260], [3, 259], [480, 0]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.copy_(torch.randn(2, 32, 128).half())
        graph.replay()
        torch.cuda.synchronize()
        want = tq.decode(q, cache, bt, lens, preset, 0.1)
        assert rel_err(out.float().cpu(), want.float().cpu()) <= 1e-3, new_lens


@pytest.mark.parametrize("kernel", ["rows", "heads"])
def test_each_decode_kernel_passes_these_tests(kernel):
    # Four workers where pytest-xdist is installed: run alone, the per-head rerun was the suite's
    # last test and outlasted gpu_run.sh's 450 s budget (H200).
    rerun_tests_with(__file__, {"TURBOQUANT_DECODE_KERNEL": kernel}, "not each_decode_kernel", workers=4)


def test_forced_rows_kernel_refuses_a_shape_it_cannot_serve():
    """With TURBOQUANT_DECODE_KERNEL=rows a decode the row kernel cannot serve (4 KV heads; a
    head-major cache) fails with a clear error instead of silently running the other kernel."""
    script = (
        "import sys; sys.path.insert(0, %r); sys.path.insert(0, %r)\n"
        "import torch, turboquant as tq\n"
        "from helpers import make_paged_batch\n"
        "for heads, head_major in ((4, False), (8, True)):\n"
        "    cache, bt, sl, _, _ = make_paged_batch([50], 16, heads, 128, 'turboquant_4bit_nc', head_major=head_major)\n"
        "    q = torch.randn(1, 4 * heads, 128).half().cuda()\n"
        "    gc = cache.transpose(1, 2).contiguous().cuda().transpose(1, 2) if head_major else cache.cuda()\n"
        "    try:\n"
        "        tq.decode(q, gc, bt.cuda(), sl.cuda(), 'turboquant_4bit_nc', 0.1)\n"
        "    except RuntimeError as e:\n"
        "        print('refused:', e)\n"
    ) % (os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"),
         os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, TURBOQUANT_DECODE_KERNEL="rows"),
                            capture_output=True, text=True)
    assert result.stdout.count("refused:") == 2 and "operation not supported" in result.stdout, \
        result.stdout + result.stderr
