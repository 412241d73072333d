"""kernels_trace on real traces recorded here: two CPU processes doing gloo collectives under
torch.profiler (one rank arriving late on purpose), and a profiled forward of the tiny Llama
with detail-mode ranges. The NCCL (Kineto GPU) and Nsight Systems paths have no GPU or nsys
here: they are tested structurally, on a hand-written trace and a SQLite database built with
the export's table layout."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from support.paths import ROOT, SUPPORT

from kernels_trace import (
    KinetoTraceError,
    clock_bounds,
    merge,
    names,
    read,
    read_kineto,
    read_nsys,
    write_span_files,
)
from kernels_trace.__main__ import main as cli_main
from kernels_trace.kineto import load
from vllm_piep.spans.reader import SpanSet, span_files
from vllm_piep.spans.records import module_range_name, step_range_name

NUMEL, CALLS, SLEEP_S, SLEEP_CALLS, SLEEPER = 4096, 5, 0.15, (1, 3), 1
MS = 1_000_000


def test_one_trace_without_json_prints_the_summary_and_writes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m kernels_trace TRACE --rank 0`, as README.md and docs/gpu-validation.md write
    it: the summary `--json` prints, and no file."""
    monkeypatch.chdir(tmp_path)
    trace = str(ROOT / "examples" / "traces" / "single-process.json.gz")
    assert cli_main([trace, "--rank", "0"]) == 0
    alone = capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
    assert cli_main([trace, "--rank", "0", "--json", "m.json"]) == 0
    assert alone == capsys.readouterr().out.replace(" -> m.json", "")
    assert "1 ranks:" in alone and "rank 0:" in alone


# --- (a) two gloo processes ----------------------------------------------------------------

@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gloo")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(SUPPORT / "ktrace_gloo_worker.py"), "--world", "2",
           "--store", str(out / "store"), "--out", str(out), "--calls", str(CALLS),
           "--numel", str(NUMEL), "--sleep-rank", str(SLEEPER),
           "--sleep-calls", ",".join(map(str, SLEEP_CALLS)), "--sleep-s", str(SLEEP_S)]
    procs = [subprocess.Popen(cmd + ["--rank", str(r)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=120)[0])
    finally:
        for proc in procs:  # only ours, by handle
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    return out


@pytest.fixture(scope="module")
def gloo_spans(gloo_run) -> SpanSet:
    return merge([read_kineto(gloo_run / f"rank{r}.json") for r in range(2)])


@pytest.mark.slow
def test_gloo_names_in_torch_trace(gloo_run):
    """What torch 2.13 really writes for gloo on CPU (the names kernels_trace.names lists)."""
    data = load(gloo_run / "rank0.json")
    seen = {(e.get("cat"), e.get("name")) for e in data["traceEvents"] if e.get("ph") == "X"}
    for name in ("c10d::allreduce_", "c10d::_allgather_base_", "c10d::broadcast_",
                 "c10d::_reduce_scatter_base_", "c10d::send"):
        assert ("cpu_op", name) in seen
    for name in ("gloo:all_reduce", "gloo:all_gather", "gloo:broadcast", "gloo:send"):
        assert ("user_annotation", name) in seen
    assert not any(n == "record_param_comms" for _, n in seen)  # gloo records no comms args
    dist = data["distributedInfo"]
    assert (dist["backend"], dist["rank"], dist["world_size"]) == ("gloo", 0, 2)
    assert int(data["baseTimeNanoseconds"]) > 0


def test_gloo_collectives_per_rank(gloo_spans):
    coll = gloo_spans.collectives
    for rank in (0, 1):
        mine = coll[coll["rank"] == rank].sort_values("seq")
        ar = mine[mine["op"] == "all_reduce"]
        assert len(ar) == CALLS
        assert (ar["bytes"] == NUMEL * 4).all() and (ar["dtype"] == "float32").all()
        assert list(ar["seq"]) == list(range(CALLS))
        assert list(ar["node"]) == [f"layers.{i}.self_attn" for i in range(CALLS)]
        assert (ar["step"] == 0).all() and (ar["group"] == "0").all()
        assert (ar["world_size"] == 2).all() and (ar["rank_in_group"] == rank).all()
        assert not mine["is_async"].any()
        others = mine.set_index("op").loc[["all_gather", "broadcast", "reduce_scatter"]]
        assert list(others["bytes"]) == [16 * 4, 8 * 2, 8 * 2 * 4]
        assert list(others["dtype"]) == ["float32", "float16", "float32"]
        assert (others["step"] == 1).all()
        assert others.loc["all_gather", "node"] == "logits"
        p2p = mine[mine["op"].isin(["send", "recv"])]
        assert list(p2p["op"]) == ["send" if rank == 0 else "recv"]
        assert list(p2p["peer"]) == [1 - rank] and list(p2p["bytes"]) == [32]


def test_gloo_matched_across_ranks_with_wait(gloo_spans):
    coll = gloo_spans.collectives
    assert (coll["participants"] == 2).all()
    assert (coll["wait_ns"] >= 0).all() and (coll["transfer_ns"] >= 0).all()
    assert coll["causal"].all()
    ar = coll[coll["op"] == "all_reduce"].set_index(["rank", "seq"])
    waiter = 1 - SLEEPER
    for seq in SLEEP_CALLS:
        # The rank that did not sleep waits for the one that did; the sleeper does not wait.
        assert 0.7 * SLEEP_S * 1e9 < ar.loc[(waiter, seq), "wait_ns"] < 2.5 * SLEEP_S * 1e9
        assert ar.loc[(SLEEPER, seq), "wait_ns"] < 0.3 * SLEEP_S * 1e9
    for seq in set(range(1, CALLS)) - set(SLEEP_CALLS):  # call 0 absorbs the profiler start
        assert ar.loc[(waiter, seq), "wait_ns"] < 0.5 * SLEEP_S * 1e9


def test_gloo_clock_is_shared_realtime(gloo_run, gloo_spans):
    """How the clock was determined: (1) baseTimeNanoseconds + ts of a range lies between the
    `time.time_ns()` readings taken around it in that process, so it is CLOCK_REALTIME;
    (2) no collective completes on one rank before the other rank arrived, beyond 1 ms."""
    tolerance = 1 * MS
    for rank in range(2):
        data = load(gloo_run / f"rank{rank}.json")
        base = int(data["baseTimeNanoseconds"])
        probes = [e for e in data["traceEvents"] if e.get("name") == "ktrace.clock_probe"]
        readings = json.loads((gloo_run / f"rank{rank}.probes.json").read_text())
        assert len(probes) == len(readings) == 2
        for event, (before, after) in zip(sorted(probes, key=lambda e: e["ts"]), readings):
            start = base + round(float(event["ts"]) * 1000)
            assert before - tolerance <= start <= after + tolerance
    coll = gloo_spans.collectives
    coll = coll[~coll["op"].isin(["send", "recv"])]
    other = coll.assign(rank=1 - coll["rank"])[["rank", "group", "seq", "arrival_ns"]]
    pairs = coll.merge(other, on=["rank", "group", "seq"], suffixes=("", "_other"))
    assert len(pairs) == len(coll)
    assert (pairs["completion_ns"] >= pairs["arrival_ns_other"] - tolerance).all()
    bounds = clock_bounds(gloo_spans.collectives).set_index("rank")
    assert bounds.loc[1, "lo_ns"] - tolerance <= 0 <= bounds.loc[1, "hi_ns"] + tolerance
    assert bounds.loc[0, ["lo_ns", "hi_ns"]].tolist() == [0, 0]


def _shifted(trace, shift_ns: int):
    """The trace as a host whose clock runs `shift_ns` ahead would have recorded it."""
    trace.steps = [s.model_copy(update={"start_ns": s.start_ns + shift_ns,
                                        "end_ns": s.end_ns + shift_ns}) for s in trace.steps]
    trace.modules = [m.model_copy(update={"start_ns": m.start_ns + shift_ns,
                                          "end_ns": m.end_ns + shift_ns})
                     for m in trace.modules]
    trace.collectives = [c.model_copy(update={"arrival_ns": c.arrival_ns + shift_ns,
                                              "completion_ns": c.completion_ns + shift_ns})
                         for c in trace.collectives]
    return trace


def test_explicit_offset_for_multi_host(gloo_run, gloo_spans):
    shift = 3_000 * MS
    traces = [read_kineto(gloo_run / "rank0.json"),
              _shifted(read_kineto(gloo_run / "rank1.json"), shift)]
    skewed = merge(traces, clock_offsets_ns={0: 0, 1: 0})
    assert not skewed.collectives["causal"].all()
    bounds = clock_bounds(skewed.collectives).set_index("rank")
    assert bounds.loc[1, "lo_ns"] <= shift <= bounds.loc[1, "hi_ns"]
    fixed = merge(traces, clock_offsets_ns={1: shift})
    cols = ["rank", "op", "seq", "arrival_ns", "completion_ns", "wait_ns", "transfer_ns"]
    pd.testing.assert_frame_equal(fixed.collectives[cols], gloo_spans.collectives[cols])
    same = read_kineto(gloo_run / "rank1.json", clock_offset_ns=shift)
    assert same.clock_offset_ns == shift


def test_span_files_and_cli(gloo_run, gloo_spans, tmp_path):
    traces = [read_kineto(gloo_run / f"rank{r}.json") for r in range(2)]
    paths = write_span_files(traces, tmp_path / "spans")
    back = SpanSet.read(span_files(tmp_path / "spans"))
    assert back.files[0].header.clock == "CLOCK_REALTIME"
    assert back.files[1].header.mode == "detail"
    cols = ["rank", "op", "group", "seq", "bytes", "wait_ns", "transfer_ns"]
    pd.testing.assert_frame_equal(back.collectives[cols], gloo_spans.collectives[cols])
    assert len(paths) == 2
    out = tmp_path / "merged.json"
    assert cli_main([str(gloo_run / "rank0.json"), str(gloo_run / "rank1.json"),
                     "--json", str(out), "--group-name", "default_pg=world"]) == 0
    merged = json.loads(out.read_text())
    assert len(merged["collectives"]) == len(gloo_spans.collectives)
    assert {c["group"] for c in merged["collectives"]} == {"world"}
    assert all(c["wait_ns"] >= 0 and c["transfer_ns"] >= 0 for c in merged["collectives"])
    assert [b["rank"] for b in merged["clock_bounds"]] == [0, 1]


# --- (b) a profiled tiny-model forward -----------------------------------------------------

def test_tiny_model_forward_modules(tiny_model, tmp_path):
    from support.ktrace_annotate import profile_forward

    path = tmp_path / "forward.json"
    nodes = profile_forward(tiny_model, path)
    with pytest.raises(KinetoTraceError, match="rank"):
        read_kineto(path)  # no torch.distributed: the rank must be given
    trace = read_kineto(path, rank=0)
    assert [s.step for s in trace.steps] == [0]
    step = trace.steps[0]
    got = {m.node: m for m in trace.modules}
    assert len(trace.modules) == len(got) == len(nodes)
    for _, node_type, node in nodes:
        span = got[node]
        assert span.type == node_type and span.step == 0
        assert step.start_ns <= span.start_ns < span.end_ns <= step.end_ns
        layer = int(node.split(".")[1]) if node.startswith("layers.") else None
        assert span.layer == layer
        if layer is not None and node != f"layers.{layer}":
            outer = got[f"layers.{layer}"]
            assert outer.start_ns <= span.start_ns and span.end_ns <= outer.end_ns
    order = [m.node for m in sorted(trace.modules, key=lambda m: m.start_ns)]
    assert order[0] == "embedding" and order[-2:] == ["final_norm", "logits"]
    layers = json.loads((tiny_model / "config.json").read_text())["num_hidden_layers"]
    assert order.index("layers.0") < order.index(f"layers.{layers - 1}")
    assert trace.collectives == []
    # the command line takes the same single-process trace with --rank, and without it says so
    out = tmp_path / "single.json"
    assert cli_main([str(path), "--rank", "0", "--json", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert {m["node"] for m in merged["modules"]} == {node for _, _, node in nodes}
    assert {m["rank"] for m in merged["modules"]} == {0} and len(merged["steps"]) == 1
    assert cli_main([str(path), "--rank", "3", "--json", str(out)]) == 0
    assert {m["rank"] for m in json.loads(out.read_text())["modules"]} == {3}
    assert cli_main([str(path), "--json", str(out)]) == 2
    # A CPU run's work: each op's own time, once: together, the outermost ops' spans.
    kernels = trace.kernels
    assert set(kernels["device"]) == {"cpu"} and (kernels["ns"] >= 0).all()
    ops = [(e["tid"], float(e["ts"]), float(e["ts"]) + float(e["dur"]))
           for e in load(path)["traceEvents"] if e.get("cat") == "cpu_op"]
    outermost = sum(round((end - start) * 1000) for i, (tid, start, end) in enumerate(ops)
                    if not any(j != i and t == tid and s <= start and end <= e
                               for j, (t, s, e) in enumerate(ops)))
    assert kernels["ns"].sum() == pytest.approx(outermost, rel=1e-3)
    coverage = merged["kernel_coverage"]["0"]
    assert coverage["in_modules_ns"] == sum(coverage["by_type_ns"].values())
    assert set(coverage["by_type_ns"]) <= {t for _, t, _ in nodes}
    assert 0.5 < coverage["share_in_modules"] <= 1


# --- vLLM's CPU shared-memory ops: real trace, stand-in ops with vLLM's schemas --------------

_SHM_LIB = None


def _shm_ops():
    """Ops named and shaped like vLLM's `_C::shm_*` (that library needs AVX-512 here): the
    trace events are real, the ops do nothing."""
    global _SHM_LIB
    import torch

    if _SHM_LIB is None:
        lib = torch.library.Library("ktrace_shm", "DEF")
        lib.define("shm_allreduce(int handle, Tensor(a!) data) -> ()")
        lib.define("shm_all_gather(int handle, Tensor data, Tensor(a!) output) -> ()")
        lib.define("shm_send_tensor_list(int handle, Tensor[] tensor_list, int dst) -> ()")
        lib.define("shm_recv_tensor_list(int handle, int src) -> Tensor[]")
        lib.impl("shm_allreduce", lambda handle, data: None, "CPU")
        lib.impl("shm_all_gather", lambda handle, data, output: None, "CPU")
        lib.impl("shm_send_tensor_list", lambda handle, tensors, dst: None, "CPU")
        lib.impl("shm_recv_tensor_list", lambda handle, src: [torch.zeros(2)],
                 "CompositeExplicitAutograd")
        _SHM_LIB = lib
    return torch.ops.ktrace_shm


def test_shm_ops_from_real_trace(tmp_path):
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    ops = _shm_ops()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof, \
            record_function(step_range_name(4)):
        with record_function(module_range_name("attention", "layers.0.self_attn")):
            ops.shm_allreduce(7, torch.ones(64, dtype=torch.bfloat16))
        ops.shm_all_gather(7, torch.ones(8), torch.empty(16))
        ops.shm_send_tensor_list(7, [torch.ones(2)], 1)
        ops.shm_recv_tensor_list(7, 1)
    path = tmp_path / "shm.json"
    prof.export_chrome_trace(str(path))
    trace = read_kineto(path, rank=0, default_group="tp:0")
    got = [(c.op, c.bytes, c.dtype, c.peer, c.node, c.step, c.group)
           for c in trace.collectives]
    assert got == [
        ("all_reduce", 128, "bfloat16", None, "layers.0.self_attn", 4, "tp:0"),
        ("all_gather", 32, "float32", None, None, 4, "tp:0"),
        ("send", 0, "", 1, None, 4, "tp:0"),  # a TensorList: the trace gives no dtype
        ("recv", 0, "", 1, None, 4, "tp:0"),
    ]
    assert [c.seq for c in trace.collectives] == [0, 1, 0, 1]  # per peer for send/recv


# --- NCCL in a Kineto GPU trace: structural, hand-written in the layout Kineto writes --------

def _nccl_rank(rank: int, late_us: float) -> dict:
    cpu, launch = (100 + rank, 100 + rank), 40 + rank
    t0 = 1000.0 + late_us  # microseconds since baseTimeNanoseconds

    def x(cat, name, pid, tid, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts,
                "dur": dur, "args": args}

    comm = {"Collective name": "allreduce", "In msg nelems": 2048, "Out msg nelems": 2048,
            "Group size": 2, "dtype": "BFloat16", "Process Group Name": "3",
            "Process Group Description": "undefined", "Process Group Ranks": "[0, 1]",
            "Seq": 7}
    p2p = {"Collective name": "send" if rank == 0 else "recv", "In msg nelems": 16,
           "Out msg nelems": 16, "Group size": 2, "dtype": "Float",
           "Process Group Name": "5", "Process Group Ranks": "[0, 1]",
           ("Dst Rank" if rank == 0 else "Src Rank"): 1 - rank}
    events = [
        x("user_annotation", step_range_name(3), *cpu, 990.0, 200.0),
        x("user_annotation", module_range_name("attention", "layers.0.self_attn"), *cpu,
          995.0, 100.0),
        x("cpu_op", "c10d::allreduce_", *cpu, t0, 10.0),
        x("cpu_op", "record_param_comms", *cpu, t0 + 1, 8.0, **comm),
        x("cuda_runtime", "cudaLaunchKernel", *cpu, t0 + 2, 5.0, correlation=launch),
        x("kernel", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
          0, 7, 1050.0 if rank == 0 else 1080.0, 60.0 if rank == 0 else 30.0,
          correlation=launch, **comm),
        x("cuda_runtime", "cudaLaunchKernel", *cpu, 1150.0, 2.0, correlation=launch + 10),
        x("kernel", "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 0, 9,
          1160.0, 5.0, correlation=launch + 10, **p2p),
        x("gpu_user_annotation", step_range_name(3), 0, 7, 1040.0, 200.0),
    ]
    return {"schemaVersion": 1, "baseTimeNanoseconds": 1_790_000_000_000_000_000,
            "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2},
            "traceEvents": events}


def test_nccl_kineto_structural(tmp_path):
    paths = []
    for rank in range(2):
        paths.append(tmp_path / f"nccl{rank}.json")
        paths[-1].write_text(json.dumps(_nccl_rank(rank, late_us=5.0 * rank)))
    traces = [t for p in paths for t in read(p, group_names={"3": "tp:0", "5": "pp:0"})]
    assert all(t.gpu for t in traces)
    spans = merge(traces)
    coll = spans.collectives.set_index(["rank", "op"])
    assert len(coll) == 4  # the c10d op that launched the kernel is not a second span
    ar0, ar1 = coll.loc[(0, "all_reduce")], coll.loc[(1, "all_reduce")]
    for ar in (ar0, ar1):
        assert (ar["group"], ar["seq"], ar["bytes"], ar["dtype"]) == ("tp:0", 7, 4096,
                                                                      "bfloat16")
        assert (ar["node"], ar["step"], ar["world_size"]) == ("layers.0.self_attn", 3, 2)
    # Kernels: rank 0 runs 1050-1110 us, rank 1 1080-1110 us: rank 0 waits 30 us.
    assert (ar0["wait_ns"], ar0["transfer_ns"]) == (30_000, 30_000)
    assert (ar1["wait_ns"], ar1["transfer_ns"]) == (0, 30_000)
    send, recv = coll.loc[(0, "send")], coll.loc[(1, "recv")]
    assert (send["peer"], recv["peer"], send["group"], send["bytes"]) == (1, 0, "pp:0", 64)
    assert send["seq"] == recv["seq"] == 0
    assert pd.isna(send["node"]) and send["step"] == 3


def test_gpu_kernels_go_to_the_module_open_where_they_were_launched(tmp_path):
    """Kernels run later on the GPU than their launch; the module they belong to is the one
    open on the launching thread. A kernel whose launch the trace lost belongs to none."""
    cpu = (100, 100)

    def x(cat, name, pid, tid, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts,
                "dur": dur, "args": args}

    attention = module_range_name("attention", "layers.0.self_attn")
    mlp = module_range_name("mlp", "layers.0.mlp")
    events = [
        x("user_annotation", step_range_name(5), *cpu, 0.0, 100.0),
        x("user_annotation", attention, *cpu, 10.0, 20.0),
        x("cuda_runtime", "cudaLaunchKernel", *cpu, 12.0, 2.0, correlation=1),
        x("user_annotation", mlp, *cpu, 40.0, 20.0),
        x("cuda_runtime", "cudaLaunchKernel", *cpu, 42.0, 2.0, correlation=2),
        x("cuda_runtime", "cudaMemcpyAsync", *cpu, 45.0, 2.0, correlation=3),
        x("cuda_runtime", "cudaLaunchKernel", *cpu, 70.0, 2.0, correlation=4),  # no module
        x("kernel", "flash_fwd_kernel", 0, 7, 50.0, 30.0, correlation=1),  # after its range
        x("kernel", "gemm_kernel", 0, 7, 80.0, 60.0, correlation=2),
        x("gpu_memcpy", "Memcpy DtoD", 0, 8, 140.0, 5.0, correlation=3),
        x("kernel", "argmax_kernel", 0, 7, 145.0, 4.0, correlation=4),
        x("kernel", "orphan_kernel", 0, 7, 150.0, 1.0, correlation=99),  # launch not traced
        x("cpu_op", "aten::mm", *cpu, 41.0, 10.0),  # CPU ops: not device work in a GPU trace
    ]
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"schemaVersion": 1, "baseTimeNanoseconds": 0,
                                "traceEvents": events}))
    trace = read_kineto(path, rank=0)
    got = trace.kernels.set_index("name")
    assert set(got.index) == {"flash_fwd_kernel", "gemm_kernel", "Memcpy DtoD",
                              "argmax_kernel", "orphan_kernel"}
    assert set(got["device"]) == {"gpu"} and list(got["step"].unique()) in ([5, -1], [-1, 5])
    assert got.loc["flash_fwd_kernel", "node"] == "layers.0.self_attn"
    assert got.loc["gemm_kernel", "node"] == got.loc["Memcpy DtoD", "node"] == "layers.0.mlp"
    assert pd.isna(got.loc["argmax_kernel", "node"]) and pd.isna(got.loc["orphan_kernel", "node"])
    assert got.loc["orphan_kernel", "step"] == -1
    out = tmp_path / "merged.json"
    assert cli_main([str(path), "--rank", "0", "--json", str(out)]) == 0
    merged = json.loads(out.read_text())
    coverage = merged["kernel_coverage"]["0"]
    assert coverage["total_ns"] == 100_000 and coverage["in_modules_ns"] == 95_000
    assert coverage["share_in_modules"] == pytest.approx(0.95)
    assert coverage["by_type_ns"] == {"attention": 30_000, "mlp": 65_000}
    assert coverage["outside_modules_ns"] == {"argmax_kernel": 4_000, "orphan_kernel": 1_000}
    rows = {(r["node"], r["name"]): (r["count"], r["ns"]) for r in merged["kernels"]}
    assert rows[("layers.0.mlp", "gemm_kernel")] == (1, 60_000)
    assert rows[(None, "argmax_kernel")] == (1, 4_000)


# --- Nsight Systems SQLite export: structural ----------------------------------------------

SESSION_UTC_NS = 1_790_000_000_000_000_000


def _gtid(pid: int, tid: int) -> int:
    return (1 << 56) | (pid << 24) | tid  # hardware id above bit 48, as exports serialise it


def _nsys_db(path: Path) -> None:
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE TARGET_INFO_SESSION_START_TIME (utcEpochNs INTEGER, utcTime TEXT,
            localTime TEXT);
        CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT
            NULL, rangeId INTEGER, category INTEGER, color INTEGER, text TEXT, globalTid
            INTEGER, endGlobalTid INTEGER, textId INTEGER, domainId INTEGER);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL,
            deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, streamId INTEGER NOT NULL,
            correlationId INTEGER, globalPid INTEGER, demangledName INTEGER NOT NULL,
            shortName INTEGER NOT NULL, mangledName INTEGER, gridX INTEGER, blockX INTEGER);
        CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT NULL,
            eventClass INTEGER NOT NULL, globalTid INTEGER, correlationId INTEGER,
            nameId INTEGER NOT NULL, returnValue INTEGER NOT NULL, callchainId INTEGER);
    """)
    strings = ["ncclDevKernel_AllReduce_Sum_f32_RING_LL",
               "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
               "ncclKernel_AllGather_RING_LL_Sum_int8_t",
               "ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWorkElem)",
               "ncclDevKernel_Generic", "ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)",
               "cudaLaunchKernel", "void at::native::vectorized_elementwise_kernel<4>()",
               step_range_name(2)]
    db.executemany("INSERT INTO StringIds VALUES (?, ?)", list(enumerate(strings)))
    db.execute("INSERT INTO TARGET_INFO_SESSION_START_TIME VALUES (?, '', '')",
               (SESSION_UTC_NS,))
    nvtx, kernels, runtime = [], [], []
    for rank, pid, late in ((0, 4001, 0), (1, 3999, 400)):  # rank 1 has the lower pid
        main = _gtid(pid, pid)
        nvtx += [  # start, end, eventType, text, textId, globalTid
            (1_000, 9_000, 59, None, 8, main),  # a registered string
            (1_100, 2_000, 59, module_range_name("attention", "layers.1.self_attn")
             + ", seq = 12, op_id = 5", None, main),  # emit_nvtx's tail
            (1_100, 1_200, 34, "a mark", None, main),
            (3_000, 3_100, 59, "ncclAllReduce", None, main),
            (4_000, 4_100, 59, "ncclAllGather", None, main),
        ]
        runtime += [(1_500, 1_510, 1, main, 10, 6, 0), (1_600, 1_610, 1, main, 11, 6, 0),
                     (3_010, 3_020, 1, main, 12, 6, 0), (4_010, 4_020, 1, main, 13, 6, 0)]
        gp = _gtid(pid, 0)
        kernels += [
            (5_000 + late, 6_000, rank, 1, 7, 10, gp, 1, 0),  # all-reduce in the module
            (2_000, 2_100, rank, 1, 7, 11, gp, 7, 7),  # not a collective
            (7_000, 7_500 + late, rank, 1, 7, 12, gp, 3, 2),  # old-style all-gather name
            (8_000, 8_200, rank, 1, 7, 13, gp, 5, 4),  # generic: op from NCCL's range
        ]
    db.executemany("INSERT INTO NVTX_EVENTS (start, end, eventType, text, textId, globalTid) "
                   "VALUES (?, ?, ?, ?, ?, ?)", nvtx)
    db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, ?, ?, ?, ?, ?, NULL)",
                   runtime)
    db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL (start, end, deviceId, contextId, "
                   "streamId, correlationId, globalPid, demangledName, shortName) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", kernels)
    db.commit()
    db.close()


def test_nsys_sqlite_structural(tmp_path):
    path = tmp_path / "report.sqlite"
    _nsys_db(path)
    traces = read_nsys(path, group_names={"nccl": "tp:0"})
    assert [(t.rank, t.pid) for t in traces] == [(0, 4001), (1, 3999)]  # by GPU, not pid
    assert all(t.clock == "CLOCK_REALTIME" and t.gpu for t in traces)
    t0 = traces[0]
    assert [(s.step, s.start_ns) for s in t0.steps] == [(2, SESSION_UTC_NS + 1_000)]
    assert [(m.node, m.layer, m.step) for m in t0.modules] == [("layers.1.self_attn", 1, 2)]
    got = [(c.op, c.dtype, c.node, c.step, c.seq, c.group) for c in t0.collectives]
    assert got == [("all_reduce", "float32", "layers.1.self_attn", 2, 0, "tp:0"),
                   ("all_gather", "int8", None, 2, 1, "tp:0"),
                   ("all_gather", "", None, 2, 2, "tp:0")]
    spans = merge(traces)
    ar = spans.collectives[spans.collectives["op"] == "all_reduce"].set_index("rank")
    assert (ar.loc[0, "wait_ns"], ar.loc[0, "transfer_ns"]) == (400, 600)
    assert (ar.loc[1, "wait_ns"], ar.loc[1, "transfer_ns"]) == (0, 600)
    assert spans.collectives["causal"].all()
    single = read_nsys(path, ranks={3999: 0})
    assert [(t.rank, t.pid) for t in single] == [(0, 3999)]
    # Every kernel is in the kernel table, in the module open where it was launched.
    table = t0.kernels.set_index("start_ns")
    assert len(table) == 4 and set(table["device"]) == {"gpu"}
    assert table.loc[SESSION_UTC_NS + 2_000, "node"] == "layers.1.self_attn"  # not NCCL
    assert table.loc[SESSION_UTC_NS + 5_000, "node"] == "layers.1.self_attn"
    assert table["node"].isna().sum() == 2


# --- names ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name, op", [
    ("allreduce_", "all_reduce"), ("_allgather_base_", "all_gather"),
    ("reduce_scatter_tensor_coalesced", "reduce_scatter"), ("alltoall_base_", "all_to_all"),
    ("recv_", "recv"), ("recvAnySource", "recv"), ("shm_send_tensor_list", "send"),
    ("AllReduce", "all_reduce"), ("Broadcast", "broadcast"), ("barrier", "barrier"),
    ("allgather_into_tensor_coalesced", "all_gather"), ("aten::add", None),
])
def test_canonical_op(name, op):
    assert names.canonical_op(name) == op


@pytest.mark.parametrize("kernel, op", [
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
     "all_reduce"),
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", "all_reduce"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "reduce_scatter"),
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclWorkElem)", "send_recv"),
    ("ncclAllReduceRingLLKernel_sum_f32(ncclColl)", "all_reduce"),
    ("ncclDevKernel_Generic_1(ncclDevKernelArgsStorage<4096ul>)", "nccl"),
    ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>(...)", "all_reduce"),
    ("void at::native::vectorized_elementwise_kernel<4>()", None),
])
def test_nccl_kernel_names(kernel, op):
    assert names.nccl_kernel(kernel) == op
