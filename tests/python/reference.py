"""Slow, obvious plain-torch references written independently of the library's C++ code:
the Hadamard matrix from its popcount formula, bucketing with torch.bucketize, bit packing with
Python integers, attention in float64."""

from __future__ import annotations

import math

import torch

import turboquant as tq


def sylvester_matrix(d: int) -> torch.Tensor:
    """+-1 entries (-1)^popcount(i & j); d a power of two."""
    i = torch.arange(d)
    bits = (i[:, None] & i[None, :]).to(torch.int64)
    popcount = torch.zeros_like(bits)
    for b in range(int(math.log2(d)) + 1):
        popcount += (bits >> b) & 1
    return (1.0 - 2.0 * (popcount % 2)).to(torch.float64)


def _gf(q: int):
    """GF(q) for q = 5, 13 (integers mod q) and 9 (GF(3)[i], i^2 = -1, element a + 3b <-> a + b i):
    (subtract, multiply) on element indices."""
    if q in (5, 13):
        return (lambda x, y: (x - y) % q), (lambda x, y: (x * y) % q)

    def sub(x, y):
        return (x % 3 - y % 3) % 3 + 3 * ((x // 3 - y // 3) % 3)

    def mul(x, y):
        a, b, c, e = x % 3, x // 3, y % 3, y // 3
        return (a * c - b * e) % 3 + 3 * ((a * e + b * c) % 3)
    return sub, mul


def paley_matrix(m: int) -> torch.Tensor:
    """Paley's second construction of a symmetric Hadamard matrix of order m = 2(q + 1), built from
    its definition: the conference matrix C of GF(q)'s quadratic character, then
    C (x) [[1, -1], [-1, -1]] + I (x) [[1, 1], [1, -1]]."""
    q = m // 2 - 1
    sub, mul = _gf(q)
    squares = {mul(y, y) for y in range(1, q)}
    chi = [0] + [1 if x in squares else -1 for x in range(1, q)]
    conference = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    conference[0, 1:] = conference[1:, 0] = 1
    for i in range(q):
        for j in range(q):
            conference[i + 1, j + 1] = chi[sub(i, j)]
    off = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    diag = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    return torch.kron(conference, off) + torch.kron(torch.eye(q + 1, dtype=torch.float64), diag)


def hadamard_matrix(d: int) -> torch.Tensor:
    """The orthonormal key rotation H_m (x) H_{2^k} / sqrt(d), m the factor 1, 12, 20 or 28 of d."""
    odd = d
    while odd % 2 == 0:
        odd //= 2
    m = {1: 1, 3: 12, 5: 20, 7: 28}[odd]
    factor = torch.ones(1, 1, dtype=torch.float64) if m == 1 else paley_matrix(m)
    return torch.kron(factor, sylvester_matrix(d // m)) / math.sqrt(d)


def pack_bits(idx: list[int], bits: int) -> bytes:
    """Little-endian bit stream: index i occupies bits [bits*i, bits*i + bits)."""
    acc = 0
    for i, v in enumerate(idx):
        acc |= int(v) << (bits * i)
    return acc.to_bytes((len(idx) * bits + 7) // 8, "little")


def unpack_bits(data: bytes, count: int, bits: int) -> list[int]:
    acc = int.from_bytes(bytes(data), "little")
    return [(acc >> (bits * i)) & ((1 << bits) - 1) for i in range(count)]


def half_bytes(x: float) -> bytes:
    return bytes(torch.tensor([x], dtype=torch.float32).half().view(torch.uint8).tolist())


def half_value(data: bytes) -> float:
    return torch.tensor(list(data), dtype=torch.uint8).view(torch.float16).item()


def key_norm_reference(key: torch.Tensor, indices: torch.Tensor, preset: str) -> bytes:
    """The stored fp16 key norm (Lloyd-Max keys) of `key` with these centroid indices: ||key||,
    divided by the centroid vector's norm for norm-corrected presets, saturated at 65504."""
    info = tq.preset_info(preset)
    centroids, _ = tq.codebook(info.key_bits, key.numel())
    norm = key.to(torch.float64).norm().item()
    c = centroids.to(torch.float64)[indices]
    stored = norm / c.norm().item() if info.norm_correction else norm
    return half_bytes(min(stored, 65504.0))


def encode_slot_reference(key: torch.Tensor, value: torch.Tensor, preset: str):
    """Reference encoding of one (token, head): returns (slot bytes, key-index ambiguity mask).

    Key indices whose rotated coordinate lies within float rounding of a midpoint are flagged
    ambiguous: fp32 summation order may put them in either cell.
    """
    info = tq.preset_info(preset)
    layout = tq.slot_layout(preset, key.numel())
    d = key.numel()
    out = bytearray(layout.slot_size_aligned)
    ambiguous = torch.zeros(d, dtype=torch.bool)
    k32 = key.to(torch.float32)
    if info.key_format == "fp8_e4m3":
        fp8 = k32.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
        out[0:d] = bytes(fp8.tolist())
    else:
        _, midpoints = tq.codebook(info.key_bits, d)
        k64 = key.to(torch.float64)
        norm = k64.norm().item()
        y = hadamard_matrix(d) @ (k64 / (norm + 1e-8))
        idx = torch.bucketize(y, midpoints.to(torch.float64), right=True)  # count of midpoints <= y
        gap = (y[:, None] - midpoints.to(torch.float64)[None, :]).abs().min(dim=1).values
        ambiguous = gap < 1e-6 * (abs(midpoints[-1].item()) + 1.0)
        out[0:layout.key_data_bytes] = pack_bits(idx.tolist(), info.key_bits)
        out[layout.key_norm_offset:layout.key_norm_offset + 2] = key_norm_reference(key, idx, preset)
    v32 = value.to(torch.float32)
    # + 0.0: a zero min or max is stored as +0, whatever its sign. SPEC's fp16(min) leaves the sign
    # of a zero min to the order in which a reduction met +0 and -0; the library fixes it
    # (include/turboquant/quantize.h), so an all -0.0 vector stores zero = 0x0000, not 0x8000.
    vmin, vmax = v32.min() + 0.0, v32.max() + 0.0
    levels = (1 << info.value_bits) - 1
    scale = ((vmax - vmin) / levels).half().float()  # fp32 arithmetic, then the stored fp16
    zero = vmin.half().float()
    if scale.item() == 0.0:
        codes = torch.zeros(d, dtype=torch.int64)
    else:
        codes = torch.floor((v32 - zero) / scale + 0.5).clamp(0, levels).to(torch.int64)
    off = layout.value_data_offset
    out[off:off + layout.value_data_bytes] = pack_bits(codes.tolist(), info.value_bits)
    out[layout.value_scale_offset:layout.value_scale_offset + 2] = half_bytes(scale.item())
    out[layout.value_zero_offset:layout.value_zero_offset + 2] = half_bytes(zero.item())
    return bytes(out), ambiguous


def decode_slot_reference(slot: bytes, preset: str, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(key in original basis, value, centroids c~ in the rotated basis) in float64."""
    info = tq.preset_info(preset)
    layout = tq.slot_layout(preset, head_dim)
    if info.key_format == "fp8_e4m3":
        key = torch.tensor(list(slot[:head_dim]), dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
        c = key
    else:
        centroids, _ = tq.codebook(info.key_bits, head_dim)
        idx = unpack_bits(slot[:layout.key_data_bytes], head_dim, info.key_bits)
        c = centroids.to(torch.float64)[torch.tensor(idx)]
        norm = half_value(slot[layout.key_norm_offset:layout.key_norm_offset + 2])
        key = norm * (hadamard_matrix(head_dim) @ c)
    off = layout.value_data_offset
    codes = torch.tensor(unpack_bits(slot[off:off + layout.value_data_bytes], head_dim, info.value_bits),
                         dtype=torch.float64)
    scale = half_value(slot[layout.value_scale_offset:layout.value_scale_offset + 2])
    zero = half_value(slot[layout.value_zero_offset:layout.value_zero_offset + 2])
    return key, codes * scale + zero, c


def attention_reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_lens: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """float64 decode attention. query [B, Hq, D]; keys/values [B, L, Hkv, D] (dense)."""
    b_count, hq, d = query.shape
    hkv = keys.shape[2]
    out = torch.zeros(b_count, hq, d, dtype=torch.float64)
    for b in range(b_count):
        n = int(seq_lens[b])
        if n <= 0:
            continue
        k = keys[b, :n].to(torch.float64).repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        v = values[b, :n].to(torch.float64).repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("hd,nhd->hn", query[b].to(torch.float64), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.to(torch.float64), b.to(torch.float64)
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _option_scores(query, keys, seq_lens, q_lens, scale, window_left=-1, softcap=0.0, sinks=None, key_bias=None):
    """Per query row in order: its float64 logits [Hq, t] over the positions it sees (soft-capped,
    plus ``key_bias [total_q, Hq, L]`` where given, each head's sink appended as one more column)
    and those positions' slice, or None where it sees nothing (the rules of
    attention_options_reference)."""
    row = 0
    group = query.shape[1] // keys.shape[2]
    for b, (n, m) in enumerate(zip([int(x) for x in seq_lens], q_lens)):
        k = keys[b].to(torch.float64).repeat_interleave(group, dim=1)
        for i in range(m):
            q = query[row].to(torch.float64)
            row += 1
            end = min(max(n - m + 1 + i, 0), n)  # positions < end are causal
            start = max(end - 1 - window_left, 0) if window_left >= 0 else 0
            if end <= start:
                yield (None if sinks is None else sinks.to(torch.float64)[:, None]), b, slice(start, start)
                continue
            s = torch.einsum("hd,thd->ht", q, k[start:end]) * scale
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            if key_bias is not None:
                s = s + key_bias[row - 1, :, start:end].to(torch.float64)
            if sinks is not None:
                s = torch.cat([s, sinks.to(torch.float64)[:, None]], dim=1)
            yield s, b, slice(start, end)


def attention_options_reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_lens, q_lens,
                                scale: float, window_left: int = -1, softcap: float = 0.0,
                                sinks: torch.Tensor | None = None, key_bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 attention with the ops' options, written from their definitions. query [total_q, Hq, D]
    (q_lens[b] rows per sequence, a plain decode has one each); keys/values [B, L, Hkv, D]. Row i of
    sequence b is at position p = seq_len_b - q_len_b + i and sees positions [p - window_left, p]
    (all of [0, p] for window_left < 0); logits s = scale * q.k, soft-capped to softcap * tanh(s / softcap);
    each head's sink logit joins the softmax and carries no value. Zeros where nothing is seen."""
    out = []
    group = query.shape[1] // keys.shape[2]
    for s, b, seen in _option_scores(query, keys, seq_lens, q_lens, scale, window_left, softcap, sinks, key_bias):
        if seen.stop <= seen.start:
            out.append(torch.zeros(query.shape[1:], dtype=torch.float64))
            continue
        v = values[b, seen].to(torch.float64).repeat_interleave(group, dim=1)
        p = s.softmax(-1)[:, :seen.stop - seen.start]
        out.append(torch.einsum("ht,thd->hd", p, v))
    return torch.stack(out)


def log_sum_exp_reference(query: torch.Tensor, keys: torch.Tensor, seq_lens, q_lens, scale: float, window_left: int = -1,
                          softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """float64 [total_q, Hq]: the log of each row's softmax denominator under the same rules (the sink
    included), -inf where the row sees nothing."""
    rows = []
    for s, _, _ in _option_scores(query, keys, seq_lens, q_lens, scale, window_left, softcap, sinks):
        rows.append(torch.full((query.shape[1],), -math.inf, dtype=torch.float64) if s is None else s.logsumexp(-1))
    return torch.stack(rows)


def packed_shift_reference(query, stored_keys, transform, preset, scale):
    """float64 ``[T, Hq]``: how much a packed key's logit is lowered (turboquant.packed_noise), from its
    definition: half the logit noise's variance s² ‖q‖² m mean‖k‖² / D in the stored basis, m the
    codebook's error for a unit Gaussian (0 for FP8 keys), the mean over ``stored_keys [N, Hkv, D]``
    (original basis; ``transform`` a layer's KVTransform or None)."""
    info = tq.preset_info(preset)
    mse = tq.lloyd_max_gaussian(info.key_bits)["mse"] if info.key_format == "lloyd_max" else 0.0  # FP8: none
    k, q = stored_keys.double(), query.double()
    group = q.shape[1] // k.shape[1]
    if transform is not None and transform.key_offset is not None:
        k = k - transform.key_offset.double().cpu()
    if transform is not None and transform.key_scale is not None:
        k = k / transform.key_scale.double().cpu()
        q = q * transform.key_scale.double().cpu().repeat_interleave(group, 0)
    mean = k.pow(2).sum(-1).mean(0).repeat_interleave(group)
    return 0.5 * mse * scale * scale * q.pow(2).sum(-1) * mean / k.shape[-1]
