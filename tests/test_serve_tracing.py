"""One trace per request across the replicas of the served tiny preset: Ray Serve's tracing on (``tracing_config`` in
the Serve config) with omni-ray's JSON-lines exporter, every process writing its spans under one directory."""

import json
import time
import urllib.request

import pytest
import yaml
from conftest import REPO

from testing.local_serve import LocalServe
from testing.traces import format_tree, ours, read_spans, request_traces

pytestmark = pytest.mark.serve

TRACING = {"enabled": True, "exporter_import_path": "omni_ray.tracing.export:jsonl", "sampling_ratio": 1.0}
CLIENT_SPANS = ["decode", "decode", "denoise", "denoise", "encode_prompt", "request"]
ENGINE_SPANS = ["dit.denoise", "dit.denoise", "encoder.encode", "vae.decode", "vae.decode"]


@pytest.fixture(scope="module")
def traced(tiny_dir, tmp_path_factory):
    spans = tmp_path_factory.mktemp("spans")
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["tracing_config"] = TRACING
    path = tmp_path_factory.mktemp("config") / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with LocalServe(path, model=str(tiny_dir), env={"OMNI_RAY_TRACE_DIR": str(spans)}) as local:
        yield local, spans


def post(url: str, body: dict, request_id: str) -> int:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                      "x-request-id": request_id})
    with urllib.request.urlopen(request, timeout=300) as response:
        assert len(json.loads(response.read())["data"]) == body["n"]
        return response.status


def trace_of(spans_dir, request_id: str, expected: int, timeout_s: float = 20.0) -> list[dict]:
    """The request's trace once ``expected`` of omni-ray's spans are written (Ray's own end a little later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        trace = request_traces(read_spans(spans_dir)).get(request_id, [])
        if len(ours(trace)) >= expected or time.monotonic() > deadline:
            return trace
        time.sleep(0.2)


def test_each_request_is_one_trace_across_the_coordinator_and_the_stage_replicas(traced):
    local, spans_dir = traced
    for request_id in ("traced-1", "traced-2"):
        body = {"prompt": "a lighthouse", "size": "64x64", "n": 2, "num_inference_steps": 3, "user": "team-a"}
        assert post(local.base_url + "/v1/images/generations", body, request_id) == 200
    first = trace_of(spans_dir, "traced-1", len(CLIENT_SPANS) + len(ENGINE_SPANS))
    second = trace_of(spans_dir, "traced-2", len(CLIENT_SPANS) + len(ENGINE_SPANS))
    print("\n" + format_tree(first))
    assert first[0]["trace_id"] != second[0]["trace_id"]
    for trace in (first, second):
        names = sorted(span["name"] for span in ours(trace))
        assert names == sorted(CLIENT_SPANS + ENGINE_SPANS), names
        assert any(span["name"].startswith("replica_handle_request") for span in trace)  # Ray's, between ours
    # Every span of the request, wherever it ran, is in the one trace: none of its calls started another.
    calls = [span for span in read_spans(spans_dir) if span["attributes"].get("omni_ray.request_id") == "traced-1"
             or span["attributes"].get("omni_ray.call_id") in ("traced-1", "traced-1-0", "traced-1-1")]
    assert {span["trace_id"] for span in calls} == {first[0]["trace_id"]} and len(calls) == len(ours(first))
    # Four processes: the coordinator's and each stage replica's.
    pids = {span["name"]: span["pid"] for span in ours(first)}
    assert len({pids["request"], pids["encoder.encode"], pids["dit.denoise"], pids["vae.decode"]}) == 4
    assert pids["request"] == pids["denoise"] == pids["decode"] == pids["encode_prompt"]
    # Each replica span descends from the coordinator's span of its call (through Ray Serve's own spans).
    by_id = {span["span_id"]: span for span in first}
    for span in ours(first):
        if span["name"] not in ENGINE_SPANS:
            continue
        parent = by_id.get(span["parent_id"])
        while parent is not None and "omni_ray.stage" not in parent["attributes"]:
            parent = by_id.get(parent["parent_id"])
        assert parent is not None and parent["attributes"]["omni_ray.call_id"] == span["attributes"][
            "omni_ray.call_id"] and parent["kind"] == "CLIENT", span
        if span["name"] == "dit.denoise":
            assert span["attributes"]["omni_ray.tenant"] == "team-a"
            assert [event["attributes"]["step"] for event in span["events"]] == [1, 2, 3]
            assert [event["attributes"]["step"] for event in parent["events"]] == [1, 2, 3]
