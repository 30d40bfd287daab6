"""Hugging Face ``transformers`` integration: a packed TurboQuant KV cache for ``generate``.

    import turboquant.hf
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="turboquant")
    cache = turboquant.hf.TurboQuantCache(model.config, preset="turboquant_4bit_nc")
    out = model.generate(**inputs, cache=cache, max_new_tokens=128)

Importing this module registers the attention implementation ``"turboquant"``
(``AttentionInterface``, with SDPA's mask function). A layer of a ``TurboQuantCache`` keeps its K/V
only in the packed paged cache and runs attention with the serving semantics of
:class:`turboquant.attention.PagedAttentionLayer`, the same as vLLM's TurboQuant backend:

* a first prefill chunk attends to its raw K/V (SDPA, causal) while ``store_kv`` packs it;
* one-token steps run ``decode`` on the packed cache;
* later multi-token chunks (chunked prefill, multi-turn, speculative verification) run
  ``decode_varlen`` up to ``varlen_threshold`` tokens, else SDPA over the dequantized prefix and
  the chunk's own raw K/V.

Sliding-window layers (Mistral, Gemma 2/3, gpt-oss), logit soft-capping (Gemma 2) and attention
sinks (gpt-oss) are served by the ops' attention options: a windowed decode reads only its
window's blocks (the packed cache still holds every token of the sequence). Boundary layers (the
first and last ``boundary_skip_layers``) and layers the ops do not serve (chunked attention, an
unsupported head_dim) keep transformers' own plain cache and SDPA; the latter are named once in a
warning. Padding
tokens (a left-padded batch) never enter the packed cache: each sequence holds only its own
tokens, so a batch attends exactly as each prompt alone would. The packed cache grows in blocks
as generation proceeds.

With any other cache (or none) a model loaded with ``attn_implementation="turboquant"`` runs SDPA
unchanged.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass

import torch

try:
    from transformers import AttentionInterface, LlamaForCausalLM
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, CacheLayerMixin, get_layer_types_and_kwargs
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as exc:  # pragma: no cover - only without transformers
    raise ImportError(
        f"turboquant.hf needs Hugging Face transformers 5.x ({exc}); install it with `pip install 'transformers>=5.25'`"
    ) from exc

from .attention import PagedAttentionLayer, StepMetadata, bottom_right_mask, dense_attention
from .calibration import Calibration, as_calibration
from .cache import SUPPORTED_BLOCK_SIZES, boundary_skip_layers as _boundary_layers
from .presets import PRESETS, slot_layout

ATTN_IMPLEMENTATION = "turboquant"
# The keyword that passes a cache to ``generate`` and ``forward``: ``cache`` since transformers
# renamed it (``past_key_values`` still works there, with a FutureWarning), ``past_key_values`` before.
CACHE_KWARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
_ENABLE_HINT = (
    "load the model with `AutoModelForCausalLM.from_pretrained(..., attn_implementation=\"turboquant\")` after "
    "`import turboquant.hf` (or call `model.set_attn_implementation(\"turboquant\")`)"
)


# ---- attention ----------------------------------------------------------------------------------
def turboquant_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The ``"turboquant"`` attention: packed-cache attention for the layers of a
    :class:`TurboQuantCache` that it quantizes, transformers' SDPA for every other layer."""
    layer = getattr(key, "_turboquant_layer", None)
    if layer is None:
        return _plain_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if dropout and module.training:
        raise ValueError("turboquant: attention dropout is not supported on a packed cache (an inference cache)")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # transformers' sliding_window W: a query sees its W most recent positions, itself included.
    window = kwargs.get("sliding_window")
    layer.attention.set_attention_options(window_left=int(window) - 1 if window else -1,
                                          softcap=float(kwargs.get("softcap") or 0.0), sinks=kwargs.get("s_aux"))
    return layer.attend(query, attention_mask, float(scale)), None



def _plain_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs):
    """A layer that keeps a plain cache: transformers' SDPA, or, where the model soft-caps its
    logits or has attention sinks (which SDPA does not implement), eager attention in fp32 with the
    same definitions as the ops (``turboquant.attention.dense_attention``)."""
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if not softcap and sinks is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout and module.training:
        raise ValueError("turboquant: attention dropout is not supported with soft-capping or sinks")
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None:  # no padding: causal, the last query row at the last key
        mask = bottom_right_mask(q_len, kv_len, device=query.device)[None, None]
    elif attention_mask.dtype == torch.bool:
        mask = attention_mask[..., :kv_len]
    else:  # additive: 0 where attended
        mask = attention_mask[..., :kv_len] > torch.finfo(attention_mask.dtype).min / 2
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = dense_attention(query, key, value, mask, float(scale), float(softcap or 0.0), sinks)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, turboquant_attention)
# The plain layers take SDPA's mask as it is; the packed layers read which new tokens are padding
# from its diagonal (_new_token_mask).
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


# ---- which tokens of each sequence the packed cache holds -------------------------------------
def _new_token_mask(attention_mask, batch: int, q_len: int) -> torch.Tensor:
    """``[batch, q_len]`` bool on the CPU: which of the step's tokens are real (not padding).

    ``attention_mask`` is the 4D mask of the step (or None: no padding). Padding keys are masked
    for every query, and a real token's query sees its own key under every mask (causal or
    windowed), so the diagonal of the step's own positions says which of them are tokens. Its last
    columns are the step's positions whether the mask spans the whole context or, for windowed
    layers, only the window (a sliding mask sized by a plain sliding layer). Bool masks attend where
    True, float masks where 0.
    """
    if attention_mask is None:
        return torch.ones(batch, q_len, dtype=torch.bool)
    own = torch.arange(q_len, device=attention_mask.device)
    row = attention_mask[:, 0, attention_mask.shape[2] - q_len + own, attention_mask.shape[3] - q_len + own]
    if row.dtype != torch.bool:
        row = row > torch.finfo(row.dtype).min / 2
    return row.expand(batch, q_len).cpu()


@dataclass
class _Step:
    """One forward step, planned once and shared by every packed layer."""

    key: tuple[int, int]  # (positions before the step, query length)
    meta: StepMetadata
    rows: torch.Tensor | None  # flat [batch * q_len] indices of the rows attended, None: all of them
    num_blocks: int  # blocks each packed layer's pool must have


class _PagedSequences:
    """Block tables and token counts of a batch of sequences, shared by the packed layers.

    Every packed layer holds the same tokens of the same sequences, so they share one block
    table and one slot mapping per step; each layer has its own pool of blocks, the same size.
    Book-keeping lives on the host (lists of ints), so planning a step needs no device sync.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.reset()

    def reset(self) -> None:
        self.lengths: list[int] = []  # tokens each sequence holds (padding excluded)
        self.blocks: list[list[int]] = []  # block ids of each sequence, in order
        self.real: torch.Tensor | None = None  # [batch, positions] bool: which positions are tokens
        self.next_block = 0  # blocks handed out so far (ids are never reused: pools only grow)
        self.step: _Step | None = None

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def plan(self, past: int, q_len: int, attention_mask, batch: int, device) -> _Step:
        """The step at ``past`` positions with ``q_len`` new tokens per sequence (once per step)."""
        if self.step is not None and self.step.key == (past, q_len):
            return self.step
        if not self.lengths:
            self.lengths, self.blocks = [0] * batch, [[] for _ in range(batch)]
            self.real = torch.zeros(batch, 0, dtype=torch.bool)
        if batch != self.batch_size:
            raise ValueError(f"turboquant: the cache holds {self.batch_size} sequences, this step has {batch}; "
                             "a TurboQuantCache serves one batch (reset() it or make a new one)")
        if self.real.shape[1] != past:
            raise RuntimeError(f"turboquant: internal error, the cache has {self.real.shape[1]} positions, the step "
                               f"starts at {past}")
        real = _new_token_mask(attention_mask, batch, q_len)
        self.real = torch.cat([self.real, real], dim=1)
        counts, real = real.sum(1).tolist(), real.tolist()
        bs = self.block_size
        slots, starts, seqs, rows = [], [0], [], []
        for b in range(batch):
            if q_len > 1 and counts[b] == 0:
                continue  # nothing of this sequence in a multi-token step: it takes no part
            seqs.append(b)
            first = self.lengths[b]
            self.lengths[b] += counts[b]
            while len(self.blocks[b]) * bs < self.lengths[b]:
                self.blocks[b].append(self.next_block)
                self.next_block += 1
            pos = first
            for t in range(q_len):
                if real[b][t]:
                    slots.append(self.blocks[b][pos // bs] * bs + pos % bs)
                    rows.append(b * q_len + t)
                    pos += 1
                elif q_len == 1:  # a padded decode row still runs (its output is not used): store nothing
                    slots.append(-1)
                    rows.append(b * q_len + t)
            starts.append(len(rows))
        meta = StepMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32).to(device),
            seq_lens=torch.tensor([self.lengths[b] for b in seqs], dtype=torch.int32).to(device),
            block_table=self.table(seqs, device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
            num_decodes=len(seqs) if q_len == 1 else 0,
            sequence_ids=torch.tensor(seqs, dtype=torch.long).to(device),
            num_sequences=batch,
        )
        all_rows = len(rows) == batch * q_len
        self.step = _Step((past, q_len), meta, None if all_rows else torch.tensor(rows, device=device),
                          self.next_block)
        return self.step

    def table(self, seqs: list[int], device) -> torch.Tensor:
        """The block table of sequences ``seqs`` (int32, one row each, zeros past their blocks)."""
        width = max(1, max(len(self.blocks[b]) for b in seqs)) if seqs else 1
        table = torch.zeros(len(seqs), width, dtype=torch.int32)
        for i, b in enumerate(seqs):
            table[i, :len(self.blocks[b])] = torch.tensor(self.blocks[b], dtype=torch.int32)
        return table.to(device)

    def crop(self, positions: int) -> None:
        """Forgets the last ``positions`` positions of every sequence."""
        if positions <= 0 or self.real is None:
            return
        dropped = self.real[:, -positions:].sum(1).tolist()
        self.real = self.real[:, :-positions]
        self.lengths = [n - d for n, d in zip(self.lengths, dropped)]
        self.step = None

    def select(self, rows: list[int]) -> list[int]:
        """Makes sequence ``i`` a copy of sequence ``rows[i]`` (beam reordering, repetition,
        selection). Returns, for each new block id in order, the old block it copies: every new
        sequence gets blocks of its own, so two copies of a sequence never write one block."""
        if self.real is None:
            return []
        old_ids, new_blocks = [], []
        for r in rows:
            ids = list(range(len(old_ids), len(old_ids) + len(self.blocks[r])))
            old_ids += self.blocks[r]
            new_blocks.append(ids)
        self.blocks, self.lengths = new_blocks, [self.lengths[r] for r in rows]
        self.real = self.real[torch.tensor(rows, dtype=torch.long)]
        self.next_block = len(old_ids)
        self.step = None
        return old_ids


# ---- cache layers -------------------------------------------------------------------------------
class TurboQuantLayer(CacheLayerMixin):
    """One attention layer's K/V in the packed paged cache. ``update`` hands the step's raw K/V to
    the ``"turboquant"`` attention, which stores them and attends (it needs the step's mask to
    know which tokens are padding)."""

    is_sliding = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, layer_idx: int, preset: str, sequences: _PagedSequences, varlen_threshold: int,
                 reserve_tokens: int | None = None, calibration: Calibration | None = None, exact_recent: int = 0,
                 exact_first: int = 0, shift_packed_logits: bool = False):
        super().__init__()
        self.layer_idx, self.preset, self.sequences = layer_idx, preset, sequences
        self.varlen_threshold, self.reserve_tokens = varlen_threshold, reserve_tokens
        self.calibration, self.exact_recent, self.exact_first = calibration, exact_recent, exact_first
        self.shift_packed_logits = shift_packed_logits
        self.attention: PagedAttentionLayer | None = None
        self.length = 0  # positions seen, padding included (what transformers counts)
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states, value_states) -> None:
        if key_states.is_cuda and key_states.dtype == torch.float32:
            raise ValueError("turboquant: on CUDA the packed cache serves fp16 and bf16 models (the decode kernels take "
                             "fp16/bf16 queries); load the model with dtype=torch.bfloat16 or torch.float16")
        batch, num_kv_heads, _, head_dim = key_states.shape
        block_size = self.sequences.block_size
        blocks = 1 if self.reserve_tokens is None else batch * -(-self.reserve_tokens // block_size)
        self.attention = PagedAttentionLayer(blocks, block_size, num_kv_heads, head_dim, self.preset,
                                             device=key_states.device, dtype=key_states.dtype,
                                             varlen_threshold=self.varlen_threshold, calibration=self.calibration,
                                             exact_recent=self.exact_recent, exact_first=self.exact_first,
                                             shift_packed_logits=self.shift_packed_logits)
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._pending is not None:
            raise RuntimeError(f"turboquant: layer {self.layer_idx}'s previous K/V never reached the packed cache: the "
                               f"model's attention is not the \"turboquant\" implementation; {_ENABLE_HINT}")
        self._pending = (key_states, value_states)
        self.length += key_states.shape[2]
        key_states._turboquant_layer = self
        return key_states, value_states

    def attend(self, query: torch.Tensor, attention_mask, scale: float) -> torch.Tensor:
        """query ``[B, Hq, T, D]`` -> attention output ``[B, T, Hq, D]`` (stores the step's K/V first)."""
        key, value = self._pending
        self._pending = None
        batch, q_heads, q_len, head_dim = query.shape
        step = self.sequences.plan(self.length - q_len, q_len, attention_mask, batch, query.device)
        if self.attention.cache.shape[0] < step.num_blocks:  # grow geometrically: few copies in a long run
            self.attention.grow(max(step.num_blocks, 2 * self.attention.cache.shape[0]))
        q = query.transpose(1, 2).reshape(batch * q_len, q_heads, head_dim)
        k = key.transpose(1, 2).reshape(batch * q_len, key.shape[1], head_dim)
        v = value.transpose(1, 2).reshape(batch * q_len, value.shape[1], head_dim)
        if step.rows is not None:
            q, k, v = (t.index_select(0, step.rows) for t in (q, k, v))
        out = self.attention.forward(q.contiguous(), k.contiguous(), v.contiguous(), step.meta, scale)
        if step.rows is not None:  # padding rows: zeros
            out = torch.zeros(batch * q_len, q_heads, head_dim, dtype=out.dtype, device=out.device).index_copy_(
                0, step.rows, out)
        return out.view(batch, q_len, q_heads, head_dim)

    def store(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Packs K/V ``[B, Hkv, T, D]`` of real tokens (no padding) without attending."""
        if not self.is_initialized:
            self.lazy_initialization(key, value)
        batch, _, q_len, head_dim = key.shape
        self.length += q_len
        step = self.sequences.plan(self.length - q_len, q_len, None, batch, key.device)
        if self.attention.cache.shape[0] < step.num_blocks:
            self.attention.grow(max(step.num_blocks, 2 * self.attention.cache.shape[0]))
        k, v = (t.transpose(1, 2).reshape(batch * q_len, t.shape[1], head_dim).contiguous() for t in (key, value))
        self.attention.store(k, v, step.meta)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.attention, self.length, self._pending, self.is_initialized = None, 0, None, False

    def crop(self, tokens_to_remove: int) -> None:
        """``tokens_to_remove < 0`` positions are forgotten (transformers' convention); the shared
        block tables are cropped once by the cache."""
        if tokens_to_remove > 0:
            raise ValueError(f"turboquant: crop takes a negative count of positions to remove, got {tokens_to_remove}")
        self.length += tokens_to_remove

    def copy_blocks(self, old_ids: list[int], rows: list[int]) -> None:
        """New block ``i`` := old block ``old_ids[i]``, and sequence ``j`` takes sequence ``rows[j]``'s
        exact tokens (see ``_PagedSequences.select``)."""
        if self.attention is None:
            return
        for exact in self.attention.exact_tokens:
            exact.select(rows)
        if not old_ids:
            return
        pool = self.attention.cache
        picked = pool.index_select(0, torch.tensor(old_ids, dtype=torch.long, device=pool.device))
        self.attention.cache = torch.cat([picked, pool[:max(0, pool.shape[0] - len(old_ids))]])

    def offload(self):
        raise NotImplementedError("turboquant: a TurboQuantCache does not offload (it is already compressed)")

    prefetch = offload


def _has_attention_sinks(config) -> bool:
    """Whether transformers gives the model's attention per-head sinks (``s_aux``): gpt-oss."""
    return getattr(config, "model_type", "") == "gpt_oss"


def _unsupported_reason(layer_type: str, head_dim: int, preset: str) -> str | None:
    if layer_type not in ("full_attention", "sliding_attention"):
        return f"{layer_type} layers"
    try:
        slot_layout(preset, head_dim)
    except ValueError:
        return f"head_dim {head_dim} with {preset}"
    return None


class TurboQuantCache(Cache):
    """A ``transformers`` cache that keeps each attention layer's K/V packed at 3-4 bits.

    Args:
        config: the model's config (``model.config``); the model must use
            ``attn_implementation="turboquant"``.
        preset: one of ``turboquant.PRESETS``.
        boundary_skip_layers: the first and last this many layers keep a plain cache (capped at
            half of the layers), as vLLM's TurboQuant does; 0 quantizes every layer.
        skip_layers: layer indices to keep plain instead (overrides ``boundary_skip_layers``).
        block_size: tokens per cache block (16, 32, 64 or 128).
        varlen_threshold: multi-token chunks up to this many tokens attend through
            ``decode_varlen``, longer ones through SDPA over the dequantized prefix.
        reserve_tokens: reserve this many tokens per sequence at the first step instead of
            growing the cache as generation proceeds.
        calibrate: exact per-head transformations of K/V fitted on the first prefill
            (``turboquant.calibration``): ``True`` for the default recipe (per head, keys centered,
            centered and smoothed, or left, whichever gives the first chunk's queries the smallest
            attention error), a ``Calibration`` to choose, ``None`` for none. Same bytes per token;
            attention is unchanged up to the quantization, which loses less on keys with a shared
            offset or a few wide channels. Layers that soft-cap or have sinks keep only the
            transformations that stay exact there (``Calibration.exact_for``). Where keys are
            centered, each sequence's first block is also kept raw (``Calibration.exact_first_block``).
        exact_recent: each sequence's last this many tokens also kept raw beside the packed cache
            and attended exactly (``turboquant.recent``): most of a long generation's loss is on
            its last tokens (SmolLM2 4bit_nc, decode perplexity: +6.2 % with 0, +0.9 % with 64;
            docs/QUALITY.md). Costs ``exact_recent x 2 x head_dim`` raw elements per sequence, KV
            head and layer, and an exact attention over them per decode step.
        shift_packed_logits: where raw keys (``exact_recent``, the first block, a chunk's own K/V)
            share a softmax with packed ones, lower the packed keys' logits by their expected
            quantization noise, which otherwise gives them too much of the attention
            (``turboquant.packed_noise``). Off by default: it helps some models and presets a lot
            and others not, and it is no better with ``calibrate=True, exact_recent=64``.
    """

    def __init__(self, config, preset: str = "turboquant_4bit_nc", boundary_skip_layers: int = 2,
                 skip_layers=None, block_size: int = 16, varlen_threshold: int = 64, reserve_tokens: int | None = None,
                 calibrate=None, exact_recent: int = 0, shift_packed_logits: bool = False):
        text_config = config.get_text_config(decoder=True)
        impl = getattr(text_config, "_attn_implementation", None)
        if impl != ATTN_IMPLEMENTATION:
            raise ValueError(f"turboquant: TurboQuantCache needs the model's attention implementation to be "
                             f"\"turboquant\", it is {impl!r}: {_ENABLE_HINT}")
        if preset not in PRESETS:
            raise ValueError(f"turboquant: preset must be one of {', '.join(PRESETS)}; got {preset!r}")
        if block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"turboquant: block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {block_size!r}")
        if not isinstance(boundary_skip_layers, int) or boundary_skip_layers < 0:
            raise ValueError(f"turboquant: boundary_skip_layers must be an int >= 0, got {boundary_skip_layers!r}")
        if not isinstance(varlen_threshold, int) or varlen_threshold < 0:
            raise ValueError(f"turboquant: varlen_threshold must be an int >= 0, got {varlen_threshold!r}")
        if reserve_tokens is not None and (not isinstance(reserve_tokens, int) or reserve_tokens <= 0):
            raise ValueError(f"turboquant: reserve_tokens must be a positive int or None, got {reserve_tokens!r}")
        if not isinstance(exact_recent, int) or isinstance(exact_recent, bool) or exact_recent < 0:
            raise ValueError(f"turboquant: exact_recent must be an int >= 0 (tokens), got {exact_recent!r}")
        if not isinstance(shift_packed_logits, bool):
            raise ValueError(f"turboquant: shift_packed_logits must be True or False, got {shift_packed_logits!r}")
        calibration = as_calibration(calibrate)
        # What stays exact under the model's soft-capping and sinks, known here from the config: a
        # load_from stores (and fits) before the first attention call passes them.
        exact = None if calibration is None else calibration.exact_for(
            softcap=bool(getattr(text_config, "attn_logit_softcapping", None)),
            sinks=_has_attention_sinks(text_config))
        exact_first = block_size if exact is not None and exact.exact_first_block and exact.center_keys else 0
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
        if isinstance(layer_kwargs, dict):  # transformers before 5.2x: one dict for every layer
            layer_kwargs = [layer_kwargs] * len(layer_types)
        num_layers = len(layer_types)
        if skip_layers is None:
            skip = set(_boundary_layers(num_layers, boundary_skip_layers))
        else:
            skip = {int(i) for i in skip_layers}
            bad = sorted(i for i in skip if not 0 <= i < num_layers)
            if bad:
                raise ValueError(f"turboquant: skip_layers must be layer indices in [0, {num_layers}), got {bad}")
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        self.preset, self.sequences = preset, _PagedSequences(block_size)
        layers, unserved = [], {}
        for i, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
            reason = None if i in skip else _unsupported_reason(layer_type, head_dim, preset)
            if reason is not None:
                unserved.setdefault(reason, []).append(i)
            if i in skip or reason is not None:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[layer_type](**kwargs))
            else:
                layers.append(TurboQuantLayer(i, preset, self.sequences, varlen_threshold, reserve_tokens, exact,
                                              exact_recent, exact_first, shift_packed_logits))
        for reason, indices in unserved.items():
            warnings.warn(f"turboquant: layers {indices} keep a plain cache: the packed cache does not serve "
                          f"{reason} yet", stacklevel=2)
        self.quantized_layers = [i for i, layer in enumerate(layers) if isinstance(layer, TurboQuantLayer)]
        super().__init__(layers=layers)

    # ---- batch-wide edits: the shared block tables change once, then every layer follows -------
    def _select(self, rows: list[int]) -> None:
        old_ids = self.sequences.select(rows)
        for i in self.quantized_layers:
            self.layers[i].copy_blocks(old_ids, rows)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for i, layer in enumerate(self.layers):
            if i not in self.quantized_layers:
                layer.reorder_cache(beam_idx)
        self._select(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        for i, layer in enumerate(self.layers):
            if i not in self.quantized_layers:
                layer.batch_repeat_interleave(repeats)
        self._select([b for b in range(self.sequences.batch_size) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for i, layer in enumerate(self.layers):
            if i not in self.quantized_layers:
                layer.batch_select_indices(indices)
        self._select(torch.as_tensor(indices).tolist())

    def crop(self, tokens_to_remove: int) -> None:
        """Forgets the last ``-tokens_to_remove`` positions (a negative count, as transformers'
        own caches take it), e.g. the rejected tokens of assisted generation."""
        if tokens_to_remove > 0:
            raise ValueError(f"turboquant: crop takes a negative count of positions to remove, got {tokens_to_remove}")
        super().crop(tokens_to_remove)
        self.sequences.crop(-tokens_to_remove)
        for i in self.quantized_layers:
            attention = self.layers[i].attention
            if attention is not None and attention.exact_tokens:
                seqs = list(range(self.sequences.batch_size))
                attention.refill_recent(self.sequences.table(seqs, attention.cache.device), self.sequences.lengths)

    def reset(self) -> None:
        super().reset()
        self.sequences.reset()

    def load_from(self, other: Cache) -> "TurboQuantCache":
        """Fills this empty cache from another cache's K/V (e.g. a prefill run with transformers'
        own cache and attention): packed layers store them, plain layers copy them. Every position
        of ``other`` counts as a token (no padding). Returns self."""
        if self.get_seq_length() or self.sequences.lengths:
            raise ValueError("turboquant: load_from fills an empty TurboQuantCache; reset() it first")
        if len(other.layers) != len(self.layers):
            raise ValueError(f"turboquant: the other cache has {len(other.layers)} layers, this one {len(self.layers)}")
        for i, source in enumerate(other.layers):
            held, seen = source.keys.shape[-2], source.get_seq_length()
            if held < seen:
                raise ValueError(f"turboquant: layer {i} of the other cache holds only its last {held} of {seen} positions "
                                 "(a sliding-window layer); load_from needs every position: prefill with "
                                 "transformers' DynamicCache() built without the model's config")
            if i in self.quantized_layers:
                self.layers[i].store(source.keys, source.values)
            else:
                self.layers[i].update(source.keys.clone(), source.values.clone())
        return self

    def packed_bytes(self) -> int:
        """Bytes of K/V the cache holds for its tokens: slots of the packed layers, their rings of
        exact tokens (``exact_recent``, the calibrated layers' first block; as allocated), plus the plain layers' tensors
        (allocated but unused blocks not counted)."""
        total = 0
        for i, layer in enumerate(self.layers):
            if i in self.quantized_layers:
                if layer.attention is not None:
                    slot = layer.attention.cache.shape[-1] * layer.attention.cache.shape[2]
                    total += slot * sum(self.sequences.lengths)
                    for exact in layer.attention.exact_tokens:
                        total += 2 * exact.keys.numel() * exact.keys.element_size()
            elif getattr(layer, "keys", None) is not None and layer.keys.numel():
                total += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        return total


__all__ = ["ATTN_IMPLEMENTATION", "CACHE_KWARG", "TurboQuantCache", "TurboQuantLayer", "turboquant_attention"]
