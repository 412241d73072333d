"""One rank of the two-process gloo run that tests/unit/spans/test_kernels_trace.py records: a
few all-reduces of a known size under torch.profiler, the sleeping rank arriving late to some
of them, then one of each other collective; writes the Chrome trace and clock probes.

It leaves without tearing gloo or the profiler down: once both ranks have written their files
and every collective has completed on both (a rendezvous on the file store, no sockets), it
exits at once. With a final barrier, `destroy_process_group` and a normal interpreter exit, a
rank aborted now and then ("terminate called without an active exception") after its peer had
passed the barrier cleanly: a teardown race below Python (gloo keeps an open report of one,
"Barrier followed by context destruction causes some participants to fail"). The traces need
none of that teardown.

    python ktrace_gloo_worker.py --rank R --world 2 --store FILE --out DIR [options]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from vllm_piep.spans.records import module_range_name, step_range_name


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--numel", type=int, default=4096)
    parser.add_argument("--sleep-rank", type=int, default=1)
    parser.add_argument("--sleep-calls", default="1,3")
    parser.add_argument("--sleep-s", type=float, default=0.15)
    args = parser.parse_args()
    rank, world = args.rank, args.world
    sleep_calls = {int(c) for c in args.sleep_calls.split(",") if c}
    torch.set_num_threads(1)
    faulthandler.enable()  # an abort shows every thread's Python stack in the test's message
    store = dist.FileStore(str(args.store), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    x = torch.ones(args.numel, dtype=torch.float32)
    dist.all_reduce(x)  # warm-up, outside the trace
    dist.barrier()
    probes = []
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        before = time.time_ns()
        with record_function("ktrace.clock_probe"):
            pass
        probes.append((before, time.time_ns()))
        with record_function(step_range_name(0)):
            for i in range(args.calls):
                if rank == args.sleep_rank and i in sleep_calls:
                    time.sleep(args.sleep_s)
                with record_function(module_range_name("attention", f"layers.{i}.self_attn")):
                    dist.all_reduce(x)
        with record_function(step_range_name(1)):
            with record_function(module_range_name("logits", "logits")):
                out = torch.empty(16 * world, dtype=torch.float32)
                dist.all_gather_into_tensor(out, torch.ones(16, dtype=torch.float32))
            dist.broadcast(torch.ones(8, dtype=torch.float16), src=0)
            dist.reduce_scatter_tensor(torch.empty(8), torch.ones(8 * world))
            if rank == 0:
                dist.send(torch.ones(4, dtype=torch.int64), dst=1)
            elif rank == 1:
                dist.recv(torch.empty(4, dtype=torch.int64), src=0)
        before = time.time_ns()
        with record_function("ktrace.clock_probe"):
            pass
        probes.append((before, time.time_ns()))
    args.out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(args.out / f"rank{rank}.json"))
    (args.out / f"rank{rank}.probes.json").write_text(json.dumps(probes))
    sys.stdout.flush()
    sys.stderr.flush()
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{r}" for r in range(world)])
    os._exit(0)


if __name__ == "__main__":
    main()
