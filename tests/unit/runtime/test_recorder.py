"""StepRecorder: module spans from enter/exit pairs, collective spans with their sequence
numbers, nothing recorded outside a step, and GPU events resolved on the writer's side."""

from __future__ import annotations

from pathlib import Path

import torch
from support.toy_models import CausalLM

from vllm_piep.model.tree import ModelTree, ParallelLayout
from vllm_piep.runtime.worker.recorder import CudaEventTimer, StepRecorder
from vllm_piep.spans.reader import read_span_file
from vllm_piep.spans.records import SpanHeader
from vllm_piep.spans.writer import SpanWriter


def recorder(tmp_path: Path, timer: object | None = None) -> tuple[StepRecorder, Path]:
    tree = ModelTree.from_module(CausalLM(tp=2), ParallelLayout(tp_size=2))
    path = tmp_path / "r.spans.jsonl"
    writer = SpanWriter(path, SpanHeader(rank=0, world_size=2, host="h", pid=1,
                                         tree=tree.to_dict()))
    return StepRecorder(writer, tree, timer), path  # type: ignore[arg-type]


def test_nested_modules_and_collectives_become_records(tmp_path: Path) -> None:
    rec, path = recorder(tmp_path)
    attn, mlp = rec.node_index["layers.0.self_attn"], rec.node_index["layers.0.mlp"]
    rec.enter(attn)  # before any step: warm-up runs are not steps
    rec.exit(attn)
    rec.begin_step()
    rec.enter(attn)
    arrival = rec.collective_begin()
    assert rec.collective_begin() is None  # nested inside a recorded collective
    rec.collective_end(arrival, "all_reduce", "tp:0", 2, 0, None, 1024, "float32", False)
    rec.exit(attn)
    rec.enter(mlp)
    rec.collective_end(rec.collective_begin(), "all_reduce", "tp:0", 2, 0, None, 1024,
                       "float32", False)
    rec.exit(mlp)
    rec.collective_end(rec.collective_begin(), "send", "pp:0", 2, 0, 1, 64, "float32", True)
    rec.set_counts(5, 2, 3, context=40, pairs=97, sampled=2)
    rec.end_step()
    rec.writer.close()
    span = read_span_file(path)
    assert list(span.modules["node"]) == ["layers.0.self_attn", "layers.0.mlp"]
    assert list(span.modules["prefill_tokens"]) == [5, 5]
    c = span.collectives
    assert list(c["node"][:2]) == ["layers.0.self_attn", "layers.0.mlp"]
    assert c["node"].isna()[2]  # the send ran outside any module
    assert list(c["seq"]) == [0, 1, 0]  # per group; the send counts per (group, pair)
    step = span.steps.iloc[0]
    assert (step.prefill_tokens, step.decode_tokens, step.num_reqs) == (5, 2, 3)
    assert (step.context_tokens, step.attended_pairs, step.sampled_rows) == (40, 97, 2)
    for _, m in span.modules.iterrows():
        assert step.start_ns <= m.start_ns <= m.end_ns <= step.end_ns
    for _, row in c.iterrows():
        assert step.start_ns <= row.arrival_ns <= row.completion_ns <= step.end_ns


def test_exits_out_of_order_are_counted_not_raised(tmp_path: Path) -> None:
    rec, path = recorder(tmp_path)
    a, b = rec.node_index["layers.0.self_attn"], rec.node_index["layers.0.mlp"]
    rec.begin_step()
    rec.exit(b)  # never entered
    rec.enter(a)
    rec.enter(b)
    rec.exit(a)  # b was left open (an exception unwound past its hook): a still closes
    rec.end_step()
    rec.writer.close()
    assert rec.anomalies == 2
    assert list(read_span_file(path).modules["node"]) == ["layers.0.self_attn"]


def test_an_open_step_is_closed_by_the_next_one_at_its_last_mark(tmp_path: Path) -> None:
    rec, path = recorder(tmp_path)
    rec.begin_step()
    rec.mark_end()
    rec.begin_step()
    rec.end_step()
    rec.writer.close()
    steps = read_span_file(path).steps
    assert list(steps["step"]) == [0, 1]
    assert steps["end_ns"][0] <= steps["start_ns"][1]


class FakeEvent:
    """Stand-in for torch.cuda.Event: a device clock in ms that the test advances."""

    clock_ms = 0.0
    synchronized = 0

    def record(self) -> None:
        self.at = FakeEvent.clock_ms

    def synchronize(self) -> None:
        FakeEvent.synchronized += 1

    def elapsed_time(self, other: FakeEvent) -> float:
        return other.at - self.at


def test_gpu_marks_are_events_resolved_against_the_step_anchor(tmp_path: Path) -> None:
    rec, path = recorder(tmp_path, CudaEventTimer(FakeEvent))
    node = rec.node_index["layers.1.mlp"]
    rec.begin_step()
    anchor_ns = rec._step.start_ns  # host time taken with the anchor event
    FakeEvent.clock_ms = 2.0
    rec.enter(node)
    FakeEvent.clock_ms = 2.5
    rec.exit(node)
    FakeEvent.clock_ms = 3.0
    assert FakeEvent.synchronized == 0  # nothing waits for the device on the step loop
    rec.end_step()
    rec.writer.close()
    span = read_span_file(path)
    module = span.modules.iloc[0]
    assert module.start_ns - anchor_ns == 2_000_000 and module.end_ns - anchor_ns == 2_500_000
    assert span.steps.iloc[0].end_ns - anchor_ns == 3_000_000
    assert FakeEvent.synchronized > 0


def test_profiler_ranges_are_opened_only_while_a_profiler_runs(tmp_path: Path) -> None:
    rec, _ = recorder(tmp_path)
    node = rec.node_index["layers.0.mlp"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        rec.begin_step()
        rec.enter(node)
        torch.ones(4).sum()
        rec.exit(node)
        rec.end_step()
    names = {e.name for e in prof.events()}
    assert "piep.step/0" in names and "piep.module/mlp/layers.0.mlp" in names
    rec.begin_step()
    assert rec._step_range is None
    rec.end_step()
    rec.writer.close()


def test_step_counts_split_prefill_decode_context_pairs_and_sampled_rows() -> None:
    from types import SimpleNamespace as NS

    from vllm_piep.runtime.worker.batch import StepCounter

    def new(req_id: str, prompt: int, computed: int) -> NS:
        return NS(req_id=req_id, prompt_token_ids=list(range(prompt)), prompt_embeds=None,
                  num_computed_tokens=computed)

    count = StepCounter()
    # An earlier step saw "b" (50-token prompt) and "c" (5-token prompt) first scheduled.
    count(NS(num_scheduled_tokens={"b": 16, "c": 5},
             scheduled_new_reqs=[new("b", 50, 0), new("c", 5, 0)],
             scheduled_cached_reqs=NS(req_ids=[], num_computed_tokens=[]),
             finished_req_ids=set()))
    # new request: 10-token prompt, 6 cached, 4 scheduled (completes its prompt: sampled);
    # "b" in chunked prefill: 16 computed, 16 scheduled (not sampled);
    # "c" decoding: 9 computed, 1 scheduled. "x" finished.
    out = NS(num_scheduled_tokens={"a": 4, "b": 16, "c": 1},
             scheduled_new_reqs=[new("a", 10, 6)],
             scheduled_cached_reqs=NS(req_ids=["b", "c"], num_computed_tokens=[16, 9]),
             finished_req_ids={"x"})
    prefill, decode, reqs, context, pairs, sampled = count(out)
    assert (prefill, decode, reqs) == (4 + 16, 1, 3)
    assert context == 6 + 16 + 9
    assert pairs == (4 * 6 + 4 * 5 // 2) + (16 * 16 + 16 * 17 // 2) + (9 + 1)
    assert sampled == 2
    finished = NS(num_scheduled_tokens={}, scheduled_new_reqs=[],
                  scheduled_cached_reqs=NS(req_ids=[], num_computed_tokens=[]),
                  finished_req_ids={"a", "b", "c"})
    assert count(finished) == (0, 0, 0, 0, 0, 0)
    assert count.prompts == {}  # nothing kept for finished requests


def test_counts_are_taken_from_the_batch_on_the_writer_side(tmp_path: Path) -> None:
    rec, path = recorder(tmp_path)
    rec.counter = lambda batch: (batch, 1, 2, 3, 4, 5)
    rec.begin_step()
    rec.set_batch(7)
    rec.end_step()
    rec.writer.close()
    step = read_span_file(path).steps.iloc[0]
    assert (step.prefill_tokens, step.decode_tokens, step.num_reqs, step.context_tokens,
            step.attended_pairs, step.sampled_rows) == (7, 1, 2, 3, 4, 5)
