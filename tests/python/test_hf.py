"""turboquant.hf inside transformers: a real model (SmolLM2-135M-Instruct) and small random models
of the Qwen2 and Mistral architectures, on the CPU.

The references are the same model run through transformers' own cache and SDPA: with the plain
cache (greedy tokens), or with a DynamicCache that holds exactly what the packed cache decodes
to (the decode step's logits must then agree to fp32 rounding)."""

import os
import warnings

import pytest
import torch

# scripts/test.sh installs transformers and the real model and sets this: there a missing or broken
# install fails the run instead of skipping these tests.
REQUIRED = os.environ.get("TURBOQUANT_REQUIRE_REAL_MODEL") == "1"
if not REQUIRED:
    pytest.importorskip("transformers", reason="turboquant.hf needs transformers (scripts/test.sh installs it)")

import turboquant as tq  # noqa: E402
from conftest import requires_cuda  # noqa: E402
import turboquant.hf as tqhf  # noqa: E402
from turboquant.calibration import Calibration  # noqa: E402
from turboquant.roundtrip import packed  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402
from transformers.models.gemma2 import Gemma2Config  # noqa: E402
from transformers.models.gemma3 import Gemma3TextConfig  # noqa: E402
from transformers.models.gpt_oss import GptOssConfig  # noqa: E402
from transformers.models.mistral import MistralConfig  # noqa: E402
from transformers.models.phi3 import Phi3Config  # noqa: E402
from transformers.models.qwen2 import Qwen2Config  # noqa: E402

PROMPTS = ["The capital of France is",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who",
           "def fibonacci(n):"]


@pytest.fixture(scope="module")
def smollm():
    from turboquant import assets
    try:
        return assets.load_model()
    except FileNotFoundError as exc:
        if REQUIRED:
            raise
        pytest.skip(str(exc))


def _tiny(config_cls, **kw):
    torch.manual_seed(0)
    config = config_cls(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32 * 2, max_position_embeddings=512,
                        attn_implementation="turboquant", **kw)
    model = AutoModelForCausalLM.from_config(config).eval()
    # Random weights give keys of the scale 1: scale q/k up so that attention is not uniform.
    for layer in model.model.layers:
        layer.self_attn.k_proj.weight.data *= 4
    return model


def _cache(cache):
    """The keyword that hands a cache to this transformers version's generate/forward."""
    return {tqhf.CACHE_KWARG: cache}


def _generate(model, input_ids, attention_mask=None, cache=None, steps=32):
    return model.generate(input_ids=input_ids, attention_mask=attention_mask, **_cache(cache),
                          max_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True,
                          pad_token_id=0)


def _assert_same_greedy_tokens(plain, other, prompt_len, margin):
    """Tokens equal up to the first step where the plain run's top-2 logits are within ``margin``
    (a near-tie that any rounding may flip); after it the runs may go apart."""
    a, b = plain.sequences[0, prompt_len:], other.sequences[0, prompt_len:]
    for step in range(a.shape[0]):
        top2 = plain.logits[step][0].topk(2).values
        if top2[0] - top2[1] < margin:
            return step
        assert a[step] == b[step], f"greedy token {step} differs where the plain run's top-2 margin is {top2[0] - top2[1]:.3f}"
    return a.shape[0]


# ---- construction ------------------------------------------------------------------------------
def test_bad_constructor_arguments_are_refused_naming_them():
    model = _tiny(Qwen2Config)
    with pytest.raises(ValueError, match="preset must be one of"):
        tqhf.TurboQuantCache(model.config, preset="turboquant_2bit")
    with pytest.raises(ValueError, match="block_size must be one of"):
        tqhf.TurboQuantCache(model.config, block_size=24)
    with pytest.raises(ValueError, match="boundary_skip_layers must be an int >= 0"):
        tqhf.TurboQuantCache(model.config, boundary_skip_layers=-1)
    with pytest.raises(ValueError, match="skip_layers must be layer indices"):
        tqhf.TurboQuantCache(model.config, skip_layers=[0, 4])
    with pytest.raises(ValueError, match="varlen_threshold"):
        tqhf.TurboQuantCache(model.config, varlen_threshold=-2)
    with pytest.raises(ValueError, match="reserve_tokens"):
        tqhf.TurboQuantCache(model.config, reserve_tokens=0)
    with pytest.raises(ValueError, match="calibrate must be"):
        tqhf.TurboQuantCache(model.config, calibrate="keys")
    with pytest.raises(ValueError, match="shift_packed_logits must be True or False"):
        tqhf.TurboQuantCache(model.config, shift_packed_logits=1)


def test_cache_refuses_a_model_without_turboquant_attention():
    model = _tiny(Qwen2Config)
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match='attn_implementation="turboquant"'):
        tqhf.TurboQuantCache(model.config)


def test_attention_switched_away_after_construction_fails_loudly():
    model = _tiny(Qwen2Config)
    cache = tqhf.TurboQuantCache(model.config, boundary_skip_layers=0)
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 256, (1, 8))
    with pytest.raises(RuntimeError, match="never reached the packed cache"):
        model.generate(input_ids=ids, **_cache(cache), max_new_tokens=3, do_sample=False, pad_token_id=0)


def test_boundary_layers_stay_plain():
    config = Qwen2Config(num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, hidden_size=128,
                         head_dim=64, attn_implementation="turboquant")
    assert tqhf.TurboQuantCache(config).quantized_layers == [2, 3, 4, 5]
    assert tqhf.TurboQuantCache(config, boundary_skip_layers=0).quantized_layers == list(range(8))
    assert tqhf.TurboQuantCache(config, skip_layers=[1]).quantized_layers == [0, 2, 3, 4, 5, 6, 7]
    assert tqhf.TurboQuantCache(config, boundary_skip_layers=3).quantized_layers == [2, 3, 4, 5]  # capped at half


# ---- the decode step against a reference over the dequantized cache ---------------------------
def _round_trip(preset, transform=None):
    """K/V ``[B, H, T, D]`` -> what a packed cache of ``preset`` decodes them to (stored in the
    basis of a calibrated layer's ``transform``, read back in the original one)."""
    def round_trip(key, value):
        batch, heads, tokens, dim = key.shape
        flat = [t.transpose(1, 2).reshape(batch * tokens, heads, dim).contiguous() for t in (key, value)]
        if transform is None:
            k, v = packed(preset, *flat)
        else:
            k, v = transform.restore(*packed(preset, transform.keys(flat[0]), transform.values(flat[1])))
        return tuple(t.view(batch, tokens, heads, dim).transpose(1, 2).to(key.dtype) for t in (k, v))
    return round_trip


def _reference_cache(model, cache, round_trip_new=True):
    """A DynamicCache holding, for each quantized layer, what the packed cache decodes to (with the
    raw first tokens a calibrated layer keeps), and the plain layers' own K/V; for one sequence (no padding). Later K/V its quantized layers take are
    round-tripped through a packed cache first, as ``decode`` reads a step's own token packed."""
    ref = DynamicCache()
    seq = cache.sequences
    device = cache.layers[cache.quantized_layers[0]].attention.cache.device
    table = torch.tensor([seq.blocks[0]], dtype=torch.int32, device=device)
    lens = torch.tensor([seq.lengths[0]], dtype=torch.int32, device=device)
    for i, layer in enumerate(cache.layers):
        if i in cache.quantized_layers:
            k, v = tq.dequantize(layer.attention.cache, table, lens, cache.preset, torch.float32)
            if layer.attention.transform is not None:  # a calibrated layer: back to the original basis
                k, v = layer.attention.transform.restore(k, v)
            if layer.attention.first is not None:  # and its first block raw (Calibration.exact_first_block)
                layer.attention.first.overlay(k[0], v[0], 0, 0)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [1, Hkv, L, D]
        else:
            k, v = layer.keys, layer.values
        ref.update(k.to(model.dtype), v.to(model.dtype), i)
    for i in cache.quantized_layers if round_trip_new else []:
        layer, plain_update = ref.layers[i], ref.layers[i].update
        round_trip = _round_trip(cache.preset, cache.layers[i].attention.transform)
        layer.update = lambda k, v, *a, _up=plain_update, _rt=round_trip, **kw: _up(*_rt(k, v), *a, **kw)
    return ref


@pytest.mark.parametrize("preset,calibrate", [(p, None) for p in tq.PRESETS]
                         + [("turboquant_4bit_nc", Calibration(smooth_keys=0.5, center_values=True, min_offset=0.0))])
def test_decode_step_logits_match_sdpa_over_the_dequantized_cache(smollm, preset, calibrate):
    """Calibrated: the packed layers hold transformed K/V; a decode step must attend as SDPA over
    what they restore to in the original basis."""
    model, tok = smollm
    ids = tok(PROMPTS[1] + " lived by the shore and every morning went out in his little boat", return_tensors="pt").input_ids
    cache = tqhf.TurboQuantCache(model.config, preset=preset, calibrate=calibrate)
    with torch.no_grad():
        model(ids, **_cache(cache), use_cache=True)
        fitted = [cache.layers[i].attention.transform for i in cache.quantized_layers]
        assert all((t is not None and t.key_scale is not None and t.value_offset is not None) == (calibrate is not None)
                   for t in fitted)
        ref = _reference_cache(model, cache)
        nxt = torch.tensor([[tok.encode(" the")[0]]])
        ours = model(nxt, **_cache(cache), use_cache=True).logits[0, -1].double()
        theirs = model(nxt, **_cache(ref), use_cache=True).logits[0, -1].double()
    # 30 fp32 layers agree to ~3e-7, and a wrong slot gives ~1e-2. The reference packs the new
    # token's K/V again from its own forward; calibrated, " the" gives 2.8e-4 (" a", " and", " he":
    # under 3e-6), as a key level that float rounding moves across a bin boundary would.
    assert ((ours - theirs).norm() / theirs.norm()).item() < (1e-3 if calibrate is not None else 1e-4)


def test_long_continuation_chunk_matches_sdpa_over_dequantized_prefix_and_raw_chunk(smollm):
    """A later chunk past varlen_threshold: SDPA over the dequantized prefix and its own raw K/V,
    which is exactly the reference model run on a DynamicCache of the dequantized prefix."""
    model, tok = smollm
    ids = tok(PROMPTS[1] + " lived by the shore and every morning went out in his little boat", return_tensors="pt").input_ids
    split = 12
    cache = tqhf.TurboQuantCache(model.config, preset="turboquant_4bit_nc", varlen_threshold=4)
    with torch.no_grad():
        model(ids[:, :split], **_cache(cache), use_cache=True)
        ref = _reference_cache(model, cache, round_trip_new=False)
        ours = model(ids[:, split:], **_cache(cache), use_cache=True).logits[0].double()
        theirs = model(ids[:, split:], **_cache(ref), use_cache=True).logits[0].double()
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-4  # 30 fp32 layers; a wrong slot gives ~1e-2


def test_short_continuation_chunk_through_decode_varlen_matches_the_reference(smollm):
    """Up to varlen_threshold a chunk attends through decode_varlen, which reads the chunk's own
    K/V back from the packed cache: the reference round-trips them."""
    model, tok = smollm
    ids = tok(PROMPTS[1] + " lived by the shore", return_tensors="pt").input_ids
    cache = tqhf.TurboQuantCache(model.config, preset="turboquant_k3v4_nc", varlen_threshold=64)
    with torch.no_grad():
        model(ids[:, :10], **_cache(cache), use_cache=True)
        ref = _reference_cache(model, cache)
        ours = model(ids[:, 10:], **_cache(cache), use_cache=True).logits[0].double()
        theirs = model(ids[:, 10:], **_cache(ref), use_cache=True).logits[0].double()
    assert ids.shape[1] - 10 > 1
    # 2e-3: the reference stores K/V the model computed again, and a 3-bit bin that float rounding
    # flips between the two moves the logits by ~6e-4 (seen with one thread per process, as under
    # pytest-xdist); a reference that keeps the chunk's own K/V raw differs by 0.12.
    assert ((ours - theirs).norm() / theirs.norm()).item() < 2e-3


# ---- generation against the plain cache -------------------------------------------------------
def test_k8v4_greedy_tokens_match_the_plain_cache(smollm):
    """Over 40 generated tokens per prompt, fed back as the plain cache generated them, k8v4's
    greedy choice equals the plain cache's at every step where the plain top-2 logits are more
    than 0.5 apart."""
    model, tok = smollm
    checked = 0
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        plain = _generate(model, ids, steps=40)
        tokens = plain.sequences[0, ids.shape[1]:]
        cache = tqhf.TurboQuantCache(model.config, preset="turboquant_k8v4")
        with torch.no_grad():
            logits = [model(ids, **_cache(cache), use_cache=True).logits[0, -1]]
            logits += [model(t.view(1, 1), **_cache(cache), use_cache=True).logits[0, -1] for t in tokens[:-1]]
        for step, (ours, theirs) in enumerate(zip(logits, plain.logits)):
            top2 = theirs[0].topk(2).values
            if top2[0] - top2[1] > 0.5:
                checked += 1
                assert ours.argmax() == theirs[0].argmax(), (prompt, step)
    assert checked >= 32 * len(PROMPTS) // 2, checked


def test_left_padded_batch_generates_what_each_prompt_does_alone(smollm):
    """Padding never enters the packed cache, so a sequence of a batch attends as it would alone.
    Not bit for bit: the batched projections round differently (~1e-5), and a key that lands on
    a quantization boundary may then take the neighbouring level, so the logits may move by a
    fraction of the preset's own error (against the plain cache): 0.67 against 1.15 at most, with
    one thread per process. Padding the cache attends to moves them by 11-37 (the control below)."""
    model, tok = smollm
    tok.padding_side = "left"
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    steps, preset = 16, "turboquant_4bit_nc"
    cache = tqhf.TurboQuantCache(model.config, preset=preset)
    together = _generate(model, batch.input_ids, batch.attention_mask, cache=cache, steps=steps)
    width = batch.input_ids.shape[1]
    real = batch.attention_mask.sum(1) + steps - 1  # the last generated token is never fed back
    assert cache.sequences.lengths == real.tolist()
    for b, prompt in enumerate(PROMPTS):
        ids = tok(prompt, return_tensors="pt").input_ids
        alone = _generate(model, ids, cache=tqhf.TurboQuantCache(model.config, preset=preset), steps=steps)
        plain = _generate(model, ids, steps=steps)
        padded = None
        if ids.shape[1] < width:  # the control: this row with its padding attended to
            padded = _generate(model, batch.input_ids[b:b + 1], torch.ones_like(batch.attention_mask[b:b + 1]),
                               cache=tqhf.TurboQuantCache(model.config, preset=preset), steps=steps)
        a, t = alone.sequences[0, ids.shape[1]:], together.sequences[b, width:]
        for step in range(steps):
            if not torch.equal(alone.sequences[0, ids.shape[1]:ids.shape[1] + step], plain.sequences[0, ids.shape[1]:ids.shape[1] + step]):
                break  # the plain run took another path: its logits no longer measure the preset's error
            preset_err = (alone.logits[step][0] - plain.logits[step][0]).abs().max()
            batch_err = (together.logits[step][b] - alone.logits[step][0]).abs().max()
            assert batch_err <= preset_err + 1e-3, (b, step, batch_err.item(), preset_err.item())
            if padded is not None and torch.equal(padded.sequences[0, width:width + step], a[:step]):
                padding_err = (padded.logits[step][0] - alone.logits[step][0]).abs().max()
                assert batch_err < 0.1 * padding_err, (b, step, batch_err.item(), padding_err.item())
            top2 = alone.logits[step][0].topk(2).values
            if top2[0] - top2[1] < 0.5:
                break  # a near-tie: the batch may pick the other token and go its own way
            assert a[step] == t[step], (b, step)


def test_packed_cache_grows_in_blocks_and_counts_its_bytes(smollm):
    model, tok = smollm
    ids = tok(PROMPTS[0], return_tensors="pt").input_ids
    cache = tqhf.TurboQuantCache(model.config, preset="turboquant_3bit_nc", block_size=16)
    out = _generate(model, ids, cache=cache, steps=40)
    tokens = out.sequences.shape[1] - 1  # the last generated token is never fed back
    assert cache.sequences.lengths == [tokens]
    assert len(cache.sequences.blocks[0]) == -(-tokens // 16)
    layer = cache.layers[cache.quantized_layers[0]]
    assert layer.attention.cache.shape[0] >= len(cache.sequences.blocks[0])
    slot = tq.slot_layout("turboquant_3bit_nc", 64).slot_size_aligned
    plain = 4 * 2 * 3 * 64 * 4 * tokens  # 4 boundary layers, K+V, 3 heads, D=64, fp32
    assert cache.packed_bytes() == len(cache.quantized_layers) * 3 * slot * tokens + plain
    assert cache.get_seq_length() == tokens


def test_crop_then_redecode_gives_the_same_logits(smollm):
    """Assisted generation crops rejected tokens; feeding the same tokens again must see the
    same cache."""
    model, tok = smollm
    ids = tok(PROMPTS[1], return_tensors="pt").input_ids
    cache = tqhf.TurboQuantCache(model.config, preset="turboquant_4bit_nc")
    with torch.no_grad():
        model(ids[:, :-4], **_cache(cache), use_cache=True)
        first = [model(ids[:, i:i + 1], **_cache(cache), use_cache=True).logits for i in range(ids.shape[1] - 4, ids.shape[1])]
        cache.crop(-3)
        assert cache.get_seq_length() == ids.shape[1] - 3
        again = [model(ids[:, i:i + 1], **_cache(cache), use_cache=True).logits for i in range(ids.shape[1] - 3, ids.shape[1])]
    for a, b in zip(first[1:], again):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_reorder_copies_sequences_without_sharing_blocks(smollm):
    model, tok = smollm
    tok.padding_side = "left"
    batch = tok(PROMPTS[:2], return_tensors="pt", padding=True)
    cache = tqhf.TurboQuantCache(model.config, preset="turboquant_4bit_nc")
    with torch.no_grad():
        model(**batch, **_cache(cache), use_cache=True)
        cache.reorder_cache(torch.tensor([1, 1]))
        mask = torch.cat([batch.attention_mask[[1, 1]], torch.ones(2, 1, dtype=torch.long)], 1)
        step = model(torch.tensor([[42], [42]]), attention_mask=mask, **_cache(cache), use_cache=True).logits
    assert cache.sequences.lengths[0] == cache.sequences.lengths[1]
    assert not set(cache.sequences.blocks[0]) & set(cache.sequences.blocks[1])
    # Equal up to the float32 rounding of batched matmuls (the CPU's GEMM may round two identical rows
    # of one batch differently: 2.2e-5 seen on logits of order 10); a wrongly copied block moves
    # them by ~1e-1.
    torch.testing.assert_close(step[0], step[1], rtol=1e-5, atol=1e-4)


def test_beam_search_reorders_the_packed_cache(smollm):
    """Beam search reorders the cache every step (three beams copied from their parents' blocks).
    Beams rank by summed log-probabilities, so any rounding may reorder near-equal beams later in
    the search; the first tokens of the best beam agree with the plain cache's."""
    model, tok = smollm
    ids = tok(PROMPTS[0], return_tensors="pt").input_ids
    kw = dict(max_new_tokens=12, num_beams=3, do_sample=False, pad_token_id=0)
    plain = model.generate(ids, **kw)
    cache = tqhf.TurboQuantCache(model.config, preset="turboquant_k8v4")
    ours = model.generate(ids, **_cache(cache), **kw)
    assert torch.equal(plain[:, :ids.shape[1] + 4], ours[:, :ids.shape[1] + 4])
    lengths, blocks = cache.sequences.lengths, cache.sequences.blocks
    assert len(lengths) == 3 and len(set(lengths)) == 1
    assert len(set(blocks[0]) | set(blocks[1]) | set(blocks[2])) == sum(len(b) for b in blocks)  # no block shared


# ---- exact recent tokens (exact_recent) ----------------------------------------------------------
def _left_padded_prompts(lengths=(5, 37, 20)):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 256, (n,), generator=g) for n in lengths]
    width = max(lengths)
    ids, mask = torch.zeros(len(prompts), width, dtype=torch.long), torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = p, 1
    return ids, mask


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_3bit_nc"])
def test_exact_recent_over_the_whole_context_generates_as_the_plain_cache(preset):
    """With every position among the exact ones, a left-padded batch's greedy generation (its
    logits at every step) is the plain cache's: the rings, the merge with the (empty) packed part
    and the padding rows are right."""
    from transformers import LlamaConfig
    model = _tiny(LlamaConfig)
    ids, mask = _left_padded_prompts()
    plain = _generate(model, ids, mask, cache=DynamicCache(), steps=20)
    cache = tqhf.TurboQuantCache(model.config, preset=preset, boundary_skip_layers=1, exact_recent=64)
    ours = _generate(model, ids, mask, cache=cache, steps=20)
    assert torch.equal(plain.sequences, ours.sequences)
    for a, b in zip(plain.logits, ours.logits):
        assert ((a - b).norm() / a.norm()).item() < 1e-5


def test_shift_packed_logits_reaches_every_packed_layer_and_moves_only_mixed_softmaxes():
    """``shift_packed_logits=True``: each packed layer shifts (turboquant.packed_noise; the layer
    tests check the shift against float64). A batch's first prefill (raw K/V only) is unchanged;
    its decode steps with exact recent tokens beside packed ones are not."""
    from transformers import LlamaConfig
    model = _tiny(LlamaConfig)
    ids, mask = _left_padded_prompts()
    runs = {}
    for shift in (False, True):
        cache = tqhf.TurboQuantCache(model.config, preset="turboquant_k3v4_nc", boundary_skip_layers=1,
                                     exact_recent=4, shift_packed_logits=shift)
        runs[shift] = _generate(model, ids, mask, cache=cache, steps=8)
        assert all((cache.layers[i].attention.noise is not None) == shift for i in cache.quantized_layers)
    assert torch.equal(runs[False].logits[0], runs[True].logits[0])  # the prefill's last logits
    assert not torch.equal(runs[False].logits[-1], runs[True].logits[-1])


def test_packed_bytes_count_the_rings_of_exact_recent_tokens():
    """A cache keeping the last R tokens raw holds their bf16/fp32 K/V beside the slots: the report
    of its bytes must say so (R x 2 x Hkv x D per ring row and quantized layer)."""
    from transformers import LlamaConfig
    model = _tiny(LlamaConfig)
    ids, mask = _left_padded_prompts()
    held = {}
    for recent in (0, 8):
        cache = tqhf.TurboQuantCache(model.config, preset="turboquant_4bit_nc", boundary_skip_layers=1,
                                     exact_recent=recent)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **_cache(cache), use_cache=True)
        held[recent] = cache.packed_bytes()
    rows = cache.layers[next(iter(cache.quantized_layers))].attention.recent.keys.shape[0]
    assert rows >= ids.shape[0]
    assert held[8] - held[0] == len(cache.quantized_layers) * rows * 8 * 2 * 2 * 64 * 4  # K+V, Hkv 2, D 64, fp32


def test_exact_recent_loses_less_than_packing_every_token():
    """Fewer exact tokens than the context: the last 16 raw, the rest 3-bit packed, is closer to the
    plain cache than all 3-bit packed (teacher-forced logits over 24 steps after a 60-token prompt).
    A random model has no local heads, so the gain is small here (14 %); a wrong merge would make it
    a loss. The gain on real models is benchmarks/exact_tokens.py's."""
    from transformers import LlamaConfig
    model = _tiny(LlamaConfig)
    ids = torch.randint(1, 256, (1, 84), generator=torch.Generator().manual_seed(5))

    def logits(cache):
        with torch.no_grad():
            model(ids[:, :60], **_cache(cache), use_cache=True)
            return torch.stack([model(ids[:, t:t + 1], **_cache(cache), use_cache=True).logits[0, -1]
                                for t in range(60, 84)])
    plain = logits(DynamicCache())
    error = lambda cache: ((logits(cache) - plain).norm() / plain.norm()).item()
    packed = error(tqhf.TurboQuantCache(model.config, preset="turboquant_3bit_nc", boundary_skip_layers=0))
    recent = error(tqhf.TurboQuantCache(model.config, preset="turboquant_3bit_nc", boundary_skip_layers=0,
                                        exact_recent=16))
    assert recent < 0.95 * packed, (recent, packed)


def test_exact_recent_follows_beam_reordering_and_crop():
    """Rings follow their sequences when beams reorder (every position exact: the plain cache's
    beams), and after a crop each sequence's last positions are back in its ring."""
    from transformers import LlamaConfig
    model = _tiny(LlamaConfig)
    ids = torch.randint(1, 256, (1, 12), generator=torch.Generator().manual_seed(6))
    kw = dict(max_new_tokens=10, num_beams=3, do_sample=False, pad_token_id=0)
    plain = model.generate(ids, **kw)
    cache = tqhf.TurboQuantCache(model.config, preset="turboquant_4bit_nc", boundary_skip_layers=1, exact_recent=64)
    assert torch.equal(plain, model.generate(ids, **_cache(cache), **kw))
    cache = tqhf.TurboQuantCache(model.config, preset="turboquant_4bit_nc", boundary_skip_layers=1, exact_recent=8)
    with torch.no_grad():
        model(ids, **_cache(cache), use_cache=True)
        for t in range(6):
            model(torch.tensor([[t + 1]]), **_cache(cache), use_cache=True)
    cache.crop(-5)  # 18 -> 13 positions: 5..9 had been overwritten by 13..17 (mod 8) and come back packed
    for i in cache.quantized_layers:
        ring = cache.layers[i].attention.recent
        assert sorted(ring.positions[0].tolist()) == list(range(5, 13))


def test_calibrated_layers_keep_each_sequences_first_block_raw():
    """Calibrated with keys centered, each sequence's first block (its sinks) is kept raw
    (``Calibration.exact_first_block``): the reported bytes count it, and after a crop into it the
    sequence's next tokens take the positions past the crop again."""
    from transformers import LlamaConfig
    model = _tiny(LlamaConfig)
    ids, mask = _left_padded_prompts()
    held = {}
    for sinks in (False, True):
        cache = tqhf.TurboQuantCache(model.config, preset="turboquant_4bit_nc", boundary_skip_layers=1,
                                     calibrate=Calibration(exact_first_block=sinks))
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **_cache(cache), use_cache=True)
        held[sinks] = cache.packed_bytes()
    first = cache.layers[next(iter(cache.quantized_layers))].attention.first
    assert first.count == 16 and first.keys.shape[0] >= ids.shape[0]
    assert held[True] - held[False] == len(cache.quantized_layers) * first.keys.shape[0] * 16 * 2 * 2 * 64 * 4
    ids = torch.randint(1, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    cache = tqhf.TurboQuantCache(model.config, preset="turboquant_4bit_nc", boundary_skip_layers=1, calibrate=True)
    with torch.no_grad():
        model(ids, **_cache(cache), use_cache=True)
        cache.crop(-10)
        kept = {i: cache.layers[i].attention.first.positions[0].tolist() for i in cache.quantized_layers}
        model(ids[:, 10:13], **_cache(cache), use_cache=True)
    for i in cache.quantized_layers:
        first = cache.layers[i].attention.first
        assert kept[i] == list(range(10)) + [-1] * 6
        assert first.positions[0].tolist() == list(range(13)) + [-1] * 3


# ---- other architectures and dtypes -------------------------------------------------------------
@pytest.mark.parametrize("config_cls", [Qwen2Config, MistralConfig])
@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32), ("cpu", torch.bfloat16), ("cpu", torch.float16),
                                          pytest.param("cuda", torch.bfloat16, marks=requires_cuda),
                                          pytest.param("cuda", torch.float16, marks=requires_cuda)])
def test_qwen2_and_mistral_decode_steps_match_the_reference(config_cls, device, dtype):
    model = _tiny(config_cls, sliding_window=None).to(device, dtype)  # Mistral since v0.2: no window
    if config_cls is Qwen2Config:  # Qwen2's k_proj bias: a per-channel key offset
        assert model.model.layers[0].self_attn.k_proj.bias is not None
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(1)).to(device)
    cache = tqhf.TurboQuantCache(model.config, preset="turboquant_4bit_nc", boundary_skip_layers=1)
    with torch.no_grad():
        model(ids, **_cache(cache), use_cache=True)
        ref = _reference_cache(model, cache)
        nxt = torch.tensor([[7]], device=device)
        ours = model(nxt, **_cache(cache), use_cache=True).logits[0, -1].double()
        theirs = model(nxt, **_cache(ref), use_cache=True).logits[0, -1].double()
    budget = 1e-4 if dtype == torch.float32 else 2e-2  # half precision: both sides round their own way
    assert ((ours - theirs).norm() / theirs.norm()).item() < budget


# ---- model kinds whose attention has options: windows, soft-capping, sinks -----------------------
WINDOW = 16  # transformers' sliding_window: a query sees its 16 most recent positions


def _tiny_with_options(kind: str):
    """A small random model of each kind of attention the ops' options and head_dims serve (in
    transformers' own terms), with weights that make each option matter on 40 tokens."""
    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=512, attn_implementation="turboquant")
    torch.manual_seed(0)
    if kind == "mistral_window":  # every layer windowed
        config = MistralConfig(sliding_window=WINDOW, **common)
    elif kind == "gemma2_softcap_window":  # sliding and full layers alternate, every logit soft-capped
        config = Gemma2Config(sliding_window=WINDOW, attn_logit_softcapping=2.0, query_pre_attn_scalar=64, **common)
    elif kind == "gemma3_window":  # q/k norms, sliding layers with one full layer in six
        config = Gemma3TextConfig(sliding_window=WINDOW, query_pre_attn_scalar=64, **common)
    elif kind == "phi3_head_dim_96_window":  # head_dim 96: the rotation H_12 (x) H_8
        common.update(hidden_size=384, head_dim=96)
        config = Phi3Config(sliding_window=WINDOW, pad_token_id=0, bos_token_id=1, eos_token_id=2, **common)
    else:  # gpt-oss: sinks in every layer, sliding and full layers alternate
        config = GptOssConfig(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2, **common)
    model = AutoModelForCausalLM.from_config(config).eval()
    for layer in model.model.layers:
        attn = layer.self_attn
        if hasattr(attn, "qkv_proj"):  # Phi-3: q, k, v rows of one projection
            q_rows = config.num_attention_heads * config.head_dim
            attn.qkv_proj.weight.data[q_rows:q_rows + config.num_key_value_heads * config.head_dim] *= 4
        else:
            attn.k_proj.weight.data *= 4
        if hasattr(layer.self_attn, "sinks"):
            layer.self_attn.sinks.data = torch.randn(config.num_attention_heads) * 2
    return model


OPTION_KINDS = ["mistral_window", "gemma2_softcap_window", "gemma3_window", "gpt_oss_sinks_window",
                "phi3_head_dim_96_window"]


@pytest.mark.parametrize("kind,preset,device,dtype", [
    (kind, preset, "cpu", torch.float32) for kind in OPTION_KINDS for preset in ("turboquant_4bit_nc", "turboquant_k3v4_nc")
] + [pytest.param(kind, "turboquant_4bit_nc", "cuda", torch.bfloat16, marks=requires_cuda) for kind in OPTION_KINDS])
def test_windowed_softcapped_and_sink_layers_are_quantized_and_match_eager_attention(kind, preset, device, dtype):
    """Every layer packed; a decode step past the window (40 tokens, window 16) against transformers'
    own eager attention (the implementation these models define softcap and sinks in) over what the
    packed cache decodes to."""
    model = _tiny_with_options(kind).to(device, dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = tqhf.TurboQuantCache(model.config, preset=preset, boundary_skip_layers=0)
    assert cache.quantized_layers == [0, 1, 2, 3] and not [w for w in caught if "turboquant" in str(w.message)]
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1)).to(device)
    nxt = torch.tensor([[7]], device=device)
    with torch.no_grad():
        model(ids, **_cache(cache), use_cache=True)
        ref = _reference_cache(model, cache)
        ours = model(nxt, **_cache(cache), use_cache=True).logits[0, -1].double()
        model.set_attn_implementation("eager")
        try:
            theirs = model(nxt, **_cache(ref), use_cache=True).logits[0, -1].double()
            unwindowed = _unwindowed_logits(model, ref)
        finally:
            model.set_attn_implementation("turboquant")
    budget = 1e-4 if dtype == torch.float32 else 2e-2  # half precision: both sides round their own way
    assert ((ours - theirs).norm() / theirs.norm()).item() < budget
    assert ((ours - unwindowed).norm() / unwindowed.norm()).item() > 1e-3  # the options mattered


def _unwindowed_logits(model, ref):
    """The same step with the window, the soft-cap and the sinks turned off (patched on the model,
    then restored): what ignoring them would give."""
    text, attns = model.config, [layer.self_attn for layer in model.model.layers]
    saved = (text.sliding_window, [(getattr(a, "sliding_window", None), getattr(a, "attn_logit_softcapping", None),
                                    a.sinks.data.clone() if hasattr(a, "sinks") else None) for a in attns])
    try:
        text.sliding_window = 10 ** 6
        for attn in attns:
            attn.sliding_window = None
            attn.attn_logit_softcapping = None
            if hasattr(attn, "sinks"):
                attn.sinks.data.fill_(-1e4)
        copy = DynamicCache()
        for i, layer in enumerate(ref.layers):
            copy.update(layer.keys[:, :, :-1], layer.values[:, :, :-1], i)  # before the step ref just took
        return model(torch.tensor([[7]], device=model.device), **_cache(copy), use_cache=True).logits[0, -1].double()
    finally:
        text.sliding_window = saved[0]
        for attn, (window, softcap, sinks) in zip(attns, saved[1]):
            attn.sliding_window, attn.attn_logit_softcapping = window, softcap
            if sinks is not None:
                attn.sinks.data.copy_(sinks)


def test_load_from_refuses_a_sliding_layer_that_dropped_positions():
    model = _tiny_with_options("gemma3_window")
    prefilled = DynamicCache(config=model.config)  # its sliding layers keep the last 15 positions
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 40)), **_cache(prefilled), use_cache=True)
    cache = tqhf.TurboQuantCache(model.config, preset="turboquant_4bit_nc")
    with pytest.raises(ValueError, match="holds only its last 15 of 40 positions.*DynamicCache"):
        cache.load_from(prefilled)


@pytest.mark.parametrize("kind", ["gemma2_softcap_window", "gpt_oss_sinks_window"])
def test_calibrated_load_from_of_a_softcapped_or_sink_model_keeps_only_exact_transformations(kind):
    """load_from stores (and fits) before any attention call tells the layers their options: the
    cache knows them from the config, fits no key centering, and the next step attends as eager
    attention over what it holds."""
    model = _tiny_with_options(kind)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    prefilled = DynamicCache()
    with torch.no_grad():
        model(ids, **_cache(prefilled), use_cache=True)
        cache = tqhf.TurboQuantCache(model.config, preset="turboquant_4bit_nc", boundary_skip_layers=0,
                                     calibrate=True).load_from(prefilled)
        for i in cache.quantized_layers:
            t = cache.layers[i].attention.transform
            assert t.key_offset is None and t.key_scale is not None  # smoothing only: exact under both
        ref = _reference_cache(model, cache)
        nxt = torch.tensor([[7]])
        ours = model(nxt, **_cache(cache), use_cache=True).logits[0, -1].double()
        model.set_attn_implementation("eager")
        try:
            theirs = model(nxt, **_cache(ref), use_cache=True).logits[0, -1].double()
        finally:
            model.set_attn_implementation("turboquant")
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-4


def _round_tripping_cache(model, quantized: list[int], preset: str) -> DynamicCache:
    """transformers' own cache for the model's layer types (sliding layers included) whose layers in
    ``quantized`` store what a packed cache of ``preset`` decodes K/V to; their first update (a
    first prefill chunk) still attends to the raw K/V, as the packed layers do."""
    ref = DynamicCache(config=model.config)
    for i in quantized:
        layer, plain_update, round_trip = ref.layers[i], ref.layers[i].update, _round_trip(preset)
        first = [True]

        def update(k, v, *a, _up=plain_update, _rt=round_trip, _first=first, **kw):
            stored = _up(*_rt(k, v), *a, **kw)
            if _first[0]:
                _first[0] = False
                return k, v
            return stored
        layer.update = update
    return ref


@pytest.mark.parametrize("kind", OPTION_KINDS)
def test_option_models_with_plain_boundary_layers_match_eager_attention_step_by_step(kind):
    """Boundary layers plain (transformers' sliding-window cache for windowed ones, whose window-sized
    masks the packed layers then receive; soft-capping and sinks through the eager fallback), the
    others packed: a prefill and 6 decode steps with fixed tokens against eager attention over a
    cache that round-trips the packed layers' K/V."""
    model = _tiny_with_options(kind)
    ids = torch.randint(0, 256, (1, 47), generator=torch.Generator().manual_seed(2))
    preset = "turboquant_4bit_nc"
    cache = tqhf.TurboQuantCache(model.config, preset=preset, boundary_skip_layers=1)
    assert cache.quantized_layers == [1, 2]
    ref = _round_tripping_cache(model, cache.quantized_layers, preset)
    with torch.no_grad():
        ours = [model(ids[:, :41], **_cache(cache), use_cache=True).logits[0, -1]]
        ours += [model(ids[:, t:t + 1], **_cache(cache), use_cache=True).logits[0, -1] for t in range(41, 47)]
        model.set_attn_implementation("eager")
        try:
            theirs = [model(ids[:, :41], **_cache(ref), use_cache=True).logits[0, -1]]
            theirs += [model(ids[:, t:t + 1], **_cache(ref), use_cache=True).logits[0, -1] for t in range(41, 47)]
        finally:
            model.set_attn_implementation("turboquant")
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert ((a.double() - b.double()).norm() / b.double().norm()).item() < 1e-4, step


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_left_padded_batch_of_a_random_llama_generates_on_each_device(device):
    """The whole generate loop (left padding, growth past several blocks, every preset) on the
    device; tokens of a batch equal each prompt's alone where the plain run has no near-tie."""
    from transformers import LlamaConfig
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = _tiny(LlamaConfig).to(device, dtype)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 256, (n,), generator=g) for n in (5, 37, 20)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = p, 1
    for preset in tq.PRESETS:
        cache = tqhf.TurboQuantCache(model.config, preset=preset, boundary_skip_layers=1)
        out = _generate(model, ids.to(device), mask.to(device), cache=cache, steps=24)
        assert cache.sequences.lengths == [len(p) + 23 for p in prompts]
        for b, p in enumerate(prompts):
            alone = _generate(model, p.view(1, -1).to(device),
                              cache=tqhf.TurboQuantCache(model.config, preset=preset, boundary_skip_layers=1), steps=24)
            for step in range(24):
                top2 = alone.logits[step][0].float().topk(2).values
                if top2[0] - top2[1] < 0.5:
                    break
                assert out.sequences[b, width + step] == alone.sequences[0, len(p) + step], (preset, b, step)


@requires_cuda
def test_cuda_refuses_an_fp32_model():
    model = _tiny(Qwen2Config).to("cuda")
    cache = tqhf.TurboQuantCache(model.config, boundary_skip_layers=0)
    with pytest.raises(ValueError, match="fp16 and bf16 models"):
        model(torch.randint(0, 256, (1, 8), device="cuda"), **_cache(cache), use_cache=True)


def test_load_from_a_plain_prefill_equals_prefilling_through_the_packed_cache(smollm):
    """A first prefill chunk attends to its raw K/V either way, so loading transformers' cache after
    a plain prefill packs the same bytes and decodes the same next step."""
    model, tok = smollm
    ids = tok(PROMPTS[1], return_tensors="pt").input_ids
    plain, through = DynamicCache(), tqhf.TurboQuantCache(model.config, preset="turboquant_4bit_nc")
    with torch.no_grad():
        model(ids, **_cache(plain), use_cache=True)
        model(ids, **_cache(through), use_cache=True)
        loaded = tqhf.TurboQuantCache(model.config, preset="turboquant_4bit_nc").load_from(plain)
        for i in loaded.quantized_layers:
            assert torch.equal(loaded.layers[i].attention.cache, through.layers[i].attention.cache)
        nxt = torch.tensor([[tok.encode(" the")[0]]])
        a = model(nxt, **_cache(loaded), use_cache=True).logits
        b = model(nxt, **_cache(through), use_cache=True).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="fills an empty TurboQuantCache"):
        loaded.load_from(plain)


def test_readme_transformers_example_runs(smollm):
    import subprocess
    import sys
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "python"))
    result = subprocess.run([sys.executable, os.path.join(root, "examples", "hf_generate.py")], capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert "The capital of France is Paris" in result.stdout
    assert "bytes of K/V" in result.stdout


def test_main_job_prints_the_real_model_report(smollm):
    import subprocess
    import sys
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "python"))
    result = subprocess.run([sys.executable, "-m", "turboquant.demo", "--device", "cpu", "--new-tokens", "4",
                             "--ppl-windows", "1", "--ppl-window", "64"], capture_output=True, text=True, timeout=600,
                            env=env)
    assert result.returncode == 0, result.stderr
    for name in ["plain (transformers)"] + [p.replace("turboquant_", "") for p in tq.PRESETS]:
        assert f"| {name} |" in result.stdout
    assert "Prompt: What is the capital of France?" in result.stdout
