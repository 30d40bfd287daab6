"""One vLLM engine on the real model, with one ``--kv-cache-dtype``: what the vLLM tests check, as JSON.

    python tests/vllm/run_engine.py KV_CACHE_DTYPE OUT.json [--model smollm2-135m] [--windows 2] [--window 1024]

Runs in its own process (vLLM starts an engine core and a worker process of its own, and reads the
plugin's entry point in each), the way a user's ``LLM(...)`` does. Records:

* ``backends``: each attention layer's backend class and cache dtype, read in the worker process;
* ``kv_cache_tokens``: the KV capacity vLLM sized for its cache space;
* ``greedy``: greedy continuations of a long prompt (the 371-token kind) and of prompts that share
  a 300-token prefix, run together with chunked prefill and prefix caching, so steps mix decodes,
  first chunks and continuation chunks that start at a cached prefix (``cached_tokens``: how many
  prompt tokens each request found in the prefix cache);
* ``teacher_forced`` (with ``--reference``, another run's JSON): each prompt followed by the
  reference run's greedy continuation, scored with ``prompt_logprobs=1``: per continuation position,
  this cache's top token and its log-probability of the reference token (greedy agreement and NLL);
* ``nll``: serving perplexity's summed NLL and count over the text's first windows, each prompt
  prefilled in 256-token chunks alone (``max_num_seqs=1``): the protocol of
  ``turboquant.evaluation.serving_nll`` with ``chunk=256``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

CHUNK = 256


def attention_layers(worker) -> dict:
    """{layer name: [backend class, kv cache dtype]} of the worker's model (collective_rpc)."""
    from vllm.model_executor.layers.attention.attention import Attention
    model = worker.model_runner.get_model()
    return {name: [f"{m.attn_backend.__module__}.{m.attn_backend.__qualname__}", m.kv_cache_dtype]
            for name, m in model.named_modules() if isinstance(m, Attention)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kv_cache_dtype")
    p.add_argument("out")
    p.add_argument("--model", default="smollm2-135m", help="a turboquant.assets model name")
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--greedy-tokens", type=int, default=48)
    p.add_argument("--reference", default=None, help="a run's JSON whose greedy continuations to score")
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="turboquant-vllm-"))
    # collective_rpc sends attention_layers (a function) to the worker by pickle; a local test only.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import turboquant.assets as assets

    started = time.time()
    llm = LLM(model=assets.model_dir(a.model), kv_cache_dtype=a.kv_cache_dtype, dtype="float32",
              max_model_len=a.window + 64, enforce_eager=True, max_num_batched_tokens=CHUNK,
              enable_chunked_prefill=True, enable_prefix_caching=True, seed=0)
    result = {"kv_cache_dtype": a.kv_cache_dtype, "load_s": time.time() - started}
    result["backends"] = llm.collective_rpc(attention_layers)[0]
    config = llm.llm_engine.vllm_config.cache_config
    result["kv_cache_tokens"] = config.num_gpu_blocks * config.block_size
    result["block_size"] = config.block_size

    tokenizer = llm.get_tokenizer()
    ids = tokenizer(assets.text())["input_ids"]
    greedy = SamplingParams(max_tokens=a.greedy_tokens, temperature=0.0)
    long_prompt = ids[:371]
    shared = ids[4000:4000 + 300]
    prompts = [long_prompt] + [shared + ids[5000 + 40 * i:5000 + 40 * i + 20 + 13 * i] for i in range(4)]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=q) for q in prompts], greedy, use_tqdm=False)
    result["greedy"] = [list(o.outputs[0].token_ids) for o in outputs]
    result["cached_tokens"] = [o.num_cached_tokens or 0 for o in outputs]

    if a.reference:
        with open(a.reference) as f:
            continuations = json.load(f)["greedy"]
        scored = llm.generate([TokensPrompt(prompt_token_ids=q + c) for q, c in zip(prompts, continuations)],
                              SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        result["teacher_forced"] = []
        for q, c, o in zip(prompts, continuations, scored):
            positions = range(len(q), len(q) + len(c))
            top = [max(o.prompt_logprobs[j].items(), key=lambda kv: kv[1].logprob)[0] for j in positions]
            logprob = [o.prompt_logprobs[j][c[j - len(q)]].logprob for j in positions]
            result["teacher_forced"].append({"top": top, "logprob": logprob})

    nll, count = 0.0, 0
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0)
    for i in range(a.windows):
        window = ids[i * a.window:(i + 1) * a.window]
        # One window at a time: each step then prefills one 256-token chunk of one window, as the
        # library's harness does (two windows sharing a step would split their chunks elsewhere).
        logprobs = llm.generate([TokensPrompt(prompt_token_ids=window)], scoring, use_tqdm=False)[0].prompt_logprobs
        nll -= sum(logprobs[j][window[j]].logprob for j in range(1, len(window)))
        count += len(window) - 1
    result["nll"], result["count"] = nll, count
    result["total_s"] = time.time() - started
    with open(a.out, "w") as f:
        json.dump(result, f)
    print(json.dumps({k: v for k, v in result.items() if k not in ("backends", "greedy")}), flush=True)
    # vllm-cpu 0.32's exit handlers abort the process ("terminate called without an active exception"),
    # with its own attention backend too: stop the engine's processes, then leave without them.
    llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
