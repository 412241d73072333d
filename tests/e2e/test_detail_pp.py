"""Detail mode on a real pipeline-parallel (PP=2) vLLM on CPU, eager (the plugin supplies the
receive buffer vLLM 0.32's CPU runner skips in eager mode): send/recv spans at the stage
boundary, each stage's module spans, and the merged tree."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.detail_runs import DetailRun, detail_run

from vllm_piep.spans.treemap import coverage, forward_steps, merged_tree

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> DetailRun:
    return detail_run(tiny_model, tmp_path_factory.mktemp("detail_pp"),
                      ["--pipeline-parallel-size", "2"], {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})


def test_each_stage_records_only_its_own_modules(run: DetailRun) -> None:
    mods = run.spans.modules
    rank_of = {f.header.pp_rank: f.header.rank for f in run.spans.files}
    first, last = set(mods[mods["rank"] == rank_of[0]]["node"]), \
        set(mods[mods["rank"] == rank_of[1]]["node"])
    assert "embedding" in first and "logits" not in first and "layers.1.mlp" not in first
    assert {"layers.1.mlp", "final_norm", "logits"} <= last and "embedding" not in last
    assert all(r["usage"]["completion_tokens"] == 6 for r in run.responses)


def test_stage_boundary_sends_and_receives_hidden_states_and_residual(run: DetailRun) -> None:
    hidden, element = run.config["hidden_size"], 4
    steps = run.spans.steps.set_index(["rank", "step"])
    c = run.spans.collectives
    assert set(c["op"]) == {"send", "recv"} and set(c["group"]) == {"pp:0"}
    for (rank, step), frame in c.groupby(["rank", "step"]):
        assert len(frame) == 1
        row = steps.loc[(rank, step)]
        tokens = int(row["prefill_tokens"] + row["decode_tokens"])
        # Llama's intermediate tensors: hidden_states and residual, tokens x hidden each
        assert int(frame["bytes"].iloc[0]) == 2 * tokens * hidden * element
    assert (c["participants"] == 2).all()
    assert (c["wait_ns"] >= 0).all() and (c["transfer_ns"] >= 0).all()
    assert (c["wait_ns"] > 0).any()  # the second stage waits for the first


def test_spans_nest_and_map_onto_the_merged_tree(run: DetailRun) -> None:
    spans = run.spans
    steps = spans.steps.set_index(["rank", "step"])
    for frame in (spans.modules.rename(columns={"start_ns": "a", "end_ns": "b"}),
                  spans.collectives.rename(columns={"arrival_ns": "a", "completion_ns": "b"})):
        for _, m in frame.iterrows():
            s = steps.loc[(m["rank"], m["step"])]
            assert s["start_ns"] <= m["a"] <= m["b"] <= s["end_ns"]
    tree = merged_tree(spans)
    assert tree["model"].children.index("pp@send_recv[0-1]") == \
        tree["model"].children.index("layers.0") + 1
    for step in forward_steps(spans):
        result = coverage(spans, step, tree)
        assert result.total, (step, result)
