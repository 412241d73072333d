"""Worker: the engine core's sink address, for workers on other nodes under vLLM's multi-node
launch of the multiprocessing executor (`--nnodes N`, each other node running
`vllm serve --headless --node-rank K`).

Those workers are started by their own node's `vllm serve`, which never learns the address the
engine core exported to the workers it started itself (`patch_executor_init.py`). They find it
in the key-value store vLLM's world group already runs at `master_addr:master_port`
(torch.distributed's TCPStore, served by rank 0's process): the engine's rank-0 worker puts the
address there, or an empty value where the engine's workers do not meter themselves, and the
others read it. Both run on threads of their own, with a client of their own (a store client is
not shared across threads), off every path vLLM waits on.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

KEY = "vllm_piep/worker_meter_sink/dp{}"  # one per data-parallel rank: each has its engine
WAIT_S = 120.0  # how long a worker on another node waits for rank 0's answer


def across_nodes(parallel: Any) -> bool:
    """Whether this engine's workers span nodes under vLLM's own launch."""
    return int(getattr(parallel, "nnodes_within_dp", 1) or 1) > 1


def _key(parallel: Any) -> str:
    return KEY.format(int(getattr(parallel, "data_parallel_rank", 0) or 0))


def _client(parallel: Any, timeout_s: float) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(str(parallel.master_addr), int(parallel.master_port), is_master=False,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def publish(parallel: Any, address: str | None, timeout_s: float = WAIT_S) -> None:
    """Rank 0: the engine's sink address for the other nodes' workers ('' for none)."""
    _client(parallel, timeout_s).set(_key(parallel), address or "")


def resolve(parallel: Any, timeout_s: float = WAIT_S) -> str | None:
    """Another node's worker: the address rank 0 published (None: the engine's workers do not
    meter themselves). Raises where none comes within `timeout_s`."""
    value = _client(parallel, timeout_s).get(_key(parallel))
    return bytes(value).decode() or None
