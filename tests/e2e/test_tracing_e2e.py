"""vLLM's `llm_request` trace span carries the request's energy (`runtime/api_server/tracing.py`):
a real `vllm serve --plugins piep --otlp-traces-endpoint` exporting to a real OTLP/gRPC receiver
(`support/otlp_receiver.py`). Each finished request's span has the joules its response
reports (a completion, a stream's usage chunk, each sample of an n = 2 chat); with the receiver
gone, responses still carry their energy."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from support.otlp_receiver import OtlpReceiver
from support.servers import serve

from vllm_piep.model.components import COMPONENTS
from vllm_piep.tools.server import ServerOptions

pytestmark = pytest.mark.server
P = "piep.energy."


def spans_of(receiver: OtlpReceiver, response_id: str, count: int) -> list[dict]:
    """The `llm_request` spans of a response's engine requests (vLLM's external ids start
    with the response's id: `cmpl-...-0` for a completion's first prompt)."""
    def mine() -> list[dict]:
        return [s["attributes"] for s in receiver.spans("llm_request")
                if str(s["attributes"].get("gen_ai.request.id", "")).startswith(response_id)]

    deadline = time.monotonic() + 20
    while len(mine()) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    spans = mine()
    assert len(spans) == count, f"{len(spans)} llm_request spans of {response_id}, not {count}"
    return spans


def test_request_spans_carry_the_energy_their_responses_report(tiny_model: Path,
                                                               tmp_path: Path) -> None:
    receiver = OtlpReceiver()
    options = ServerOptions(
        model=str(tiny_model), plugin="flag",
        extra_args=("--otlp-traces-endpoint", receiver.endpoint),
        extra_env={"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true"})
    try:
        for server in serve(options, tmp_path):
            # A completion: its span's energy is the response's, attribute for attribute.
            response = server.post("/v1/completions", {
                "model": "model", "prompt": "def f():", "max_tokens": 6, "ignore_eos": True})
            energy = response["usage"]["energy"]
            [span] = spans_of(receiver, response["id"], 1)
            assert span[P + "complete"] is True
            assert span[P + "joules"] == pytest.approx(energy["joules"], rel=1e-9)
            assert span[P + "joules_per_output_token"] == pytest.approx(
                energy["joules_per_output_token"], rel=1e-9)
            assert span[P + "prefill_joules"] == pytest.approx(energy["prefill_joules"], rel=1e-9)
            assert span[P + "decode_joules"] == pytest.approx(energy["decode_joules"], rel=1e-9)
            for name in COMPONENTS:
                assert span[f"{P}breakdown.{name}"] == pytest.approx(energy["breakdown"][name],
                                                                      rel=1e-9, abs=1e-15)
            assert span[P + "source"] == energy["source"] == "prior"
            assert span[P + "bundle"] == energy["bundle"]
            assert span["gen_ai.usage.completion_tokens"] == 6  # vLLM's own attributes stay

            # A stream: the span's joules are those of its final usage chunk.
            text = server.post_text("/v1/completions", {
                "model": "model", "prompt": "x = ", "max_tokens": 5, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}})
            final = [json.loads(line[6:]) for line in text.splitlines()
                     if line.startswith("data: {") and '"choices":[]' in line][-1]
            [span] = spans_of(receiver, final["id"], 1)
            assert span[P + "joules"] == pytest.approx(final["usage"]["energy"]["joules"],
                                                       rel=1e-9)

            # n = 2 chat: one span per sample, their joules summing to the response's.
            response = server.post("/v1/chat/completions", {
                "model": "model", "messages": [{"role": "user", "content": "hi"}], "n": 2,
                "max_tokens": 4, "ignore_eos": True, "temperature": 1.0})
            spans = spans_of(receiver, response["id"], 2)
            assert math.fsum(s[P + "joules"] for s in spans) == pytest.approx(
                response["usage"]["energy"]["joules"], rel=1e-9)

            # The receiver gone: vLLM's export fails on its own thread, responses are as before.
            receiver.stop()
            energy = server.post("/v1/completions", {
                "model": "model", "prompt": "y = ", "max_tokens": 3,
                "ignore_eos": True})["usage"]["energy"]
            assert energy["joules"] > 0 and energy["source"] == "prior"
            log = server.log_path.read_text(errors="replace")
            assert "trace span" not in log  # the plugin's own warnings about spans: none
    finally:
        receiver.stop()
