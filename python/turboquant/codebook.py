"""Lloyd-Max codebooks and Hadamard rotations, cached per (shape, device)."""

from __future__ import annotations

import functools

import torch

from ._library import _core


def lloyd_max_gaussian(bits: int, tolerance: float = 1e-12) -> dict:
    """Converged Lloyd-Max quantizer of N(0, 1): levels, thresholds, mse, iterations."""
    return _core.lloyd_max_gaussian(bits, tolerance)


def lloyd_max_sphere(bits: int, head_dim: int, tolerance: float = 1e-12) -> dict:
    """Quantizer for one coordinate of a random unit vector in R^head_dim (the 'sphere' option;
    the presets use the Gaussian codebook)."""
    return _core.lloyd_max_sphere(bits, head_dim, tolerance)


@functools.lru_cache(maxsize=None)
def _codebook_cpu(bits: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    centroids, midpoints = _core.codebook(bits, head_dim)
    return torch.tensor(centroids, dtype=torch.float32), torch.tensor(midpoints, dtype=torch.float32)


@functools.lru_cache(maxsize=None)
def codebook(bits: int, head_dim: int, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (centroids, midpoints) of the key codebook the presets use at ``head_dim``."""
    c, m = _codebook_cpu(bits, head_dim)
    return c.to(device), m.to(device)


@functools.lru_cache(maxsize=None)
def hadamard(head_dim: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """Orthonormal, symmetric Sylvester Hadamard matrix H_D / sqrt(D) (fp32), built once."""
    flat = _core.hadamard(head_dim)
    return torch.tensor(flat, dtype=torch.float32).view(head_dim, head_dim).to(device)
