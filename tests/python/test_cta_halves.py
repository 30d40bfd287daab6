"""The per-head decode kernel's CTAs of two halves (TURBOQUANT_CTA_HALVES=on, an experiment;
kernels/decode.cu): where the split rule fills two CTAs per SM, a grid of at most one CTA per SM,
each CTA's two 8-warp halves taking a split each, so no SM gets two CTAs of the grid's first ones
(the block scheduler's doubling, turboquant/split_plan.h row_splits_in_grid). Off by default:
these tests check which instantiation a decode launches with the switch off and on, and rerun the
CUDA decode tests against the CPU under it."""

import os
import re

import pytest
import torch

import turboquant as tq
from conftest import requires_cuda
from helpers import (captured_decode, make_paged_batch, poisoned_cuda_decode, profiled_kernel_names, rerun_tests_with,
                     serving_table)
from reference import rel_err

pytestmark = requires_cuda

HALVES = os.environ.get("TURBOQUANT_CTA_HALVES") == "on"
CUDA_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_cuda.py")


def _per_head_instances(args, preset, splits):
    """The kHalves template argument of each per-head decode kernel one decode launched, from a
    profiler trace (demangled or mangled kernel names)."""
    halves = []
    for name in profiled_kernel_names(args, preset, splits):
        if not ("decode_kernel<" in name or "13decode_kernelI" in name):
            continue
        m = re.search(r",\s*(\d)>\s*\(", name) or re.search(r"Li(\d)EEEvNS", name)
        assert m, name
        halves.append(int(m.group(1)))
    return halves


def test_cta_halves_run_where_the_rule_fills_two_ctas_per_sm():
    """B = 1 at 8 KV heads over a 32k-token table: 33 splits, two CTAs per SM (on GPUs of up to 147
    SMs) -> with the switch, the two-half kernel (16 CTAs of 2 splits per head). A table of the
    sequence's own 3000 tokens (16 splits, one per SM), a split count the caller gives and FP8 keys
    (one CTA per SM by rule) keep the plain kernel either way."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if 32768 // ((2 * sms // 8) * 128) < 7:
        pytest.skip(f"{sms} SMs: 32k tokens do not fill two CTAs per SM at B = 1")
    for preset, expect in (("turboquant_4bit_nc", 2 if HALVES else 1), ("turboquant_k8v4", 1)):
        cache, bt, sl, _, _ = make_paged_batch([3000], 16, 8, 128, preset, seed=3)
        q = torch.randn(1, 32, 128).half()
        wide = [t.cuda() for t in (q, cache, serving_table(bt, cache), sl)]
        exact = [t.cuda() for t in (q, cache, bt, sl)]
        assert _per_head_instances(wide, preset, 0) == [expect], preset
        assert _per_head_instances(exact, preset, 0) == [1], preset
        assert _per_head_instances(wide, preset, 8) == [1], preset


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("preset", ["turboquant_3bit_nc", "turboquant_k3v4_nc", "turboquant_4bit_nc"])
@pytest.mark.parametrize("lens", [[30000], [3000], [0]])
def test_decode_long_tables_match_cpu(preset, head_dim, lens):
    """B = 1 at 8 KV heads over a 32k-token table, every element against the CPU with the output and
    workspace poisoned: 30000 tokens take the whole grid (with the switch: both halves of every
    CTA), 3000 one CTA per SM's worth (first halves only), 0 none."""
    cache, bt, sl, _, _ = make_paged_batch(lens, 16, 8, head_dim, preset, seed=len(lens) + head_dim)
    q = torch.randn(1, 32, head_dim).half()
    ref = tq.decode(q.float(), cache, bt, sl, preset, head_dim ** -0.5, 1)
    out = poisoned_cuda_decode(q, cache, serving_table(bt, cache), sl, preset, head_dim ** -0.5, 0, workspace=True)
    assert not out.isnan().any()
    if lens[0] == 0:
        assert (out == 0).all()
    else:
        assert rel_err(out, ref) <= 2e-3


def test_graph_replay_across_the_halves():
    """One captured decode over a 32k-token table replayed as the sequence grows from first halves
    only to both halves and back to empty, each replay against the CPU."""
    preset, head_dim = "turboquant_4bit_nc", 128
    cache, bt, _, _, _ = make_paged_batch([30000], 16, 8, head_dim, preset, seed=5)
    table = serving_table(bt, cache)
    q = torch.randn(1, 32, head_dim).half()
    dev_q, dev_cache, dev_table = q.cuda(), cache.cuda(), table.cuda()
    dev_lens = torch.tensor([3000], dtype=torch.int32, device="cuda")
    graph, out = captured_decode(dev_q, dev_cache, dev_table, dev_lens, preset, head_dim ** -0.5)
    for length in (3000, 30000, 1, 0, 12000):
        dev_lens.fill_(length)
        graph.replay()
        torch.cuda.synchronize()
        lens = torch.tensor([length], dtype=torch.int32)
        ref = tq.decode(q.float(), cache, table, lens, preset, head_dim ** -0.5, 1)
        got = out.cpu()
        if length == 0:
            assert (got == 0).all()
        else:
            assert rel_err(got, ref) <= 2e-3, length


def test_decode_tests_pass_with_cta_halves():
    """With TURBOQUANT_CTA_HALVES=on: test_cuda.py's serving-table tests (rows of 0-16k tokens at 2-8
    KV heads, B = 25 with one CTA of two halves per row and head, varlen; the other selected tests
    take tables too short for two CTAs per SM, so the plain kernel, which must be unaffected) and
    this file's tests (D = 64 and 128, both halves and first halves only, graph replay)."""
    rerun_tests_with(CUDA_TESTS, {"TURBOQUANT_CTA_HALVES": "on"},
                     "(serving_block_tables or decode_matches_cpu or graph_capture or merges_many) and not own_row_splits")
    rerun_tests_with(os.path.abspath(__file__), {"TURBOQUANT_CTA_HALVES": "on"}, "not tests_pass_with_cta_halves")
