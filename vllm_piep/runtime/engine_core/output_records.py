"""Engine core: the requests' running totals on the engine's outputs. One rows block and the step
header go on the first output of each client's batch, in `kv_transfer_params` (the API server
pops them before vLLM reads the field; `runtime/record.py`). A served engine is sparse: only
the outputs that finish a request, and every output of a request with stop strings, carry a
row. Finishing outputs whose steps still wait (for the log's pass, or for the meter in
measured mode) are held and go out later, with their client's next batch or on their own."""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_piep.runtime.engine_core.accountant import EngineAccountant, Ready
from vllm_piep.runtime.engine_core.measured import EngineMeter
from vllm_piep.runtime.record import HEADER_KEY, PICKS_KEY, ROWS_KEY, encode_picks, encode_rows


def attach_records(acc: EngineAccountant, outputs: dict[int, Any],
                    live: set[str] | None = None) -> None:
    """One rows block and the step header on the first output of each client's batch
    (`vllm_piep.runtime.record`); requests that finished with this output are released after.
    Finishing outputs whose steps wait (for the meter, or for the log's pass) are held and go
    out later; held ones now ready join their client's batch, or go out on their own.
    `live`: the scheduler's requests, to sweep those it no longer has."""
    meter: EngineMeter | None = acc.engine_meter
    if meter is not None and acc.splitter is not None:
        _hold_unsettled(meter, outputs)
    elif acc.sparse and acc.put_outputs is not None:
        _attach_served(acc, outputs)
        if live is not None:
            acc.sweep(live, every=0)
        return
    # The engine's counts go to one client only, each increment once: several API servers'
    # /metrics are summed.
    counts_to = min((c for c, eo in outputs.items() if eo.outputs), default=None)
    for client, engine_outputs in outputs.items():
        if engine_outputs.outputs:
            attach_to(acc, client, engine_outputs.outputs, client == counts_to)
    if live is not None:
        acc.sweep(live, every=0)


def _attach_served(acc: EngineAccountant, outputs: dict[int, Any]) -> None:
    """`attach_records` in prediction mode on a served engine, each batch read once: its
    finishing outputs are held while steps wait in the log (`accountant.py`), and go out
    with the pass that evaluates them; the log is evaluated now when a held output has waited
    `HOLD_S`, or when the batch has an output of a request whose every output carries its
    row (then nothing waits)."""
    dense = acc.dense_ids
    if acc.pass_due() or (dense and any(out.request_id in dense
                                        for engine_outputs in outputs.values()
                                        for out in engine_outputs.outputs)):
        acc.evaluate()
    holding = acc.holds_outputs()
    batches: list[tuple[int, Any, list[int]]] = []
    for client, engine_outputs in outputs.items():
        outs = engine_outputs.outputs
        if not outs:
            continue
        ends = [i for i, out in enumerate(outs) if out.finish_reason is not None]
        if ends and holding:
            for i in ends:
                acc.hold(client, outs[i])
            engine_outputs.outputs = [out for out in outs if out.finish_reason is None]
            ends = []
        batches.append((client, engine_outputs, ends))
    ready = by_client(acc.take_ready()) if acc.ready else {}
    counts_to = min((c for c, eo, _ in batches if eo.outputs or c in ready), default=None)
    for client, engine_outputs, ends in batches:
        held = ready.pop(client, None)
        if engine_outputs.outputs or held:
            attach_to(acc, client, engine_outputs.outputs, client == counts_to, held, ends)
    send_ready(acc, ready)


def by_client(ready: list[Ready]) -> dict[int, list[Ready]]:
    by_client: dict[int, list[Ready]] = {}
    for r in ready:
        by_client.setdefault(r.client, []).append(r)
    return by_client


def send_ready(acc: EngineAccountant, ready: dict[int, list[Ready]]) -> None:
    """Held outputs a pass released, out on their own batch per client."""
    for client, held in ready.items():
        outs: list[Any] = []
        attach_to(acc, client, outs, True, held)
        assert acc.put_outputs is not None, "only an engine that sends outputs holds them"
        acc.put_outputs(client, outs)


def attach_to(acc: EngineAccountant, client: int, outs: list[Any], counts: bool,
               ready: list[Ready] | None = None, ends: list[int] | None = None) -> None:
    """The rows block and the header on the first of these outputs, one client's; the
    requests that finished with them are released after. `ready`: held outputs a pass
    released, appended to `outs` with the rows the pass gave them (already released). `ends`:
    the positions of the outputs that finish a request, where the caller has them. A sparse
    engine gives rows only to the outputs that finish a request or whose request has stop
    strings, and attaches nothing when there are none and no new counts."""
    n_own = len(outs)
    if ends is None:
        ends = [i for i, out in enumerate(outs) if out.finish_reason is not None]
    picks: list[int] | None = None
    if acc.sparse:
        dense = acc.dense_ids
        picks = ends if not dense else [
            i for i, out in enumerate(outs)
            if out.finish_reason is not None or out.request_id in dense]
        if ready:
            picks = [*picks, *range(n_own, n_own + len(ready))]
            outs.extend(r.output for r in ready)
        if not picks and not (counts and acc.counts_due()):
            return
        block = acc.encode([outs[i].request_id for i in picks if i < n_own])
        if ready:
            block += encode_rows(np.stack([r.row for r in ready]))
        if len(picks) == len(outs):
            picks = None
    else:
        block = acc.encode([out.request_id for out in outs])
    for i in ends:
        acc.release(outs[i].request_id, aborted=False)
    header = acc.header(counts=counts)
    if counts:
        acc.counts_client = client
    extra = {HEADER_KEY: header.encode(), ROWS_KEY: block}
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
    done = acc.steps_done  # this step's among them
    for client, engine_outputs in outputs.items():
        outs = engine_outputs.outputs
        if not any(out.finish_reason is not None and acc.unsettled(out.request_id, done)
                   for out in outs):
            continue
        keep = []
        for out in outs:
            if out.finish_reason is not None and acc.unsettled(out.request_id, done):
                meter.hold(client, out)
            else:
                keep.append(out)
        engine_outputs.outputs = keep


def put_outputs(queue: Any, client: int, outs: list[Any]) -> None:
    """Outputs into the engine's output queue, as a batch of their own."""
    from vllm.v1.engine import EngineCoreOutputs

    queue.put_nowait((client, EngineCoreOutputs(outputs=outs)))
