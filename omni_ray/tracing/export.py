"""Where spans go: the exporters Ray Serve's tracing hook names (``exporter_import_path``, a function of no arguments
returning span processors, which every Serve process calls once at start).

- ``omni_ray.tracing.export:otlp``: OTLP over HTTP, batched, to the collector the standard OpenTelemetry variables
  name (``OTEL_EXPORTER_OTLP_ENDPOINT``, default ``http://localhost:4318``; ``OTEL_EXPORTER_OTLP_HEADERS``, ...).
- ``omni_ray.tracing.export:jsonl``: one JSON line per finished span, written at once to a file per process under
  ``OMNI_RAY_TRACE_DIR``, for tests and benchmarks to read across the cluster's processes
  (``testing.traces.read_spans``).
"""

from __future__ import annotations

import json
import os
import pathlib
import threading
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult

from omni_ray.env import trace_dir


def otlp() -> list[SpanProcessor]:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return [BatchSpanProcessor(OTLPSpanExporter())]


def jsonl() -> list[SpanProcessor]:
    return [SimpleSpanProcessor(JsonLinesExporter(trace_dir()))]


class JsonLinesExporter(SpanExporter):
    """Appends each span as one JSON line to ``<directory>/spans-<pid>.jsonl``: names, ids in hex, times in ns,
    attributes, events, status, and the process."""

    def __init__(self, directory: str | os.PathLike):
        self.path = pathlib.Path(directory) / f"spans-{os.getpid()}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_record(span)) + "\n" for span in spans)
        with self.lock, self.path.open("a") as file:
            file.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def span_record(span: ReadableSpan) -> dict:
    context, parent = span.get_span_context(), span.parent
    return {
        "name": span.name, "trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None, "kind": span.kind.name,
        "start_ns": span.start_time, "end_ns": span.end_time, "attributes": dict(span.attributes or {}),
        "events": [{"name": event.name, "at_ns": event.timestamp, "attributes": dict(event.attributes or {})}
                   for event in span.events],
        "status": span.status.status_code.name, "status_description": span.status.description, "pid": os.getpid(),
    }
