"""What the billing ledger (`ledger` option) adds to the API server's CPU per request, side by
side in one run, in this process.

Each repeat plays `--requests` request lifecycles through the API server's `EnergyLedger` as the
`OutputProcessor` patches drive it (the request noted, `--outputs` outputs each with its row, the
close, the response taking its record) twice, taking turns: without a ledger, and with one whose
rows go to a real `LedgerWriter` committing to an SQLite file in a temporary directory. The
process's CPU time (every thread: the writer's commits included, waited for) over each half is
divided by the requests; the added µs per request is the median with the ledger minus the median
without, with a bootstrapped 95 % CI. With the ledger on, `tenant.current()` reads a tenant from
an open slot, as in a served HTTP request.

    .venv/bin/python benchmarks/ledger_cost.py --repeats 30 --json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_loop_cost import added  # noqa: E402
from serve_overhead import finish_run, header, json_option  # noqa: E402

from vllm_piep.ledger.writer import LedgerWriter  # noqa: E402
from vllm_piep.model.components import N_COMPONENTS  # noqa: E402
from vllm_piep.runtime.api_server import tenant  # noqa: E402
from vllm_piep.runtime.api_server.ledger import EnergyLedger, RequestInfo  # noqa: E402
from vllm_piep.runtime.api_server.metrics import EnergyMetrics  # noqa: E402
from vllm_piep.runtime.record import StepHeader, WireRecord  # noqa: E402


def rows(outputs: int) -> list[bytes]:
    """A request's cumulative rows, one per output."""
    out = []
    for i in range(1, outputs + 1):
        parts = tuple(0.01 * i for _ in range(N_COMPONENTS))
        out.append(WireRecord("prior", "prior/x", True, 0.01, 0.01 * i * N_COMPONENTS - 0.01,
                              parts).to_wire())
    return out


def play(book: EnergyLedger, requests: int, outputs: int, start: int, batch: list[bytes],
         head: StepHeader) -> None:
    """`requests` lifecycles as the API server's patches drive the ledger."""
    ledgered = book.sink is not None
    for n in range(start, start + requests):
        internal = f"cmpl-{n}-0"
        if ledgered:  # what `outputs._request_info` does per request
            who = tenant.current()
            book.note_request(RequestInfo(internal, f"cmpl-{n}", "llama",
                                          None if who is None else who[0], time.time(), 64))
        else:
            book.note_model(internal, "llama")
        for row in batch:
            book.update(internal, internal, head, row)
        book.close(internal, "finished", outputs)
        book.take([internal])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="alternated pairs")
    parser.add_argument("--requests", type=int, default=2000, help="requests per half")
    parser.add_argument("--outputs", type=int, default=32, help="outputs per request")
    json_option(parser, "ledger_cost.json")
    args = parser.parse_args()
    info = header("billing ledger: API server CPU per request, ledger off vs on")
    from prometheus_client import CollectorRegistry

    head = StepHeader.decode(StepHeader("prior", "prior/x", "0", 0.0, 0, True).encode())
    batch = rows(args.outputs)
    written = [0]
    with tempfile.TemporaryDirectory() as tmp:
        writer = LedgerWriter(Path(tmp) / "energy.db",
                              on_written=lambda n: written.__setitem__(0, written[0] + n))
        books = {"off": EnergyLedger(EnergyMetrics(CollectorRegistry())),
                 "on": EnergyLedger(EnergyMetrics(CollectorRegistry()))}
        books["on"].sink = writer.put
        tenant.configure(True, "x-tenant-id", None)
        token = tenant._SLOT.set(tenant.TenantSlot("acme"))
        us: dict[str, list[float]] = {"off": [], "on": []}
        inline: dict[str, list[float]] = {"off": [], "on": []}  # the serving thread's alone
        start = 0
        for i in range(args.repeats + 1):
            for name in (("off", "on") if i % 2 == 0 else ("on", "off")):
                want = written[0] + args.requests
                cpu, own = time.process_time(), time.thread_time()
                play(books[name], args.requests, args.outputs, start, batch, head)
                own = time.thread_time() - own
                if name == "on":  # the writer's commits of these rows, counted too
                    while written[0] < want:
                        time.sleep(0.005)
                spent = time.process_time() - cpu
                start += args.requests
                if i > 0:  # the first pair warms up
                    us[name].append(1e6 * spent / args.requests)
                    inline[name].append(1e6 * own / args.requests)
        tenant._SLOT.reset(token)
        writer.close()
        size = (Path(tmp) / "energy.db").stat().st_size
    median, low, high = added(np.array(us["on"]), np.array(us["off"]))
    on_loop, loop_low, loop_high = added(np.array(inline["on"]), np.array(inline["off"]))
    print(f"{args.requests} requests x {args.outputs} outputs per half, {args.repeats} pairs")
    print(f"  API server CPU per request: ledger off {statistics.median(us['off']):.1f} µs, "
          f"on {statistics.median(us['on']):.1f} µs (medians)")
    print(f"  added by the ledger: {median:.1f} µs per request (95 % CI {low:.1f}-{high:.1f}), "
          f"the writer thread's commits included; on the serving thread alone {on_loop:.1f} µs "
          f"(95 % CI {loop_low:.1f}-{loop_high:.1f})")
    print(f"  file: {size / written[0]:.0f} bytes per row ({written[0]} rows)")
    finish_run(info, args, {"us_per_request": us, "added_us": median, "added_ci95_us": [low, high],
                            "serving_thread_us_per_request": inline,
                            "serving_thread_added_us": on_loop,
                            "serving_thread_added_ci95_us": [loop_low, loop_high],
                            "bytes_per_row": size / written[0]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
