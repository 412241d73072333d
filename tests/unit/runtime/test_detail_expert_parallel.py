"""Detail mode's expert-parallel wrappers: vLLM's `GroupCoordinator.dispatch` and `combine`
record one collective span each, with the hidden states' bytes, that the model tree maps to the
experts node's `@dispatch` and `@combine` communication nodes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from support.toy_models import CausalLM  # noqa: E402

from vllm_piep.model.tree import ModelTree  # noqa: E402
from vllm_piep.runtime.worker import detail  # noqa: E402


class Recorder:
    """The StepRecorder calls the wrappers make, inside the experts node's span."""

    def __init__(self, inside: int) -> None:
        self.spans: list[dict[str, Any]] = []
        self.inside = inside

    def collective_begin(self) -> int:
        return 1

    def collective_end(self, arrival: int, op: str, group: str, world: int, rank: int,
                       peer: int | None, nbytes: int, dtype: str, is_async: bool) -> int:
        self.spans.append({"op": op, "group": group, "bytes": nbytes, "peer": peer})
        return len(self.spans)

    def collective_abort(self) -> None:
        raise AssertionError("no abort expected")

    def enclosing(self) -> int:
        return self.inside

    def sampling(self, _node: int) -> None:
        return None


def test_dispatch_and_combine_are_recorded_and_map_onto_the_tree(monkeypatch) -> None:
    wrappers = {name: detail._collective(op, payload, posts)
                for name, op, payload, posts in detail._COLLECTIVES
                if name in ("dispatch", "combine")}
    assert set(wrappers) == {"dispatch", "combine"}
    recorder = Recorder(inside=7)
    monkeypatch.setattr(detail, "active", recorder)
    group = SimpleNamespace(world_size=4, rank_in_group=1, unique_name="ep:0")
    hidden = torch.zeros(5, 8, dtype=torch.bfloat16)
    dispatch = wrappers["dispatch"](lambda self, hidden_states, *a, **k: (hidden_states, *a))
    combine = wrappers["combine"](lambda self, hidden_states, *a, **k: hidden_states)
    dispatch(group, hidden, torch.zeros(5, 2), torch.zeros(5, 2, dtype=torch.int64))
    combine(group, hidden_states=hidden)
    assert [(s["op"], s["group"], s["bytes"], s["peer"]) for s in recorder.spans] == [
        ("dispatch", "ep:0", 5 * 8 * 2, None), ("combine", "ep:0", 5 * 8 * 2, None)]
    tree = ModelTree.from_module(CausalLM(moe={"inside": True, "ep": True, "shared": False}))
    for span in recorder.spans:
        node = tree.comm_node_for(span["op"], span["group"], "layers.0.mlp.experts", 1, None)
        assert node == f"layers.0.mlp.experts@{span['op']}"
    # A single-rank group is not a collective: nothing is recorded.
    solo = SimpleNamespace(world_size=1, rank_in_group=0, unique_name="ep:0")
    combine(solo, hidden)
    assert len(recorder.spans) == 2
