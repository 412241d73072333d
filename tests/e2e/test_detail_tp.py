"""Detail mode on a real tensor-parallel (TP=2, eager) vLLM on CPU: module, collective and step
spans from both ranks, and the model tree they cover."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.detail_runs import DetailRun, detail_run

from vllm_piep.spans.treemap import collective_nodes, coverage, forward_steps, merged_tree

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> DetailRun:
    return detail_run(tiny_model, tmp_path_factory.mktemp("detail_tp"),
                      ["--tensor-parallel-size", "2"], {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                      profile=True)


def test_both_ranks_write_a_file_with_the_tree_and_serving_still_works(run: DetailRun) -> None:
    headers = sorted((f.header for f in run.spans.files), key=lambda h: h.rank)
    assert [(h.rank, h.tp_rank, h.tp_size, h.mode) for h in headers] == \
        [(0, 0, 2, "detail"), (1, 1, 2, "detail")]
    assert all(h.clock_offset_ns == 0 for h in headers)  # one host: one CLOCK_MONOTONIC
    for response in run.responses:
        assert response["usage"]["energy"]["joules"] > 0
        assert response["usage"]["completion_tokens"] == 6


def test_two_all_reduces_per_layer_per_step_with_tokens_times_hidden_bytes(
        run: DetailRun) -> None:
    hidden, layers = run.config["hidden_size"], run.config["num_hidden_layers"]
    element = 4  # float32
    steps = run.spans.steps.set_index(["rank", "step"])
    c = run.spans.collectives
    layer_reduces = c[(c["op"] == "all_reduce") & c["node"].str.startswith("layers.")]
    checked = 0
    for (rank, step), frame in layer_reduces.groupby(["rank", "step"]):
        row = steps.loc[(rank, step)]
        tokens = int(row["prefill_tokens"] + row["decode_tokens"])
        for layer in range(layers):
            in_layer = frame[frame["node"].str.startswith(f"layers.{layer}.")]
            assert sorted(in_layer["node"]) == [f"layers.{layer}.mlp",
                                                f"layers.{layer}.self_attn"], (rank, step)
        assert (frame["bytes"] == tokens * hidden * element).all(), (rank, step, tokens)
        checked += 1
    assert checked == 2 * len(forward_steps(run.spans))
    assert set(c["group"]) == {"tp:0"} and (c["world_size"] == 2).all()


def test_step_spans_carry_the_counts_module_work_needs(run: DetailRun) -> None:
    steps = run.spans.steps
    decode_only = steps[(steps["prefill_tokens"] == 0) & (steps["decode_tokens"] > 0)]
    assert len(decode_only) >= 4
    # A decode token after c cached ones attends to c + 1 keys; every decoding request samples.
    assert (decode_only["attended_pairs"] ==
            decode_only["context_tokens"] + decode_only["decode_tokens"]).all()
    assert (decode_only["sampled_rows"] == decode_only["num_reqs"]).all()
    prefill = steps[steps["prefill_tokens"] > 0]
    q = prefill["prefill_tokens"] + prefill["decode_tokens"]
    assert (prefill["attended_pairs"] >= q).all()  # each token attends at least to itself


def test_every_module_node_has_its_work_per_rank(run: DetailRun) -> None:
    from vllm_piep.spans.treemap import header_shape, node_work

    shape = header_shape(run.spans)
    assert shape is not None and (shape.tp, shape.hidden) == (2, run.config["hidden_size"])
    tree = merged_tree(run.spans)
    step = forward_steps(run.spans)[-1]
    row = run.spans.steps[run.spans.steps["step"] == step].iloc[0]
    work = node_work(tree, shape, row, run.spans.modules[run.spans.modules["step"] == step])
    assert set(work) == {n.id for n in tree.module_nodes()}
    assert all(w.flops > 0 and w.bytes > 0 for n, w in work.items() if n != "embedding")
    # Column-parallel attention and MLP: each rank does half the projections' FLOPs.
    whole = node_work(tree, shape, row, per_rank=False)
    assert work["layers.0.mlp"].flops == pytest.approx(whole["layers.0.mlp"].flops / 2)


def test_wait_and_transfer_are_never_negative_and_some_rank_waits(run: DetailRun) -> None:
    c = run.spans.collectives
    assert (c["participants"] == 2).all()  # every call matched on both ranks
    assert (c["wait_ns"] >= 0).all() and (c["transfer_ns"] >= 0).all()
    assert c["causal"].all()  # nobody finished before the other arrived
    assert (c["wait_ns"] > 0).any()


def test_module_and_collective_spans_nest_inside_their_step_and_module(run: DetailRun) -> None:
    spans = run.spans
    steps = spans.steps.set_index(["rank", "step"])
    for _, m in spans.modules.iterrows():
        s = steps.loc[(m["rank"], m["step"])]
        assert s["start_ns"] <= m["start_ns"] <= m["end_ns"] <= s["end_ns"]
    modules = spans.modules.set_index(["rank", "step", "node"])
    for _, c in spans.collectives.iterrows():
        m = modules.loc[(c["rank"], c["step"], c["node"])]
        assert m["start_ns"] <= c["arrival_ns"] <= c["completion_ns"] <= m["end_ns"]


def test_every_forward_step_maps_onto_the_tree_one_to_one(run: DetailRun) -> None:
    tree = merged_tree(run.spans)
    assert "layers.1.mlp@all_reduce" in tree.nodes and "logits@all_gather" in tree.nodes
    steps = forward_steps(run.spans)
    assert len(steps) >= 6
    for step in steps:
        result = coverage(run.spans, step, tree)
        assert result.total, (step, result)
    assert collective_nodes(tree, run.spans.collectives).notna().all()


def test_spans_cli_shows_a_step(run: DetailRun) -> None:
    step = forward_steps(run.spans)[-1]
    proc = subprocess.run([sys.executable, "-m", "vllm_piep.spans", "show", str(run.spans_dir),
                           "--step", str(step)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    assert "layers.1.mlp@all_reduce" in proc.stdout
    assert "spans onto tree nodes: total" in proc.stdout
    assert "GFLOP/s" in proc.stdout
    tree = subprocess.run([sys.executable, "-m", "vllm_piep.spans", "tree", str(run.spans_dir)],
                          capture_output=True, text=True, timeout=120)
    assert tree.returncode == 0, tree.stderr
    assert "layers.0.self_attn@all_reduce/wait [wait]" in tree.stdout


def test_kernels_trace_of_vllms_own_profiler_gives_the_same_spans(run: DetailRun) -> None:
    """vLLM's torch profiler ran around the last request: its per-rank Kineto traces, read by
    kernels_trace, hold the same module ranges (opened by detail mode) and collectives (gloo
    works) as the span files, for the same steps, at the same times."""
    from kernels_trace import merge, read_kineto

    rank_traces = [p for p in run.traces if p.name.startswith("rank")]
    assert len(rank_traces) == 2, run.traces
    traced = merge([read_kineto(p, rank=int(p.name[4])) for p in rank_traces])
    steps = sorted(set(traced.steps["step"]))
    assert len(steps) >= 6  # prefill + 5 decodes of the profiled request

    key = ["rank", "step", "node"]
    ours = run.spans.modules[run.spans.modules["step"].isin(steps)].set_index(key).sort_index()
    theirs = traced.modules.set_index(key).sort_index()
    assert list(theirs.index) == list(ours.index)
    offset = {f.header.rank: f.header.realtime_offset_ns for f in run.spans.files}
    shift = ours.index.get_level_values("rank").map(offset)
    assert ((theirs["start_ns"] - (ours["start_ns"] + shift)).abs() < 2_000_000).all()

    cols = ["rank", "step", "op", "node", "bytes"]
    ours_c = run.spans.collectives[run.spans.collectives["step"].isin(steps)]
    assert traced.collectives.sort_values(cols)[cols].values.tolist() == \
        ours_c.sort_values(cols)[cols].values.tolist()
    assert (traced.collectives["wait_ns"] >= 0).all()
    assert (traced.collectives["transfer_ns"] >= 0).all()


def test_span_dataset_of_the_real_run(run: DetailRun, tmp_path: Path) -> None:
    """The trainer's own-data loader on this run's files: one tree per forward step, no bad
    rows, the merged tree under each step, and, with a meter log of constant power written
    around the run (a stand-in for the campaign's meter), each resolved window's energy is that
    power times the window."""
    from vllm_piep.datasets.spans import load_span_dataset
    from vllm_piep.meters.common import Device, MeterReading
    from vllm_piep.meters.log import LoggedMeter, MeterLogHeader, MeterLogWriter

    spans_dir = tmp_path / "spans"
    spans_dir.mkdir()
    for f in run.spans_dir.glob("*.spans.jsonl"):
        (spans_dir / f.name).write_bytes(f.read_bytes())
    unmetered = load_span_dataset(spans_dir)
    steps = forward_steps(run.spans)
    assert unmetered.issues == [] and len(unmetered.trees) == len(steps)
    assert unmetered.nodes.energy_j.isna().all()
    tree = merged_tree(run.spans)
    for _, nodes in unmetered.nodes.groupby("tree_id"):
        assert set(nodes.node_id) == set(tree.nodes) | {"model"}
    watts = 40.0
    t0 = int(min(run.spans.steps.start_ns.min(), run.spans.modules.start_ns.min())) - 10**6
    t1 = int(run.spans.steps.end_ns.max()) + 10**6
    header = MeterLogHeader("constant", "simulated", 1e-6, (Device("host", "cpu"),))
    with MeterLogWriter(spans_dir / "meter.jsonl", LoggedMeter(header)) as log:
        for t in range(t0, t1 + 1, 10**6):
            log.append(MeterReading(t, {"host": watts * (t - t0) / 1e9}))
        log.append(MeterReading(t1 + 10**6, {"host": watts * (t1 + 10**6 - t0) / 1e9}))
    metered = load_span_dataset(spans_dir)
    window = run.spans.steps.groupby("step").agg(start=("start_ns", "min"),
                                                 end=("end_ns", "max"))
    roots = metered.nodes[metered.nodes.parent_id == ""]
    step = roots.tree_id.str.rsplit("step", n=1).str[-1].astype(int).to_numpy()
    expected = watts * (window.end.loc[step] - window.start.loc[step]).to_numpy() / 1e9
    np.testing.assert_allclose(roots.energy_j.to_numpy(), expected, rtol=1e-6)
    attn = metered.nodes[metered.nodes.type == "attention"]
    assert attn.energy_j.notna().all() and (attn.energy_j > 0).all()
