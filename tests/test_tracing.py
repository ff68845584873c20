"""One trace per request without a Ray cluster: the coordinator over fake stages, its spans in an in-memory exporter
(``omni_ray.tracing``). test_serve.py follows the same spans across the replicas of a served app."""

import asyncio
import types

import numpy as np
import pytest
from conftest import REPO

from deployments.http.api_keys import ApiKeys
from omni_ray import tracing
from omni_ray.config import load_config
from omni_ray.errors import EngineError
from omni_ray.records import Finished, StepDone
from testing import coordinator
from testing.fake_stages import FakeStages
from testing.traces import MemorySpans, by_trace, format_tree, request_traces


@pytest.fixture(scope="module")
def config(tiny_dir):
    return load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir))


@pytest.fixture
def spans():
    memory = MemorySpans()
    tracing.enable(memory.provider)
    yield memory
    tracing.disable()


def names(trace: list[dict]) -> list[str]:
    return sorted(span["name"] for span in trace)


def test_each_request_is_one_trace_over_the_coordinator_and_the_three_stages(config, spans):
    client = coordinator.client(config, api_keys=ApiKeys(["k0", "k1"]))
    for request_id, n in (("first", 2), ("second", 1)):
        response = client.post("/v1/images/generations", headers={"x-request-id": request_id,
                                                                   "authorization": "Bearer k1"},
                               json={"prompt": "a cat", "size": "64x64", "n": n, "num_inference_steps": 3,
                                     "model": "qwen-image-tiny"})
        assert response.status_code == 200, response.text
    records = spans.records()
    traces = request_traces(records)
    assert set(traces) == {"first", "second"} and len(by_trace(records)) == 2  # nothing outside the two traces
    first = traces["first"]
    assert names(first) == ["decode", "decode", "denoise", "denoise", "encode_prompt", "request"]
    assert names(traces["second"]) == ["decode", "denoise", "encode_prompt", "request"]
    (root,) = [span for span in first if span["name"] == "request"]
    assert root["parent_id"] is None and root["status"] != "ERROR"
    assert {key: root["attributes"][key] for key in ("omni_ray.route", "omni_ray.tenant", "omni_ray.model",
                                                      "omni_ray.n", "omni_ray.layers", "omni_ray.status")} == {
        "omni_ray.route": "/v1/images/generations", "omni_ray.tenant": "key1", "omni_ray.model": "qwen-image-tiny",
        "omni_ray.n": 2, "omni_ray.layers": 0, "omni_ray.status": "ok"}
    for span in first:
        assert span["attributes"]["omni_ray.request_id"] == "first" and span["attributes"]["omni_ray.tenant"] == "key1"
        if span is not root:
            assert span["parent_id"] == root["span_id"] and span["kind"] == "CLIENT"
    denoises = sorted((span for span in first if span["name"] == "denoise"), key=lambda s: s["attributes"][
        "omni_ray.call_id"])
    assert [span["attributes"]["omni_ray.call_id"] for span in denoises] == ["first-0", "first-1"]
    for span in denoises:
        assert [(event["attributes"]["step"], event["attributes"]["total"]) for event in span["events"]] == [
            (1, 3), (2, 3), (3, 3)]
    assert "denoise" in format_tree(first) and "[3 step events]" in format_tree(first)


def test_an_edit_traces_its_image_encode_and_a_stream_its_previews(edit_dir, spans):
    import io

    from PIL import Image

    config = load_config(REPO / "stage_configs/qwen_image_edit_tiny.yaml", model=str(edit_dir))
    client = coordinator.client(config)
    buffer = io.BytesIO()
    Image.fromarray(np.full((64, 64, 3), 200, np.uint8)).save(buffer, format="PNG")
    response = client.post("/v1/images/edits", headers={"x-request-id": "edit"}, files={
        "image": ("a.png", buffer.getvalue(), "image/png")}, data={
        "prompt": "make it blue", "stream": "true", "partial_images": "1", "num_inference_steps": "4"})
    assert response.status_code == 200, response.text
    trace = request_traces(spans.records())["edit"]
    assert names(trace) == ["decode", "decode", "denoise", "encode_image", "encode_prompt", "request"]
    (root,) = [span for span in trace if span["name"] == "request"]
    assert root["attributes"]["omni_ray.route"] == "/v1/images/edits" and root["attributes"]["omni_ray.stream"]
    assert sorted(span["attributes"]["omni_ray.preview"] for span in trace if span["name"] == "decode") == [
        False, True]


def test_a_failed_stage_call_is_an_error_on_its_span_and_the_request(config, spans):
    client = coordinator.client(config, FakeStages(fail={"decode": EngineError("the VAE broke", "vae")}))
    response = client.post("/v1/images/generations", headers={"x-request-id": "broken"},
                           json={"prompt": "a cat", "size": "64x64"})
    assert response.status_code == 500
    trace = request_traces(spans.records())["broken"]
    (root,) = [span for span in trace if span["name"] == "request"]
    (decode,) = [span for span in trace if span["name"] == "decode"]
    assert root["status"] == "ERROR" and root["attributes"]["omni_ray.status"] == "EngineError"
    assert decode["status"] == "ERROR" and [event["name"] for event in decode["events"]] == ["exception"]
    assert "the VAE broke" in decode["events"][0]["attributes"]["exception.message"]


def test_a_stage_replicas_engine_request_is_a_span_with_its_steps(spans):
    """The replica side (``StageDeployment._stream``): a span per engine request, a child of whatever is current."""
    request = types.SimpleNamespace(request_id="r-0", timing="dit", params=types.SimpleNamespace(tenant="key0"))
    result = types.SimpleNamespace(timings={"dit": 0.25})

    async def engine():
        yield StepDone(1, 2)
        yield StepDone(2, 2)
        yield Finished(result)

    async def run():
        return [item async for item in tracing.traced_stream("dit", request, engine())]

    assert len(asyncio.run(run())) == 3
    (span,) = spans.records()
    assert span["name"] == "dit.denoise" and span["attributes"] == {
        "omni_ray.stage": "dit", "omni_ray.call_id": "r-0", "omni_ray.tenant": "key0", "omni_ray.engine_s": 0.25}
    assert [event["attributes"]["step"] for event in span["events"]] == [1, 2]


def test_off_there_are_no_spans_and_the_hooks_hand_back_what_they_were_given(config):
    memory = MemorySpans()
    assert not tracing.enabled()
    stages = FakeStages()
    served = coordinator.coordinator(config, stages)
    assert served.stages is stages
    client = coordinator.client(config, stages)
    response = client.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64", "n": 2})
    assert response.status_code == 200 and memory.records() == []

    async def items():
        yield 1

    stream = items()
    assert tracing.traced_stream("dit", None, stream) is stream
    assert tracing.traced_request(stream, None, "id") is stream
