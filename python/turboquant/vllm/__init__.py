"""turboquant inside vLLM: ``--kv-cache-dtype turboquant_*`` served by this library's ops.

Installing turboquant registers :func:`register` under vLLM's ``vllm.general_plugins`` entry point,
which every vLLM process (API server, engine core, workers) loads at start-up. It

* puts :class:`turboquant.vllm.backend.TurboQuantBackend` behind vLLM's ``TURBOQUANT`` backend name,
  which vLLM's CUDA platform picks for ``turboquant_*`` cache dtypes;
* teaches vLLM's CPU platform, which otherwise sends every layer to its own CPU attention (and, for
  a ``turboquant_*`` cache, writes bf16 into the packed cache), to send the quantized layers to it.

vLLM keeps its first and last two attention layers unquantized (``kv_cache_dtype_skip_layers``);
they keep vLLM's default backend. The backend uses vLLM's internal attention-backend interface,
which changes between minor releases: it is tested with the versions in ``TESTED_VLLM``, and
outside them a ``turboquant_*`` cache fails with an error naming both (set
``TURBOQUANT_VLLM_UNTESTED=1`` to try anyway). Nothing changes for other cache dtypes.
"""

from __future__ import annotations

import os

BACKEND = "turboquant.vllm.backend.TurboQuantBackend"
TESTED_VLLM = ((0, 32),)  # (major, minor) releases the backend was tested with


def _version_is_tested(version: str) -> bool:
    parts = version.split(".")
    try:
        return (int(parts[0]), int(parts[1])) in TESTED_VLLM
    except (IndexError, ValueError):
        return False


def check_vllm_version() -> None:
    """Raises when the installed vLLM is outside ``TESTED_VLLM`` (unless TURBOQUANT_VLLM_UNTESTED=1)."""
    import vllm
    if _version_is_tested(vllm.__version__) or os.environ.get("TURBOQUANT_VLLM_UNTESTED") == "1":
        return
    tested = ", ".join(f"{a}.{b}.x" for a, b in TESTED_VLLM)
    raise RuntimeError(f"turboquant: vLLM {vllm.__version__} is not a version turboquant's backend was tested with "
                       f"({tested}); install one of those, or set TURBOQUANT_VLLM_UNTESTED=1 to try it")


def _route_cpu_layers() -> None:
    """vLLM's CPU platform returns its own attention for every layer: send ``turboquant_*`` layers
    to TURBOQUANT, checked the way vLLM's CUDA platform checks a backend."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if getattr(CpuPlatform, "_turboquant_routed", False):  # plugins load more than once per process
        return
    default = CpuPlatform.get_attn_backend_cls.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if not str(attn_selector_config.kv_cache_dtype or "").startswith("turboquant_"):
            return default(cls, selected_backend, attn_selector_config, num_heads)
        check_vllm_version()
        backend = AttentionBackendEnum.TURBOQUANT.get_class()
        config = attn_selector_config._asdict()
        reasons = backend.validate_configuration(**config, device_capability=None)
        if reasons:
            raise ValueError(f"turboquant: the TURBOQUANT backend cannot serve this layer ({attn_selector_config}): "
                             + "; ".join(reasons))
        return AttentionBackendEnum.TURBOQUANT.get_path()

    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    CpuPlatform._turboquant_routed = True


def register() -> None:
    """The ``vllm.general_plugins`` entry point."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.TURBOQUANT, BACKEND)
    _route_cpu_layers()
