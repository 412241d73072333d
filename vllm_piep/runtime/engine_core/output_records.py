"""Engine core: the requests' running totals on the engine's outputs. One rows block and the step
header go on the first output of each client's batch, in `kv_transfer_params` (the API server
pops them before vLLM reads the field; `runtime/record.py`). A served engine is sparse: only
the outputs that finish a request, and every output of a request with stop strings, carry a
row. Each step is accounted at its update, so a finishing output carries its total at once;
in measured mode one whose steps still wait for the meter is held and goes out later, with
its client's next batch or on its own."""

from __future__ import annotations

from itertools import compress, repeat
from operator import attrgetter, is_not
from typing import Any

from vllm_piep.runtime.engine_core.accountant import EngineAccountant
from vllm_piep.runtime.engine_core.measured import EngineMeter
from vllm_piep.runtime.record import HEADER_KEY, PICKS_KEY, ROWS_KEY, encode_picks

_FINISH_REASON = attrgetter("finish_reason")  # None until the output finishes its request


def attach_records(acc: EngineAccountant, outputs: dict[int, Any],
                    missing: set[str] | None = None) -> None:
    """One rows block and the step header on the first output of each client's batch
    (`vllm_piep.runtime.record`); requests that finished with this output are released after.
    Measured mode: finishing outputs whose steps wait for the meter are held and go out later;
    held ones now ready join their client's batch, or go out on their own. `missing`:
    requests the scheduler no longer had when the loop looked, released after
    (`EngineAccountant.release_missing`)."""
    meter: EngineMeter | None = acc.engine_meter
    if meter is not None and acc.splitter is not None:
        _hold_unsettled(meter, outputs)
    # The engine's counts go to one client only, each increment once: several API servers'
    # /metrics are summed.
    counts_to = next(iter(outputs)) if len(outputs) == 1 else min(  # one API server: its own
        (c for c, eo in outputs.items() if eo.outputs), default=None)
    for client, engine_outputs in outputs.items():
        if engine_outputs.outputs:
            attach_to(acc, client, engine_outputs.outputs, client == counts_to)
    if missing:
        acc.release_missing(missing)


def attach_to(acc: EngineAccountant, client: int, outs: list[Any], counts: bool) -> None:
    """The rows block and the header on the first of these outputs, one client's; the
    requests that finished with them are released after. A sparse engine gives rows only to
    the outputs that finish a request or whose request has stop strings, and attaches nothing
    when there are none and the counts are not due."""
    ends = list(compress(range(len(outs)), map(is_not, map(_FINISH_REASON, outs),
                                               repeat(None))))
    picks: list[int] | None = None
    if acc.sparse:
        dense = acc.dense_ids
        picks = ends if not dense else [
            i for i, out in enumerate(outs)
            if out.finish_reason is not None or out.request_id in dense]
        if not picks and not (counts and acc.counts_due()):
            return
        block = acc.encode([outs[i].request_id for i in picks])
        if len(picks) == len(outs):
            picks = None
    else:
        block = acc.encode([out.request_id for out in outs])
    for i in ends:
        acc.release(outs[i].request_id, aborted=False)
    header = acc.header_bytes(counts)
    if counts:
        acc.reports.client = client
    extra = {HEADER_KEY: header, ROWS_KEY: block}
    if picks is not None:
        extra[PICKS_KEY] = encode_picks(picks)
    first = outs[0]
    params = first.kv_transfer_params
    first.kv_transfer_params = {**params, **extra} if params else extra


def _hold_unsettled(meter: EngineMeter, outputs: dict[int, Any]) -> None:
    """Measured mode: finished requests whose last steps wait for the meter leave this batch
    to wait (`measured.py`); held ones now settled join it, or go out on their own when this
    batch has nothing for their client (this batch may already be queued)."""
    acc = meter.acc
    alone = []
    for held in meter.settle_in_loop():
        if held.client in outputs:
            outputs[held.client].outputs.append(held.output)
        else:
            alone.append(held)
    meter.send(alone)
    for client, engine_outputs in outputs.items():
        outs = engine_outputs.outputs
        if not any(out.finish_reason is not None and acc.unsettled(out.request_id)
                   for out in outs):
            continue
        keep = []
        for out in outs:
            if out.finish_reason is not None and acc.unsettled(out.request_id):
                meter.hold(client, out)
            else:
                keep.append(out)
        engine_outputs.outputs = keep


def put_outputs(queue: Any, client: int, outs: list[Any]) -> None:
    """Outputs into the engine's output queue, as a batch of their own."""
    from vllm.v1.engine import EngineCoreOutputs

    queue.put_nowait((client, EngineCoreOutputs(outputs=outs)))
