"""Mixed plain decode (kernels/decode.cu, launch_decode_mixed; TURBOQUANT_MIXED_DECODE=on, read once
per process): where the row kernel takes a batch by shape, each sequence shorter than
mixed_rows_from_context(batch) tokens (12288 / batch: B = 4 -> 3072, B = 6 -> 2048) takes the
per-head kernel instead, both kernels write partials at one stride, one merge combines them.

The tests below compare with the CPU reference in any process; test_mixed_decode_passes_these_tests
reruns the file with the switch on, where test_mixed_decode_launches_both_kernels proves that both
kernels ran. The workspace and the output are poisoned with NaN first, so a partial or a -inf entry
either kernel forgets to write cannot pass. Skipped without a GPU."""

import os

import pytest
import torch

import turboquant as tq
from conftest import requires_cuda
from helpers import (captured_decode, make_paged_batch, poisoned_cuda_decode, profiled_kernel_names, rerun_tests_with,
                     serving_table)
from reference import rel_err

# The row kernel (bulk copies, mbarriers) runs on sm_90 and newer only: elsewhere there is nothing to mix.
pytestmark = [requires_cuda, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="the row kernel needs sm_90")]

MIXED = os.environ.get("TURBOQUANT_MIXED_DECODE") == "on"


@pytest.mark.parametrize("preset", list(tq.PRESETS))
@pytest.mark.parametrize("lens, widen", [
    ([0, 1, 2047, 2048, 4000, 130], False),     # B = 6: from 2048 tokens on the row kernel
    ([5000, 3071, 3072, 100], True),            # B = 4, 32k-token tables: from 3072
    ([40, 700, 256], True),                     # B = 3: every sequence short (the row kernel's CTAs all leave)
    ([9000, 4100, 5000, 4096, 6000], False),    # B = 5: every sequence long (the per-head kernel's CTAs all leave)
])
def test_mixed_decode_matches_cpu(preset, lens, widen):
    _check_mixed(preset, lens, widen, heads=8)


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
def test_mixed_decode_with_one_partial_per_row(preset):
    """16 KV heads at B = 36 (from 341 tokens on the row kernel): one split per row in either
    kernel, so both write the output directly and no merge runs."""
    _check_mixed(preset, [0, 1, 340, 341, 342, 2000] + [100, 500] * 15, True, heads=16)


def _check_mixed(preset, lens, widen, heads):
    head_dim = 128
    cache, bt, sl, _, _ = make_paged_batch(lens, 16, heads, head_dim, preset, seed=len(lens))
    q = torch.randn(len(lens), heads * 4, head_dim).half()
    ref = tq.decode(q.float(), cache, bt, sl, preset, head_dim ** -0.5, 1)
    table = serving_table(bt, cache) if widen else bt
    out = poisoned_cuda_decode(q, cache, table, sl, preset, head_dim ** -0.5, 0, workspace=True)
    assert not out.isnan().any()
    for i, n in enumerate(lens):
        if n == 0:
            assert (out[i] == 0).all()
    assert rel_err(out, ref) <= 2e-3


def test_mixed_decode_graph_replay_moves_sequences_between_kernels():
    """The kernel choice is made on the device: a captured step replays with lengths that move
    sequences across the threshold (B = 4: 3072 tokens), in both directions."""
    preset = "turboquant_4bit_nc"
    cache, bt, sl, _, _ = make_paged_batch([6000, 6000, 6000, 6000], 16, 8, 128, preset, seed=5)
    cache, table = cache.cuda(), serving_table(bt, cache).cuda()
    q = torch.randn(4, 32, 128, device="cuda").half()
    lens = sl.cuda()
    graph, out = captured_decode(q, cache, table, lens, preset, 0.1)
    for new_lens in ([6000, 100, 3072, 3071], [1, 2, 3, 4], [5999, 0, 4000, 3500], [0, 0, 0, 0]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.copy_(torch.randn(4, 32, 128).half())
        graph.replay()
        torch.cuda.synchronize()
        want = tq.decode(q.float().cpu(), cache.cpu(), table.cpu(), lens.cpu(), preset, 0.1, 1)
        assert rel_err(out.float().cpu(), want) <= 2e-3, new_lens


def _kernels_of_one_decode(args, preset, splits):
    """(per-head, row, merge) kernel launches of one decode, from a profiler trace."""
    names = profiled_kernel_names(args, preset, splits)
    return tuple(sum(k in n for n in names) for k in ("decode_kernel", "decode_rows_kernel", "merge_splits_kernel"))


def test_mixed_decode_launches_both_kernels():
    """One decode of a batch with short and long sequences: with the switch on, the per-head kernel,
    the row kernel and one merge; off, the row kernel and its merge only. A split count the caller
    gives divides every sequence alike: never mixed."""
    preset = "turboquant_4bit_nc"
    cache, bt, sl, _, _ = make_paged_batch([100, 5000, 40, 4000], 16, 8, 128, preset, seed=9)
    args = [t.cuda() for t in (torch.randn(4, 32, 128).half(), cache, serving_table(bt, cache), sl)]
    assert _kernels_of_one_decode(args, preset, 0) == ((1, 1, 1) if MIXED else (0, 1, 1))
    assert _kernels_of_one_decode(args, preset, 6) == (0, 1, 1)


def test_mixed_decode_passes_these_tests():
    # A forced kernel is never mixed: unset.
    rerun_tests_with(__file__, {"TURBOQUANT_MIXED_DECODE": "on", "TURBOQUANT_DECODE_KERNEL": None},
                     "not passes_these_tests")
