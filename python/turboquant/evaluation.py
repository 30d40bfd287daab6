"""Quality of a KV cache on a real model: the protocols of the demo and benchmarks/real_model.py.

A *cache kind* is a callable that makes a fresh ``transformers`` cache for the model
(``DynamicCache`` for transformers' plain cache). Every protocol feeds the model as a serving engine would:

* serving perplexity: each window of text in chunks of ``chunk`` tokens, each chunk attending to
  the cache of the earlier chunks and to its own raw K/V;
* decode perplexity: the window's head as in serving, then its last ``tail`` tokens one at a
  time (what generation sees: every step reads the cache);
* greedy agreement and KL: the plain cache's greedy continuation fed back token by token through
  each kind; the per-step KL(plain || kind) and whether the argmax agrees;
* passkey retrieval: a number hidden at a random depth of a long text, the context prefilled once
  with the plain cache and loaded into each kind, then the question as a later chunk and the
  answer decoded from the cache.

Baselines a user might pick instead are round-trip caches (``RoundTripCache``): they store the
quantized-then-dequantized K/V and attend with SDPA, which measures a quantizer's quality without
a kernel for it.
"""

from __future__ import annotations

import math
import random
import re
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from . import hf as tqhf
from .cache import boundary_skip_layers
from .roundtrip import fp8_e4m3, int4_per_token

CacheKind = Callable[[], Cache]


def _cache_kw(cache):
    return {tqhf.CACHE_KWARG: cache}


def _forward(model, ids, cache):
    with torch.no_grad():
        return model(ids, use_cache=True, **_cache_kw(cache)).logits


# ---- baselines: round-trip caches ---------------------------------------------------------------
class _RoundTripLayer(DynamicLayer):
    """Stores ``quantize(K/V)``; a step attends to the stored past and its own raw K/V."""

    def __init__(self, quantize):
        super().__init__()
        self.quantize = quantize

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = torch.cat([self.keys, key_states], -2), torch.cat([self.values, value_states], -2)
        self.keys = torch.cat([self.keys, self.quantize(key_states)], -2)
        self.values = torch.cat([self.values, self.quantize(value_states)], -2)
        return keys, values


class RoundTripCache(Cache):
    """A plain cache whose layers (except ``skip``) keep round-tripped K/V."""

    def __init__(self, num_layers: int, quantize, skip=()):
        super().__init__(layers=[DynamicLayer() if i in skip else _RoundTripLayer(quantize) for i in range(num_layers)])

    def load_from(self, other: Cache) -> "RoundTripCache":
        for layer, source in zip(self.layers, other.layers):
            if isinstance(layer, _RoundTripLayer):
                layer.lazy_initialization(source.keys, source.values)
                layer.keys, layer.values = layer.quantize(source.keys), layer.quantize(source.values)
            else:
                layer.update(source.keys.clone(), source.values.clone())
        return self


def load_into(kind: CacheKind, prefilled: DynamicCache):
    """A fresh cache of ``kind`` holding what ``prefilled`` holds (a copy)."""
    cache = kind()
    if hasattr(cache, "load_from"):
        return cache.load_from(prefilled)
    # transformers' own caches (plain, QuantizedCache) take the prefill as one chunk
    for i, layer in enumerate(prefilled.layers):
        cache.update(layer.keys.clone(), layer.values.clone(), i)
    return cache


# ---- protocols ------------------------------------------------------------------------------------
def windows(ids: torch.Tensor, length: int, count: int) -> list[torch.Tensor]:
    """``count`` consecutive windows of ``length`` tokens from ``ids [1, N]``."""
    if ids.shape[1] < length * count:
        raise ValueError(f"turboquant: the text has {ids.shape[1]} tokens, {count} windows of {length} need more")
    return [ids[:, i * length:(i + 1) * length] for i in range(count)]


def _serving_logits(model, window: torch.Tensor, kind: CacheKind, chunk: int):
    """The window fed in chunks: yields, chunk by chunk, the float32 logits predicting each of
    ``window[1:]`` (in order) and those tokens."""
    cache = kind()
    device = next(model.parameters()).device
    window = window.to(device)
    previous = None
    for start in range(0, window.shape[1], chunk):
        ids = window[0, start:start + chunk]
        logits = _forward(model, ids[None], cache)[0].float()
        # the last logit of the previous chunk predicts this chunk's first token
        rows = logits[:-1] if previous is None else torch.cat([previous[None], logits[:-1]])
        if rows.shape[0]:
            yield rows, ids[1:] if previous is None else ids
        previous = logits[-1]


def serving_token_nlls(model, window: torch.Tensor, kind: CacheKind, chunk: int = 256) -> torch.Tensor:
    """NLL ``[len - 1]`` (float32, CPU) of each token of ``window[1:]``, the window fed in chunks."""
    return torch.cat([F.cross_entropy(rows, ids, reduction="none")
                      for rows, ids in _serving_logits(model, window, kind, chunk)]).cpu()


def serving_log_probs(model, window: torch.Tensor, kind: CacheKind, chunk: int = 256) -> torch.Tensor:
    """Log-probabilities ``[len - 1, vocab]`` (float32, CPU) predicting each token of ``window[1:]``,
    the window fed in chunks (``token_nlls`` and ``mean_kl`` take them as decode_log_probs')."""
    return torch.cat([rows.log_softmax(-1).cpu() for rows, _ in _serving_logits(model, window, kind, chunk)])


def serving_nll(model, window: torch.Tensor, kind: CacheKind, chunk: int = 256) -> tuple[float, int]:
    """Summed negative log-likelihood of ``window[1:]`` fed in chunks, and the count."""
    nlls = serving_token_nlls(model, window, kind, chunk)
    return nlls.double().sum().item(), nlls.numel()


def decode_log_probs(model, window: torch.Tensor, kind: CacheKind, tail: int = 256, chunk: int = 256) -> torch.Tensor:
    """Log-probabilities ``[tail, vocab]`` (float32, CPU) predicting each of the last ``tail`` tokens
    of ``window``, each from a step that reads the cache (the head fed in chunks of ``chunk``)."""
    cache = kind()
    device = next(model.parameters()).device
    window = window.to(device)
    head = window.shape[1] - tail
    for start in range(0, head, chunk):
        logits = _forward(model, window[:, start:min(start + chunk, head)], cache)
    out = [logits[0, -1].float().log_softmax(-1).cpu()]
    for t in range(head, window.shape[1] - 1):
        out.append(_forward(model, window[:, t:t + 1], cache)[0, -1].float().log_softmax(-1).cpu())
    return torch.stack(out)


def token_nlls(log_probs: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """NLL ``[positions]`` of each token ``log_probs`` (decode_log_probs) predicts: the last of ``window``."""
    targets = window[0, window.shape[1] - log_probs.shape[0]:].cpu()
    return -log_probs.gather(1, targets[:, None])[:, 0]


def nll_of(log_probs: torch.Tensor, window: torch.Tensor) -> tuple[float, int]:
    """Summed NLL of the tokens ``log_probs`` (decode_log_probs) predict, the last of ``window``, and the count."""
    return token_nlls(log_probs, window).sum().item(), log_probs.shape[0]


def perplexity_change(reference: torch.Tensor, nlls: torch.Tensor) -> tuple[float, float]:
    """Perplexity change in percent of ``nlls`` against ``reference`` (per-token NLLs of the same
    tokens), and its standard error: the perplexity ratio is ``exp(mean(d))`` with ``d`` the
    per-token NLL differences, whose spread gives the error (tokens taken as independent, so it is
    a lower bound where neighbouring tokens' losses move together)."""
    if reference.shape != nlls.shape or reference.dim() != 1 or reference.numel() < 2:
        raise ValueError(f"turboquant: perplexity_change needs two equal 1-D NLL tensors of 2+ tokens, got "
                         f"{tuple(reference.shape)} and {tuple(nlls.shape)}")
    d = nlls.double() - reference.double()
    ratio = math.exp(d.mean().item())
    return 100 * (ratio - 1), 100 * ratio * d.std().item() / math.sqrt(d.numel())


def mean_kl(reference: torch.Tensor, log_probs: torch.Tensor) -> float:
    """Mean over positions of KL(reference || log_probs), both log-probabilities ``[positions, vocab]``."""
    return F.kl_div(log_probs, reference, log_target=True, reduction="none").sum(-1).mean().item()


def decode_nll(model, window: torch.Tensor, kind: CacheKind, tail: int = 256, chunk: int = 256) -> tuple[float, int]:
    """NLL of the last ``tail`` tokens of ``window``, each predicted by a step that reads the cache
    (the head fed in chunks of ``chunk``)."""
    return nll_of(decode_log_probs(model, window, kind, tail, chunk), window)


def perplexity(nlls: list[tuple[float, int]]) -> float:
    return math.exp(sum(n for n, _ in nlls) / sum(c for _, c in nlls))


def teacher_forced_logits(model, prompt: torch.Tensor, tokens: torch.Tensor, kind: CacheKind) -> torch.Tensor:
    """Logits ``[len(tokens), vocab]`` predicting each of ``tokens`` after ``prompt``, fed one at a time."""
    cache = kind()
    device = next(model.parameters()).device
    out = [_forward(model, prompt.to(device), cache)[0, -1].float()]
    for t in tokens[:-1]:
        out.append(_forward(model, t.view(1, 1).to(device), cache)[0, -1].float())
    return torch.stack(out)


def greedy_tokens(model, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(prompt.to(next(model.parameters()).device), max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, pad_token_id=0)
    return out[0, prompt.shape[1]:].cpu()


def agreement_and_kl(reference: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """Fraction of steps whose argmax equals the reference's, and the mean KL(reference || logits)."""
    agree = (reference.argmax(-1) == logits.argmax(-1)).float().mean().item()
    return agree, mean_kl(reference.log_softmax(-1), logits.log_softmax(-1))


NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\n\nWhat is the pass key? The pass key is"


def passkey_prompt(tokenizer, text: str, context_tokens: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(context ids, question ids, key): ``context_tokens`` tokens of the text with the needle at a
    random depth."""
    key = str(rng.randint(10000, 99999))
    filler = tokenizer(text, return_tensors="pt").input_ids[0]
    start = rng.randint(0, max(0, filler.shape[0] - context_tokens - 1))
    needle = tokenizer(" " + NEEDLE.format(key=key) + " ", return_tensors="pt").input_ids[0]
    body = filler[start:start + context_tokens - needle.shape[0]]
    depth = rng.randint(0, body.shape[0])
    context = torch.cat([body[:depth], needle, body[depth:]]).view(1, -1)
    question = tokenizer(QUESTION, return_tensors="pt").input_ids
    return context, question, key


def passkey_answers(model, tokenizer, context, question, kinds: dict[str, CacheKind], steps: int = 8) -> dict[str, str]:
    """Prefills ``context`` once with transformers' cache, then for each kind loads it, feeds the
    question as a later chunk and decodes ``steps`` greedy tokens. Returns the decoded answers."""
    device = next(model.parameters()).device
    prefilled = DynamicCache()
    _forward(model, context.to(device), prefilled)
    answers = {}
    for name, kind in kinds.items():
        cache = load_into(kind, prefilled)
        logits = _forward(model, question.to(device), cache)
        tokens = [logits[0, -1].argmax().view(1, 1)]
        for _ in range(steps - 1):
            tokens.append(_forward(model, tokens[-1], cache)[0, -1].argmax().view(1, 1))
        answers[name] = tokenizer.decode(torch.cat(tokens, 1)[0])
    return answers


def found(answer: str, key: str) -> bool:
    return re.sub(r"\D", "", answer).startswith(key)


def cache_kinds(model, presets, boundary: bool = True, baselines: bool = True) -> dict[str, CacheKind]:
    """The cache kinds of the report: plain, each preset, and the baselines at the same boundary."""
    n = model.config.num_hidden_layers
    skip = set(boundary_skip_layers(n)) if boundary else set()
    kinds: dict[str, CacheKind] = {"plain": DynamicCache}
    for preset in presets:
        kinds[preset.replace("turboquant_", "")] = (
            lambda p=preset: tqhf.TurboQuantCache(model.config, preset=p, boundary_skip_layers=2 if boundary else 0))
    if baselines:
        kinds["fp8 e4m3"] = lambda: RoundTripCache(n, fp8_e4m3, skip)
        kinds["int4 g32"] = lambda: RoundTripCache(n, int4_per_token, skip)
    return kinds
