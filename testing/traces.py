"""Spans read back for tests and benchmarks: from the files ``omni_ray.tracing.export:jsonl`` writes (one per process),
or from an in-memory exporter in this process, as the same records; and a trace printed as a tree."""

from __future__ import annotations

import json
import pathlib
from collections import defaultdict

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from omni_ray.tracing.export import span_record


def read_spans(directory: str | pathlib.Path) -> list[dict]:
    """Every span the cluster's processes wrote under ``directory`` (``span_record``'s fields)."""
    return [json.loads(line) for path in sorted(pathlib.Path(directory).glob("spans-*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]


class MemorySpans:
    """A tracer provider whose finished spans stay in this process: ``records()`` gives them as ``read_spans`` does."""

    def __init__(self):
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def records(self) -> list[dict]:
        return [span_record(span) for span in self.exporter.get_finished_spans()]


def by_trace(spans: list[dict]) -> dict[str, list[dict]]:
    traces = defaultdict(list)
    for span in spans:
        traces[span["trace_id"]].append(span)
    return dict(traces)


def request_traces(spans: list[dict]) -> dict[str, list[dict]]:
    """The spans of each request's trace, by its request id (its ``request`` span's)."""
    traces = by_trace(spans)
    return {span["attributes"]["omni_ray.request_id"]: traces[span["trace_id"]]
            for span in spans if span["name"] == "request"}


def ours(spans: list[dict]) -> list[dict]:
    """omni-ray's spans (Ray Serve's own, ``route_to_replica ...`` and ``replica_handle_request ...``, left out)."""
    return [span for span in spans if "omni_ray.stage" in span["attributes"] or span["name"] == "request"]


SHOWN = ("omni_ray.route", "omni_ray.request_id", "omni_ray.tenant", "omni_ray.n", "omni_ray.status",
         "omni_ray.call_id", "omni_ray.engine_s", "omni_ray.preview")


def format_tree(spans: list[dict], shown: tuple[str, ...] = SHOWN) -> str:
    """One trace as indented text: each span's name, its start and length in ms from the trace's start, the process,
    a few attributes, and its step events counted."""
    ids = {span["span_id"] for span in spans}
    children = defaultdict(list)
    for span in spans:
        children[span["parent_id"] if span["parent_id"] in ids else None].append(span)
    start = min(span["start_ns"] for span in spans)
    lines = []

    def show(span: dict, depth: int) -> None:
        attributes = " ".join(f"{key.removeprefix('omni_ray.')}={span['attributes'][key]:.3g}"
                              if isinstance(span["attributes"][key], float) else
                              f"{key.removeprefix('omni_ray.')}={span['attributes'][key]}"
                              for key in shown if key in span["attributes"])
        steps = [event for event in span["events"] if event["name"] == "step"]
        lines.append(f"{'  ' * depth}{span['name']}  +{(span['start_ns'] - start) / 1e6:.0f} ms "
                     f"{(span['end_ns'] - span['start_ns']) / 1e6:.0f} ms  pid {span['pid']}"
                     + (f"  {attributes}" if attributes else "") + (f"  [{len(steps)} step events]" if steps else "")
                     + ("  ERROR" if span["status"] == "ERROR" else ""))
        for child in sorted(children[span["span_id"]], key=lambda s: s["start_ns"]):
            show(child, depth + 1)

    for root in sorted(children[None], key=lambda s: s["start_ns"]):
        show(root, 0)
    return "\n".join(lines)
