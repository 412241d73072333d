"""Engine core: `Scheduler.finish_requests` wrapped to free the state of requests finished from
outside (a client gone, stop strings found by the API server): no final output will carry
them. Requests vLLM finishes inside `update_from_output` (errors) are released by that
update's call, once its outputs carried their totals."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_piep.runtime.engine_core.accountant import EngineAccountant
from vllm_piep.runtime.engine_core.scheduler_accountant import ACCOUNTANT_ATTR, count_failure
from vllm_piep.runtime.patching import Patch


def _finished_inside_update(finished_status: Any) -> bool:
    """Whether `finish_requests` was called by vLLM's `update_from_output`: there vLLM finishes
    requests only as errored (FINISHED_ERROR, then a final output in the same batch), from
    outside (aborts, streaming input's end) only as aborted (vLLM 0.32, 0.33)."""
    return getattr(finished_status, "name", finished_status) == "FINISHED_ERROR"


def _wrap_finish_requests(original: Callable[..., Any]) -> Callable[..., Any]:
    def finish_requests(self: Any, request_ids: Any, finished_status: Any) -> Any:
        finished = original(self, request_ids, finished_status)
        try:
            acc = self.__dict__.get(ACCOUNTANT_ATTR)
            if acc is not None and isinstance(finished, list) and finished:
                req_ids = [getattr(request, "request_id", request) for request in finished]
                if _finished_inside_update(finished_status):  # the step's call releases them
                    acc.deferred.add(_note_errored, acc, req_ids)
                else:  # aborted from outside: no final output comes
                    acc.deferred.add(_release_all, acc, req_ids)
        except Exception as exc:  # boundary
            count_failure(self, "releasing aborted requests", exc)
        return finished

    return finish_requests


def _note_errored(acc: EngineAccountant, req_ids: list[str]) -> None:
    """Requests vLLM finished inside an update: that update's call (queued next) releases
    them once its outputs carried their totals."""
    acc.errored_in_update.extend(req_ids)


def _release_all(acc: EngineAccountant, req_ids: list[str]) -> None:
    for req_id in req_ids:
        acc.release(req_id)


def patch() -> Patch:
    from vllm.v1.core.sched.scheduler import Scheduler

    return Patch(Scheduler, "finish_requests", _wrap_finish_requests,
          why="frees the state of requests aborted from outside (client gone, stop "
              "strings found by the API server)",
          how="after the original, queues the release of the finished requests' rows "
              "(finished as errored, which vLLM does only inside update_from_output: "
              "hands them to that step's call)",
          until="vLLM offers a request-finished callback in the engine core",
          signature="(self, request_ids, finished_status)")
