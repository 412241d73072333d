"""ModelTree: built from module structure. Small torch stand-ins shaped like vLLM's layers check
the parallel cases one process cannot load (TP ranks, PP stages); the real vLLM models of each
supported family are loaded in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import SUPPORT
from support.toy_models import CausalLM
from torch import nn

from vllm_piep.model.tree import ModelTree, ParallelLayout, TreeError


def ids(tree: ModelTree, node_type: str) -> list[str]:
    return [n.id for n in tree if n.type == node_type]


def test_single_device_tree_has_every_module_and_no_communication() -> None:
    tree = ModelTree.from_module(CausalLM(layers=3))
    assert tree["model"].children == ["embedding", "layers.0", "layers.1", "layers.2",
                                      "final_norm", "logits"]
    assert ids(tree, "attention") == [f"layers.{i}.self_attn" for i in range(3)]
    assert ids(tree, "mlp") == [f"layers.{i}.mlp" for i in range(3)]
    assert len(ids(tree, "norm")) == 6
    assert tree.comm_nodes() == []
    assert tree["embedding"].modules == ("model.embed_tokens", "model.embed_tokens")
    assert tree["logits"].modules == ("logits_processor", "logits_processor")


def test_tensor_parallel_adds_all_reduce_after_attention_and_mlp_with_transfer_and_wait() -> None:
    tree = ModelTree.from_module(CausalLM(tp=2), ParallelLayout(tp_size=2))
    for i in range(2):
        block = tree[f"layers.{i}"].children
        assert block.index(f"layers.{i}.self_attn@all_reduce") == \
            block.index(f"layers.{i}.self_attn") + 1
        assert block.index(f"layers.{i}.mlp@all_reduce") == block.index(f"layers.{i}.mlp") + 1
    assert "embedding@all_reduce" in tree["model"].children  # vocab-parallel embedding
    assert "logits@all_gather" in tree["model"].children
    for node in tree.comm_nodes():
        assert [tree[c].type for c in node.children] == ["transfer", "wait"]
        assert node.group == "tp"
    assert tree.comm_node_for("all_reduce", "tp:0", "layers.1.mlp", 0, None) == \
        "layers.1.mlp@all_reduce"
    assert tree.comm_node_for("all_reduce", "tp:0", "layers.1.input_layernorm", 0, None) is None


def test_pipeline_stages_hold_their_layers_and_merge_around_one_boundary_node() -> None:
    stage0 = ModelTree.from_module(CausalLM(layers=4, held=range(0, 2), last=False),
                                   ParallelLayout(pp_size=2, pp_rank=0))
    stage1 = ModelTree.from_module(CausalLM(layers=4, held=range(2, 4), first=False),
                                   ParallelLayout(pp_size=2, pp_rank=1))
    assert "embedding" in stage0.nodes and "embedding" not in stage1.nodes
    assert "logits" in stage1.nodes and "logits" not in stage0.nodes
    assert "layers.3" in stage1.nodes and "layers.1" not in stage1.nodes
    merged = ModelTree.merge([stage1, stage0])
    assert merged["model"].children == ["embedding", "layers.0", "layers.1",
                                        "pp@send_recv[0-1]", "layers.2", "layers.3",
                                        "final_norm", "logits"]
    assert merged.comm_node_for("send", "pp:0", None, 0, 1) == "pp@send_recv[0-1]"
    assert merged.comm_node_for("recv", "pp:0", None, 1, 0) == "pp@send_recv[0-1]"


def test_data_parallel_tail_has_an_all_gather() -> None:
    tree = ModelTree.from_module(CausalLM(), ParallelLayout(dp_size=2))
    assert tree["model"].children[-1] == "dp@all_gather"
    assert tree.comm_node_for("all_reduce", "dp:0", None, 0, None) == "dp@all_gather"


def test_opt_style_mlp_spans_from_first_to_last_linear() -> None:
    tree = ModelTree.from_module(CausalLM(tp=2, opt_style=True), ParallelLayout(tp_size=2))
    assert tree["layers.0"].children == [
        "layers.0.self_attn", "layers.0.self_attn@all_reduce", "layers.0.self_attn_layer_norm",
        "layers.0.mlp", "layers.0.mlp@all_reduce", "layers.0.final_layer_norm"]
    assert tree["layers.0.mlp"].modules == ("model.layers.0.fc1", "model.layers.0.fc2")


def test_round_trip_through_dict_keeps_every_node() -> None:
    tree = ModelTree.from_module(CausalLM(tp=2), ParallelLayout(tp_size=2))
    again = ModelTree.from_dict(json.loads(json.dumps(tree.to_dict())))
    assert [vars(n) for n in again] == [vars(n) for n in tree]
    assert again.layout == tree.layout


def test_unrecognised_structures_are_refused_with_the_reason() -> None:
    with pytest.raises(TreeError, match="no decoder-layer list"):
        ModelTree.from_module(nn.Sequential(nn.Linear(2, 2)))
    model = CausalLM()
    del model.model.layers[0].mlp
    with pytest.raises(TreeError, match="has no MLP"):
        ModelTree.from_module(model)


@pytest.fixture(scope="module")
def family_trees(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    sys.path.insert(0, str(SUPPORT))
    from families import FAMILIES, family_model

    root = tmp_path_factory.mktemp("families")
    dirs = [family_model(tiny_model, f, root / f) for f in FAMILIES]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(SUPPORT.parents[1]), os.environ.get("PYTHONPATH", "")]))}
    proc = subprocess.run([sys.executable, str(SUPPORT / "build_tree.py"), *map(str, dirs)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    trees = [json.loads(line[5:]) for line in proc.stdout.splitlines()
             if line.startswith("TREE ")]
    return dict(zip(FAMILIES, trees))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "opt"])
def test_real_vllm_models_of_each_family_give_the_full_tree(family: str,
                                                            family_trees: dict) -> None:
    tree = ModelTree.from_dict(family_trees[family])
    assert [tree[c].type for c in tree["model"].children] == \
        ["embedding", "layer", "layer", "final_norm", "logits"]
    for i in range(2):
        kinds = sorted(tree[c].type for c in tree[f"layers.{i}"].children)
        assert kinds == ["attention", "mlp", "norm", "norm"], (family, kinds)
    if family == "opt":  # learned positions are part of the embedding; fc1..fc2 the MLP
        assert tree["embedding"].modules == ("model.decoder.embed_tokens",
                                             "model.decoder.embed_positions")
        assert tree["layers.1.mlp"].modules == ("model.decoder.layers.1.fc1",
                                                "model.decoder.layers.1.fc2")
    else:
        assert tree["layers.0.mlp"].modules == ("model.layers.0.mlp", "model.layers.0.mlp")


@pytest.mark.parametrize("inside", [True, False])
def test_moe_block_has_experts_router_and_shared_expert_nested_as_vllm_calls_them(
        inside: bool) -> None:
    tree = ModelTree.from_module(CausalLM(moe={"inside": inside, "ep": False, "shared": True}))
    mlp = tree["layers.0.mlp"]
    assert tree["layers.0.mlp.experts"].type == "experts"
    assert tree["layers.0.mlp.gate"].type == "router"
    assert tree["layers.0.mlp.shared_expert"].type == "shared_expert"
    assert "layers.0.mlp.shared_expert_gate" not in tree.nodes  # a one-row gate, not a router
    holder = tree["layers.0.mlp.experts"] if inside else mlp
    assert {"layers.0.mlp.gate", "layers.0.mlp.shared_expert"} <= set(holder.children)
    assert "layers.0.mlp.experts" in mlp.children


def test_expert_parallel_moe_has_an_all_to_all_after_the_experts() -> None:
    tree = ModelTree.from_module(CausalLM(moe={"inside": True, "ep": True, "shared": False}))
    for op in ("dispatch", "combine"):
        comm = tree[f"layers.1.mlp.experts@{op}"]
        assert comm.type == "all_to_all" and comm.group == "ep"
        assert [tree[c].type for c in comm.children] == ["transfer", "wait"]
        assert tree.comm_node_for(op, "ep", "layers.1.mlp.experts", 0, None) == comm.id
    dense = ModelTree.from_module(CausalLM())
    assert not any(n.type in ("experts", "router", "all_to_all") for n in dense)
