"""Energy where operators look, on one real `vllm serve --plugins piep` with tracing to a real
OTLP/gRPC receiver (`support/otlp_receiver.py`) and a LoRA adapter made here
(`support/tiny_lora.py`):

- vLLM's `llm_request` trace span carries the request's energy (`runtime/api_server/tracing.py`):
  each finished request's span has the joules its response reports (a completion, a stream's
  usage chunk, each sample of an n = 2 chat); with the receiver gone, responses still carry it.
- /metrics has the energy per served model and LoRA adapter (`piep_model_energy_joules_total`):
  the base model's and the adapter's requests in their own series, an adapter loaded at run
  time in its own, kept after it is unloaded; the series sum to the outcome's total; a name
  the engine does not serve makes none."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.metrics_text import by_label, value
from support.otlp_receiver import OtlpReceiver
from support.quiet import poll, quiet_metrics
from support.servers import serve
from support.tiny_lora import build_lora

from vllm_piep.model.components import COMPONENTS
from vllm_piep.tools.server import ServerError, ServerOptions, VllmServer

pytestmark = pytest.mark.server
P = "piep.energy."


def spans_of(receiver: OtlpReceiver, response_id: str, count: int) -> list[dict]:
    """The `llm_request` spans of a response's engine requests (vLLM's external ids start
    with the response's id: `cmpl-...-0` for a completion's first prompt)."""
    def mine() -> list[dict]:
        return [s["attributes"] for s in receiver.spans("llm_request")
                if str(s["attributes"].get("gen_ai.request.id", "")).startswith(response_id)]

    spans = poll(mine, lambda found: len(found) >= count,
                 f"{count} llm_request spans of {response_id}", every_s=0.1, show=len)
    assert len(spans) == count, f"{len(spans)} llm_request spans of {response_id}, not {count}"
    return spans


@pytest.fixture(scope="module")
def observed(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[VllmServer, OtlpReceiver, Path]]:
    """The server (tracing on, LoRA adapter `adapter`, adapters loadable at run time), its
    trace receiver, and a second adapter to load."""
    tmp = tmp_path_factory.mktemp("observability")
    adapter = build_lora(tiny_model, tmp / "adapter", seed=0)
    runtime = build_lora(tiny_model, tmp / "runtime", seed=1)
    receiver = OtlpReceiver()
    options = ServerOptions(
        model=str(tiny_model), plugin="flag",
        extra_args=("--otlp-traces-endpoint", receiver.endpoint, "--enable-lora",
                    "--lora-modules", f"adapter={adapter}", "--max-lora-rank", "8"),
        extra_env={"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true",
                   "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    try:
        for server in serve(options, tmp):
            yield server, receiver, runtime
    finally:
        receiver.stop()


def test_each_model_and_adapter_has_its_own_energy_series(observed: tuple) -> None:
    server, _, runtime = observed
    name = "piep_model_energy_joules_total"

    def finished() -> dict[str, float]:
        return {model: v for model, v in by_label(
            "\n".join(line for line in server.get_text("/metrics").splitlines()
                      if 'outcome="finished"' in line or line.startswith("#")),
            name, "model").items()}

    def outcome_total() -> float:
        return value(server.get_text("/metrics"), "piep_request_outcome_joules_total",
                     outcome="finished")

    before, total_before = finished(), outcome_total()
    sent: dict[str, float] = {}

    def ask(model: str, **extra: object) -> None:
        body = {"model": model, "prompt": "a = ", "max_tokens": 4, "ignore_eos": True, **extra}
        energy = server.post("/v1/completions", body)["usage"]["energy"]
        sent[model] = sent.get(model, 0.0) + energy["joules"]

    ask("model")
    ask("adapter")
    ask("adapter", n=2, temperature=1.0)
    server.post_text("/v1/load_lora_adapter", {"lora_name": "runtime",
                                               "lora_path": str(runtime)})
    ask("runtime")
    server.post_text("/v1/unload_lora_adapter", {"lora_name": "runtime"})
    with pytest.raises(ServerError, match="404"):  # a name the engine does not serve
        server.post("/v1/completions", {"model": "client-string", "prompt": "x",
                                        "max_tokens": 2})
    quiet_metrics(server)  # the API server's housekeeping, the engine's idle flush
    after, total_after = finished(), outcome_total()
    assert set(after) == {"model", "adapter", "runtime"}  # the unloaded one keeps its series
    for model, joules in sent.items():
        assert after[model] - before.get(model, 0.0) == pytest.approx(joules, rel=1e-6)
    assert math.fsum(after.values()) - math.fsum(before.values()) == pytest.approx(
        total_after - total_before, rel=1e-6)


def test_request_spans_carry_the_energy_their_responses_report(observed: tuple) -> None:
    server, receiver, _ = observed  # it stops the receiver: the module's last test
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
