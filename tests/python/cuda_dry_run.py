"""pytest plugin for scripts/dry_run_cuda_tests.sh: runs the CUDA tests' own code (builders,
poisoning, references, comparisons) with every "cuda" device mapped to the CPU, so that the ops
dispatch to their CPU implementations. It proves nothing about the kernels: each test compares the
CPU with itself. What it catches is a broken test (a name, a shape, a reference) on a machine
without a GPU, before a GPU run spends its time finding it.

Loaded with `-p cuda_dry_run` before conftest.py, so conftest sees a "GPU" and does not skip."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

import turboquant

torch.cuda.is_available = lambda: True
turboquant.has_cuda_kernels = lambda: True
for _name in ("synchronize", "manual_seed", "manual_seed_all", "empty_cache"):
    setattr(torch.cuda, _name, lambda *args, **kwargs: None)

# What the CPU cannot stand in for: graph capture, streams, the CUDA ops' own error messages, and
# the reruns in a fresh process with a kernel forced by an environment switch.
NEEDS_A_GPU = ("graph", "stream", "bad_input_messages", "refuses", "each_decode_kernel", "each_varlen_kernel",
               "kernel_forced", "own_row_splits")


def _cpu(device):
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class CpuForCuda(TorchFunctionMode):
    """Factory functions' device=, Tensor.to(device) and Tensor.cuda() stay on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name == "cuda":
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if name == "to":
            args = tuple(_cpu(a) for a in args)
        return func(*args, **kwargs)


def _is_cuda_test(item) -> bool:
    return any("CUDA device" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config, items):
    keep = [i for i in items if _is_cuda_test(i) and not any(word in i.name for word in NEEDS_A_GPU)]
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    items[:] = keep


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line("DRY RUN: the CUDA tests ran on CPU tensors against the CPU ops; no kernel ran. "
                                "A pass here says the tests themselves run, not that the CUDA ops are right.",
                                yellow=True)


@pytest.fixture(autouse=True)
def _cpu_for_cuda():
    with CpuForCuda():
        yield
