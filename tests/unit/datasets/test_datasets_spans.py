"""The span dataset: detail-mode span files of a 2-layer TP=2 model (written with the real
`SpanWriter`, timestamps laid out by hand so that every duration is known) plus a meter log of a
simulated meter, read into one tree per forward step; and the meter log's writer and reader."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from support.toy_models import CausalLM

from vllm_piep.datasets.model import BadRows, DatasetError, Level
from vllm_piep.datasets.spans import load_span_dataset
from vllm_piep.meters.log import MeterLogError, MeterLogWriter, read_meter_log, record
from vllm_piep.meters.simulated import SimulatedMeter
from vllm_piep.model.flops import ModelShape
from vllm_piep.model.tree import ModelTree, ParallelLayout
from vllm_piep.spans.reader import SpanSet, span_files
from vllm_piep.spans.records import SpanHeader
from vllm_piep.spans.treemap import node_work
from vllm_piep.spans.writer import SpanWriter

US = 1_000
MS = 1_000_000
T0 = 10**12
SHAPE = ModelShape(hidden=8, intermediate=16, layers=2, heads=2, kv_heads=2, head_dim=4,
                   vocab=32, dtype_bytes=4, tp=2)
MODULE_US = 800  # rank 0; rank 1's modules are 10 µs shorter
# Execution order (the tree lists a layer's norms after its MLP) and the collective inside.
ORDER = [("embedding", "all_reduce")]
for _i in range(2):
    ORDER += [(f"layers.{_i}.input_layernorm", None), (f"layers.{_i}.self_attn", "all_reduce"),
              (f"layers.{_i}.post_attention_layernorm", None), (f"layers.{_i}.mlp", "all_reduce")]
ORDER += [("final_norm", None), ("logits", "all_gather")]
STEP_NS = (100 + len(ORDER) * MODULE_US + 100) * US  # 9 ms
# step -> (prefill, decode, requests, context); step 3 ran no model (no tree)
STEPS = {0: (5, 2, 3, 40), 1: (0, 3, 3, 50), 2: (0, 3, 3, 53), 3: (0, 0, 0, 0)}
RESOLUTION_S = 0.002  # steps (9 ms) and layers (3.2 ms) are resolved, modules (0.8 ms) not


def step_start(step: int) -> int:
    return T0 + step * 20 * MS


def module_times(step: int, index: int, rank: int) -> tuple[int, int, int, int]:
    """(start, end, arrival, completion) of the index-th module on a rank."""
    start = step_start(step) + (100 + index * MODULE_US) * US
    return (start, start + (MODULE_US - 10 * rank) * US, start + (200 + 30 * rank) * US,
            start + 300 * US)


def records(rank: int) -> list[dict]:
    out: list[dict] = []
    for step, (prefill, decode, reqs, context) in STEPS.items():
        s = step_start(step)
        out.append({"kind": "step", "step": step, "start_ns": s, "end_ns": s + STEP_NS,
                    "prefill_tokens": prefill, "decode_tokens": decode, "num_reqs": reqs,
                    "context_tokens": context, "attended_pairs": context + prefill + decode,
                    "sampled_rows": reqs})
        out.append({"kind": "resource", "t_ns": s + 5 * MS, "cpu_util": 10.0 + 20 * rank + step,
                    "cpu_mem_util": 50.0})
        if prefill + decode == 0:
            continue
        for index, (node, op) in enumerate(ORDER):
            start, end, arrival, completion = module_times(step, index, rank)
            kind = node.rsplit(".", 1)[-1] if node.startswith("layers.") else node
            out.append({"kind": "module", "step": step, "node": node, "type": kind,
                        "layer": int(node.split(".")[1]) if node.startswith("layers.") else None,
                        "start_ns": start, "end_ns": end, "prefill_tokens": prefill,
                        "decode_tokens": decode})
            if op:
                out.append({"kind": "collective", "step": step, "op": op, "group": "tp:0",
                            "world_size": 2, "rank_in_group": rank, "peer": None,
                            "seq": step * 100 + index, "bytes": (prefill + decode) * 32,
                            "dtype": "float32", "arrival_ns": arrival,
                            "completion_ns": completion, "node": node, "async": False})
    return out


def write_spans(directory: Path) -> list[Path]:
    paths = []
    for rank in range(2):
        layout = ParallelLayout(tp_size=2, tp_rank=rank)
        tree = ModelTree.from_module(CausalLM(tp=2), layout)
        header = SpanHeader(rank=rank, world_size=2, tp_rank=rank, tp_size=2, host="hostA",
                            pid=100 + rank, instance="i1", model="tiny-llama", mode="detail",
                            shape=dataclasses.asdict(SHAPE), tree=tree.to_dict())
        path = directory / f"i1-dp0-rank{rank:03d}.spans.jsonl"
        writer = SpanWriter(path, header)
        for r in records(rank):
            writer.put(r)
        writer.close()
        paths.append(path)
    return paths


def write_meter(path: Path) -> list[tuple[int, float, float]]:
    """Readings every 1 ms over steps 0 and 1 only (step 2 is past the log's end)."""
    times = list(range(step_start(0) - MS, step_start(1) + STEP_NS + 2 * MS, MS))
    ticks = iter([times[0], *times])
    meter = SimulatedMeter(clock=lambda: next(ticks))
    meter.resolution_s = RESOLUTION_S
    meter.start()
    out = []
    with MeterLogWriter(path, meter, {"host": "hostA"}) as log:
        for _ in times:
            reading = meter.read()
            log.append(reading)
            out.append((reading.t_ns, reading.joules["sim-gpu0"], reading.total))
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    directory = tmp_path_factory.mktemp("spans")
    write_spans(directory)
    return directory, write_meter(directory / "meter.jsonl")


def joules(readings: list, a: int, b: int, col: int = 2) -> float:
    t = np.array([r[0] for r in readings], dtype=float)
    cum = np.array([r[col] for r in readings])
    return float(np.interp(b, t, cum) - np.interp(a, t, cum))


def test_one_tree_per_forward_step_with_the_model_tree_under_a_step_root(run) -> None:
    directory, _ = run
    ds = load_span_dataset(directory)
    assert ds.issues == []
    assert sorted(ds.trees.tree_id) == [f"spans/i1/dp0/step{s}" for s in (0, 1, 2)]
    trees = ds.trees.set_index("tree_id")
    first = trees.loc["spans/i1/dp0/step0"]
    assert (first.dataset, first.model, first.group, first.hardware) == \
        ("spans", "tiny-llama", "i1", "hostA")
    assert (first.batch_size, first.tp, first.pp, first.dp) == (3, 2, 1, 1)
    assert np.isnan(first.seq_len)

    tree = ModelTree.merge([ModelTree.from_module(CausalLM(tp=2), ParallelLayout(tp_size=2))])
    nodes = ds.nodes[ds.nodes.tree_id == "spans/i1/dp0/step0"].set_index("node_id")
    assert set(nodes.index) == set(tree.nodes)
    root = nodes.loc["model"]
    assert (root.parent_id, root.level, root.type, root.component) == \
        ("", Level.MODEL, "step", "model")
    for node in tree:
        for child in node.children:
            assert nodes.loc[child, "parent_id"] == node.id
    for comm in tree.comm_nodes():
        kids = nodes[nodes.parent_id == comm.id]
        assert sorted(kids.type) == ["transfer", "wait"]
        assert set(kids.level) == {Level.COMMUNICATION} and nodes.loc[comm.id, "type"] == comm.type
        assert nodes.loc[f"{comm.id}/wait", "component"] == "sync_wait"
    assert nodes.loc["layers.0.self_attn@all_reduce/transfer", "component"] == "allreduce"
    assert nodes.loc["logits@all_gather/transfer", "component"] == "allgather"
    # Norms by the order they ran in: input_layernorm before attention.
    assert nodes.loc["layers.1.input_layernorm", "type"] == "attention_norm"
    assert nodes.loc["layers.1.post_attention_layernorm", "type"] == "mlp_norm"
    assert nodes.loc["layers.1.post_attention_layernorm", "component"] == "norm"
    assert (nodes.loc["layers.0", "type"], nodes.loc["layers.0", "level"]) == \
        ("layer", Level.MODULE)
    assert nodes.loc["layers.0.mlp", "source"].endswith("rank000.spans.jsonl")
    assert nodes.loc["layers.0.mlp", "line"] > 1


def test_features_are_what_the_spans_say(run) -> None:
    directory, _ = run
    ds = load_span_dataset(directory)
    nodes = ds.nodes[ds.nodes.tree_id == "spans/i1/dp0/step0"].set_index("node_id")
    index = [n for n, _ in ORDER].index("layers.0.mlp")
    per_rank = [module_times(0, index, r) for r in (0, 1)]
    assert nodes.loc["layers.0.mlp", "time_s"] == pytest.approx(
        np.mean([(e - s) for s, e, _, _ in per_rank]) / 1e9)
    assert nodes.loc["layers.0.mlp@all_reduce", "time_s"] == pytest.approx(
        np.mean([(c - a) for _, _, a, c in per_rank]) / 1e9)
    assert nodes.loc["layers.0.mlp@all_reduce/wait", "time_s"] == pytest.approx(15e-6)
    assert nodes.loc["layers.0.mlp@all_reduce/transfer", "time_s"] == pytest.approx(70e-6)
    assert nodes.loc["model", "time_s"] == pytest.approx(STEP_NS / 1e9)
    assert nodes.loc["layers.0", "time_s"] == pytest.approx(
        np.mean([module_times(0, 4, r)[1] - module_times(0, 1, r)[0] for r in (0, 1)]) / 1e9)

    spans = SpanSet.read(span_files(directory))
    tree = ModelTree.merge([ModelTree.from_dict(f.header.tree) for f in spans.files])
    row = spans.steps[(spans.steps.step == 0) & (spans.steps["rank"] == 0)].iloc[0]
    work = node_work(tree, SHAPE, row, spans.modules[spans.modules.step == 0])
    assert nodes.loc["layers.0.mlp", "gflop"] == pytest.approx(work["layers.0.mlp"].flops / 1e9)
    assert nodes.loc["logits", "mem_mib"] == pytest.approx(work["logits"].bytes / 2**20)
    assert nodes.loc["layers.0", "gflop"] == pytest.approx(sum(
        work[f"layers.0.{m}"].flops for m in ("input_layernorm", "self_attn",
                                              "post_attention_layernorm", "mlp")) / 1e9)
    assert nodes.loc["layers.0.mlp@all_reduce/transfer", "comm_mib"] == pytest.approx(
        7 * 32 / 2**20)
    assert nodes.loc["layers.0.mlp@all_reduce/wait", "comm_mib"] == 0
    assert nodes.loc["model", "comm_mib"] == pytest.approx(6 * 7 * 32 / 2**20)

    step = nodes.loc["layers.0.mlp"]
    assert (step.batch_size, step.prefill_tokens, step.decode_tokens, step.context_tokens) == \
        (3, 5, 2, 40)
    assert (step.tp, step.pp, step.dp, step.n_devices) == (2, 1, 1, 2)
    assert (step.layers, step.hidden_size, step.ffn_size, step.heads, step.kv_heads,
            step.head_dim, step.vocab_size) == (2, 8, 16, 2, 2, 4, 32)
    # Resource samples of both ranks, across ranks: the plain name is the mean.
    root = nodes.loc["model"]
    assert (root.cpu_util_pct, root.cpu_util_pct_std, root.cpu_util_pct_min,
            root.cpu_util_pct_max, root.mem_util_pct) == (20, 10, 10, 30, 50)
    assert {"cpu_util_pct", "cpu_util_pct_max"} <= set(ds.features)
    later = ds.nodes[ds.nodes.tree_id == "spans/i1/dp0/step1"].set_index("node_id")
    assert later.loc["model", "cpu_util_pct_max"] == 31  # step 1's own samples
    # No sample inside the window: the last one before its end (step 0's), as in
    # resources.window_features.
    assert later.loc["layers.0.mlp", "cpu_util_pct_min"] == 10
    assert nodes.loc["layers.0.mlp", "cpu_util_pct_min"] == 10  # none before: the first
    assert not ds.nodes[[f for f in ds.features if f != "device_energy_j"]].isna().any().any()


def test_energy_is_the_interpolated_meter_joules_where_resolved_and_nan_elsewhere(run) -> None:
    directory, readings = run
    ds = load_span_dataset(directory)
    nodes = ds.nodes.set_index(["tree_id", "node_id"])
    step0 = nodes.loc["spans/i1/dp0/step0"]
    s = step_start(0)
    assert step0.loc["model", "energy_j"] == pytest.approx(joules(readings, s, s + STEP_NS))
    assert step0.loc["model", "device_energy_j"] == pytest.approx(
        joules(readings, s, s + STEP_NS, col=1))
    # A layer: first child's start to the last child's end (rank 0's, the longer).
    a, b = module_times(0, 1, 0)[0], module_times(0, 4, 0)[1]
    assert step0.loc["layers.0", "energy_j"] == pytest.approx(joules(readings, a, b))
    assert step0.loc["layers.0", "energy_j"] > 0
    # 0.8 ms modules and 100 µs collectives under a 2 ms meter: unmeasured.
    assert np.isnan(step0.loc["layers.0.mlp", "energy_j"])
    assert np.isnan(step0.loc["layers.0.mlp@all_reduce/wait", "device_energy_j"])
    step1 = nodes.loc["spans/i1/dp0/step1"]
    s1 = step_start(1)
    assert step1.loc["model", "energy_j"] == pytest.approx(joules(readings, s1, s1 + STEP_NS))
    # Step 2 is past the meter log's last reading: not covered.
    assert nodes.loc["spans/i1/dp0/step2"]["energy_j"].isna().all()
    measured = ds.nodes.dropna(subset=["energy_j"])
    assert set(measured.node_id) == {"model", "layers.0", "layers.1"}


def test_without_a_meter_log_every_energy_is_nan(tmp_path: Path) -> None:
    write_spans(tmp_path)
    ds = load_span_dataset(tmp_path)
    assert ds.nodes.energy_j.isna().all() and ds.nodes.device_energy_j.isna().all()
    assert len(ds.trees) == 3 and ds.nodes.time_s.notna().all()
    with pytest.raises(DatasetError, match="no such meter log"):
        load_span_dataset(tmp_path, meter_log=tmp_path / "none.jsonl")
    (tmp_path / "meter.jsonl").write_text('{"schema": "piep.meter/1"}\n')
    with pytest.raises(DatasetError, match=r"meter.jsonl:1"):
        load_span_dataset(tmp_path)


def _edit(path: Path, edit) -> None:
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(edit(lines)))


def test_corrupt_and_unmapped_spans_are_reported_with_file_and_line(tmp_path: Path) -> None:
    rank0, rank1 = write_spans(tmp_path)
    write_meter(tmp_path / "meter.jsonl")
    # rank 1: a corrupt line inserted as line 5 (its neighbours stay usable).
    _edit(rank1, lambda lines: lines[:4] + ['{"kind": "module", "step": 0, "no\n'] + lines[4:])
    # rank 0: step 1's attention span renamed to a node the tree does not have.
    lines0 = rank0.read_text().splitlines()
    bad = next(i for i, t in enumerate(lines0) if '"step":1,' in t and "layers.1.self_attn" in t
               and '"module"' in t)
    _edit(rank0, lambda lines: [t.replace("layers.1.self_attn", "layers.7.self_attn")
                                if i == bad else t for i, t in enumerate(lines)])
    ds = load_span_dataset(tmp_path)
    reasons = [str(i) for i in ds.issues]
    assert any(r.startswith(f"{rank1}:5: malformed span record") for r in reasons), reasons
    assert any(r.startswith(f"{rank0}:{bad + 1}: step 1: module span 'layers.7.self_attn'")
               for r in reasons), reasons
    assert any(r.startswith(f"{rank0}:0: step 1: no span of 'layers.1.self_attn'")
               for r in reasons), reasons
    assert sorted(ds.trees.tree_id) == ["spans/i1/dp0/step0", "spans/i1/dp0/step2"]
    with pytest.raises(DatasetError, match=rf"{rank1.name}:5: malformed"):
        load_span_dataset(tmp_path, policy=BadRows.REJECT)


def test_a_missing_rank_file_leaves_its_instance_out_and_says_so(tmp_path: Path) -> None:
    write_spans(tmp_path)[1].unlink()
    ds = load_span_dataset(tmp_path)
    assert len(ds.trees) == 0
    assert "1 usable span files, tp x pp = 2" in str(ds.issues[0])


# ---------------------------------------------------------------------------- meter log
def test_meter_log_round_trips_and_tolerates_a_cut_last_line(tmp_path: Path) -> None:
    path = tmp_path / "meter.jsonl"
    written = write_meter(path)
    header, readings = read_meter_log(path)
    assert (header.meter, header.source, header.resolution_s, header.clock) == \
        ("simulated", "simulated", RESOLUTION_S, "monotonic")
    assert [(d.name, d.kind) for d in header.devices] == [("sim-gpu0", "gpu"), ("sim-cpu", "cpu")]
    assert header.extra == {"host": "hostA"}
    assert [(r.t_ns, r.joules["sim-gpu0"], r.total) for r in readings] == written
    with path.open("ab") as f:
        f.write(b'{"t_ns": 99999999999999, "joules": {"sim-gp')  # a crash mid-write
    assert len(read_meter_log(path)[1]) == len(written)


def test_malformed_meter_lines_are_named_by_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "meter.jsonl"
    write_meter(path)
    _edit(path, lambda lines: lines[:3] + ['{"t_ns": "soon", "joules": {}}\n'] + lines[3:])
    with pytest.raises(MeterLogError, match=r"meter.jsonl:4: .*t_ns"):
        read_meter_log(path)
    write_meter(path)
    _edit(path, lambda lines: lines[:4] + [lines[2]] + lines[4:])  # line 5 repeats line 3
    with pytest.raises(MeterLogError, match=r"meter.jsonl:5: t_ns .* goes back in time"):
        read_meter_log(path)
    path.write_text(json.dumps({"schema": "piep.meter/0"}) + "\n")
    with pytest.raises(MeterLogError, match=r"meter.jsonl:1: schema"):
        read_meter_log(path)


def test_record_samples_a_meter_in_the_background_until_stopped(tmp_path: Path) -> None:
    meter = SimulatedMeter()
    meter.start()
    stop = threading.Event()
    thread = threading.Thread(target=record, args=(meter, tmp_path / "m.jsonl", 0.005, stop))
    thread.start()
    stop.wait(0.05)
    stop.set()
    thread.join(timeout=5)
    header, readings = read_meter_log(tmp_path / "m.jsonl")
    assert header.meter == "simulated" and len(readings) >= 3
    totals = pd.Series([r.total for r in readings])
    assert totals.is_monotonic_increasing


def test_window_means_follow_the_rule_of_resources_window_features() -> None:
    from vllm_piep.datasets.spans import _window_means
    from vllm_piep.meters.resources import window_features

    samples = pd.DataFrame({"t_ns": [10, 20, 30, 40], "cpu_util": [1.0, 2.0, np.nan, 8.0]})
    t, values = samples["t_ns"].to_numpy(), samples[["cpu_util"]].to_numpy()
    for a, b in [(0, 5), (10, 30), (21, 29), (35, 100), (12, 18), (30, 30)]:
        ours = _window_means(t, values, ["cpu_util_pct"], a, b).get("cpu_util_pct", np.nan)
        theirs = window_features(samples, a, b)["cpu_util"]
        assert ours == pytest.approx(theirs, nan_ok=True), (a, b)
