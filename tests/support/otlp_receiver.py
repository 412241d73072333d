"""A real OTLP/gRPC trace receiver for tests (the collector's `TraceService`, as vLLM's own
tracing tests start one): every exported span, decoded, by name."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import (
    TraceServiceServicer,
    add_TraceServiceServicer_to_server,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def decode(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [decode(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


class OtlpReceiver(TraceServiceServicer):
    """Listens on 127.0.0.1 at a free port (`endpoint`) until `stop`."""

    def __init__(self) -> None:
        self._spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"127.0.0.1:{self.port}"
        self._server.start()

    def Export(self, request: ExportTraceServiceRequest, context: Any
               ) -> ExportTraceServiceResponse:
        with self._lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        self._spans.append({
                            "name": span.name,
                            "attributes": {kv.key: decode(kv.value) for kv in span.attributes}})
        return ExportTraceServiceResponse()

    def spans(self, name: str) -> list[dict[str, Any]]:
        with self._lock:
            return [s for s in self._spans if s["name"] == name]

    def wait_for(self, name: str, count: int, timeout_s: float = 20.0
                 ) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.spans(name)
            if len(found) >= count:
                return found
            time.sleep(0.1)
        return self.spans(name)

    def stop(self) -> None:
        self._server.stop(grace=None).wait()
