"""Loads the compiled parts of turboquant: the torch op library and the pybind11 core module."""

from __future__ import annotations

import glob
import os

import torch

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_BUILD_HINT = (
    "build it with `bash scripts/test.sh` (or `pip install --no-build-isolation .`) from the "
    "repository root"
)


def _find_ops_library() -> str:
    override = os.environ.get("TURBOQUANT_OPS_LIBRARY")
    candidates = [override] if override else []
    candidates += glob.glob(os.path.join(_PACKAGE_DIR, "libturboquant_ops*.so"))
    for path in candidates:
        if path and os.path.exists(path):
            return path
    raise ImportError(f"turboquant: the op library libturboquant_ops.so was not found in {_PACKAGE_DIR}; {_BUILD_HINT}")


def _load() -> None:
    if hasattr(torch.ops.turboquant, "store_kv"):
        try:
            torch.ops.turboquant.store_kv.default  # already registered in this process
            return
        except (AttributeError, RuntimeError):
            pass
    torch.ops.load_library(_find_ops_library())


_load()

try:
    from . import _core  # noqa: E402  (pybind11 module built next to this file)
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(f"turboquant: the core module _core could not be imported ({exc}); {_BUILD_HINT}") from exc


def has_cuda_kernels() -> bool:
    """True when the op library was built with its CUDA implementations."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("turboquant::decode", "CUDA")
