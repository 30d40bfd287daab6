"""Shared pytest setup: import path, test axes, devices."""

import os
import sys

import pytest
import torch

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_REPO, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import turboquant  # noqa: E402

# Under pytest-xdist each worker would start as many intra-op threads as there are cores (12
# workers x 16 threads on the GPU machine), and the CPU references' parallel loops (store_kv,
# decode) then contend for them: give each worker its share of the cores instead.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

CUDA_OK = torch.cuda.is_available() and turboquant.has_cuda_kernels()
requires_cuda = pytest.mark.skipif(not CUDA_OK, reason="needs a CUDA device and a CUDA build of the ops")


def pytest_configure(config):
    # The GPU machine's run (scripts/gpu_run.sh) sets this: there a build without the CUDA ops, or
    # no visible device, must fail the run rather than skip every CUDA test and pass.
    if os.environ.get("TURBOQUANT_REQUIRE_CUDA") == "1" and not CUDA_OK:
        raise pytest.UsageError(
            f"TURBOQUANT_REQUIRE_CUDA=1 but the CUDA tests cannot run (torch.cuda.is_available() = "
            f"{torch.cuda.is_available()}, turboquant.has_cuda_kernels() = {turboquant.has_cuda_kernels()})")


@pytest.fixture(autouse=True)
def _inference_mode():
    with torch.inference_mode():
        yield
