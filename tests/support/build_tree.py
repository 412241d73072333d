"""Loads vLLM models in this process (world size 1, dummy weights) and prints their ModelTree
as JSON, one line per model directory given. Run as a subprocess: vLLM's distributed state is
process-global."""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main(dirs: list[str]) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    from vllm_piep.model.tree import ModelTree

    _set_torch_accelerator_to_noop()
    store = tempfile.mkdtemp()
    initialized = False
    for path in dirs:
        config = EngineArgs(model=path, load_format="dummy", enforce_eager=True,
                            dtype="float32", max_model_len=256).create_engine_config()
        with set_current_vllm_config(config):
            if not initialized:
                init_distributed_environment(1, 0, f"file://{store}/init", 0, "gloo")
                initialize_model_parallel(1, 1)
                initialized = True
            model = get_model(vllm_config=config)
        tree = ModelTree.from_module(model, architecture=config.model_config.architectures[0])
        print("TREE " + json.dumps(tree.to_dict()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
