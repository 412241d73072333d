"""Engine core: measured mode started for an engine (`measured.py`), once, when the engine has an
output queue to send held outputs on and a meter serves: the meter reads this engine's own
GPUs (`engine_gpus.py`), or each worker reads its own and sends the readings here
(`meter_scope`, `patch_executor_init.py`); an engine that meters itself but has workers on
other nodes, or GPUs it cannot tell, stays in prediction mode, said once in the log and on
/metrics."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from vllm_piep.config import PiepConfig
from vllm_piep.once import logger
from vllm_piep.runtime.engine_core.accountant import EngineAccountant
from vllm_piep.runtime.engine_core.measured import EngineMeter
from vllm_piep.runtime.engine_core.output_records import attach_to, put_outputs
from vllm_piep.runtime.engine_core.patch_executor_init import SINK_ATTR
from vllm_piep.runtime.vllm_config import device


def start_engine_meter(engine: Any, acc: EngineAccountant, flush: Callable[[], None]
                       ) -> None:
    """Measured mode (`measured.py`), once per engine, when the engine has an output queue
    to send held outputs on (an engine-core process; the in-process engine of `LLM` stays in
    prediction mode) and a meter serves. `flush`: the engine's idle flush, which the meter
    thread calls when it settles steps while the engine is idle."""
    from vllm_piep.meters.factory import meter_factory, reads_gpus
    from vllm_piep.meters.worker_readings import WorkerMeter
    from vllm_piep.runtime.engine_core.engine_gpus import engine_gpus

    vllm_config = engine.scheduler.vllm_config
    config = PiepConfig.from_sources(vllm_config.additional_config)
    if not config.measured:
        acc.meter_note = "measured: false"
        return
    setting = config.meter or "auto"
    ordinals = indices = None
    sink = getattr(getattr(engine, "model_executor", None), SINK_ATTR, None)
    if sink is not None:  # each worker meters its own devices (`patch_executor_init.py`)
        ranks = range(int(vllm_config.parallel_config.world_size))
        factory, label = ((lambda: WorkerMeter(sink.readings, ranks, on_stop=sink.close)),
                          f"{setting} in each worker")
    elif device()[0] == "cuda":
        gpus = engine_gpus(vllm_config.parallel_config)
        if (gpus.elsewhere or gpus.unknown) and reads_gpus(setting):
            if gpus.unknown:
                acc.meter_note, why = gpus.unknown, ("a meter could read another engine's GPUs "
                                                     "(with meter_scope auto or worker, each "
                                                     "worker meters its own)")
            else:
                acc.meter_note = (f"{gpus.elsewhere} of the engine's {gpus.workers} workers "
                                  "run on other nodes")
                why = (f"the meter here reads only this node's GPUs ({gpus.describe()}): "
                       "measured mode would bill part of the engine's energy. With "
                       "meter_scope auto or worker, each worker meters its own GPU instead")
            logger.warning(
                "vllm_piep: %s; %s, so the engine stays in prediction mode (responses say "
                "source prior; piep_engine_measured is 0 with this reason).",
                acc.meter_note, why)
            return
        ordinals, indices = (gpus.ids, None) if gpus.kind == "cuda" else (None, gpus.ids)
        logger.info("vllm_piep: engine %s runs on %s", acc.engine_id, gpus.describe())
    if sink is None:
        factory, label = meter_factory(setting, ordinals, measuring_only=config.meter is None,
                                       nvml_indices=indices)
    send = partial(put_outputs, engine.output_queue)

    def attach_and_send(client: int, outs: list[Any]) -> None:
        attach_to(acc, client, outs, counts=True)
        send(client, outs)

    def idle_watts() -> float | None:
        with acc.lock:  # the meter thread asks; the predictor may be loading in the engine loop
            predictor = acc.predictor
        if getattr(predictor, "idle_watts", None) is not None:  # the prior: idle, not serving
            return float(predictor.idle_watts)
        graph = getattr(predictor, "graph", None)
        spec = getattr(graph, "spec", None)
        return getattr(spec, "static_watts", getattr(predictor, "static_watts", None))

    acc.engine_meter = EngineMeter(acc, factory, label, idle_watts, attach_and_send,
                                   flush=flush).start()
