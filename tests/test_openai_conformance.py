"""Every body and event the images routes send, held against OpenAI's published OpenAPI definition and parsed by the
official client (its typed models and its stream reader): generations and edits, JSON and streamed, partial images,
errors, the model list. The stages are the fake protocol: the bodies, not the engines, are the subject here;
test_serve.py and test_serve_edit.py check served bodies the same way."""

import io
import json

import numpy as np
import openai
import pytest
from conftest import REPO
from fastapi.testclient import TestClient
from PIL import Image

from omni_ray.config import load_config
from omni_ray.errors import OverloadedError
from omni_ray.tokenizer import PromptTokenizer
from testing.coordinator import client
from testing.fake_stages import FakeStages
from testing.openai_api import conforms, event_kind, schema_errors


def tiny_config(tiny_dir):
    """The tiny preset, taking OpenAI's 1024x1024 too (the fake stages draw any size at no cost)."""
    config = load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir))
    return config.model_copy(update={"requests": config.requests.model_copy(update={"max_side": 1536})})


def app_for(config, stages=None) -> TestClient:
    return client(config, stages)


@pytest.fixture(scope="module")
def generations(tiny_dir):
    return app_for(tiny_config(tiny_dir))


@pytest.fixture(scope="module")
def edits(edit_dir):
    return app_for(load_config(REPO / "stage_configs/qwen_image_edit_tiny.yaml", model=str(edit_dir)))


def events_of(response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: ")]


def png_file(height=96, width=64) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), 120, np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


BODIES = [
    {"prompt": "a cat", "size": "64x96", "n": 2, "seed": 5},
    {"prompt": "a cat", "size": "1024x1024", "quality": "low", "output_format": "webp", "timings": True},
    {"prompt": "a cat", "negative_prompt": "blurry", "num_inference_steps": 3, "output_format": "jpeg"},
]


@pytest.mark.parametrize("body", BODIES)
def test_generation_responses_and_events_are_openais(generations, body):
    response = generations.post("/v1/images/generations", json=body)
    assert response.status_code == 200
    conforms("ImagesResponse", response.json())
    streamed = events_of(generations.post("/v1/images/generations",
                                          json={**body, "stream": True, "partial_images": 2}))
    assert {event["type"] for event in streamed} == {"image_generation.partial_image", "image_generation.completed"}
    for event in streamed:
        conforms(event_kind(event, edit=False), event)


def test_sizes_qualities_and_usage_say_what_openai_can(generations, tiny_dir):
    body = generations.post("/v1/images/generations", json={"prompt": "a cat", "size": "1024x1024"}).json()
    config = tiny_config(tiny_dir)
    assert body["size"] == "1024x1024" and body["quality"] in ("low", "medium", "high")
    tokens = PromptTokenizer(config.model).num_tokens("a cat")
    assert body["usage"] == {"input_tokens": tokens.text, "input_tokens_details": {"text_tokens": tokens.text,
                                                                                  "image_tokens": 0},
                             "output_tokens": 64 * 64, "total_tokens": tokens.text + 64 * 64}
    # CFG reads the negative prompt too; n images each have their output tokens
    medium = config.requests.quality_steps.medium
    cfg = generations.post("/v1/images/generations", json={"prompt": "a cat", "negative_prompt": "dog", "n": 2,
                                                           "size": "64x64", "num_inference_steps": medium}).json()
    negative = PromptTokenizer(config.model).num_tokens("dog")
    assert cfg["usage"]["input_tokens"] == tokens.text + negative.text and cfg["usage"]["output_tokens"] == 2 * 16
    assert "size" not in cfg and cfg["quality"] == "medium"  # the steps the preset gives quality=medium


def test_edit_responses_and_events_are_openais(edits):
    files = {"image": ("cat.png", png_file(), "image/png")}
    response = edits.post("/v1/images/edits", data={"prompt": "make it blue", "n": "2"}, files=files)
    assert response.status_code == 200, response.text
    body = response.json()
    conforms("ImagesResponse", body)
    assert body["usage"]["input_tokens_details"]["image_tokens"] > 0  # the image's vision tokens
    streamed = events_of(edits.post("/v1/images/edits", files=files,
                                    data={"prompt": "make it blue", "stream": "true", "partial_images": "1"}))
    assert {event["type"] for event in streamed} == {"image_edit.partial_image", "image_edit.completed"}
    for event in streamed:
        conforms(event_kind(event, edit=True), event)


def test_errors_and_the_model_list_are_openais(generations, tiny_dir):
    for response in (generations.post("/v1/images/generations", json={"prompt": "a cat", "n": 0}),
                     generations.post("/v1/images/generations", json={"prompt": "a cat", "model": "dall-e-2"}),
                     generations.post("/v1/images/edits", json={"prompt": "a cat"})):
        assert response.status_code in (400, 404) and not schema_errors("ErrorResponse", response.json())
    failing = app_for(tiny_config(tiny_dir), FakeStages(fail={"decode": OverloadedError("queue full", 3.0, "vae")}))
    (event,) = events_of(failing.post("/v1/images/generations", json={"prompt": "a cat", "stream": True}))
    assert not schema_errors("ErrorResponse", event)
    models = generations.get("/v1/models").json()
    assert not schema_errors("ListModelsResponse", models)
    for model in models["data"]:
        conforms("Model", model)


def test_the_official_client_reads_every_event_typed(generations, edits):
    """The client's own stream reader: each event becomes its typed model with every field set; an error event
    raises; progress events are sent only to callers that ask (the client would read one as an empty preview)."""
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=generations)
    stream = client.images.generate(prompt="a cat", size="64x64", n=2, stream=True, partial_images=2,
                                    extra_body={"num_inference_steps": 4, "seed": 1})
    events = list(stream)
    assert [type(e).__name__ for e in events].count("ImageGenPartialImageEvent") == 4
    assert [type(e).__name__ for e in events].count("ImageGenCompletedEvent") == 2
    for event in events:
        assert None not in (event.b64_json, event.size, event.quality, event.background, event.output_format)
    assert all(event.usage.total_tokens > 0 for event in events if event.type == "image_generation.completed")
    result = client.images.generate(prompt="a cat", size="1024x1024", extra_body={"num_inference_steps": 1})
    assert (result.size, result.quality, result.background, result.output_format) == ("1024x1024", "low",
                                                                                      "opaque", "png")
    assert result.usage.output_tokens == 64 * 64
    edit_client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=edits)
    edited = list(edit_client.images.edit(image=("cat.png", png_file(), "image/png"), prompt="make it blue",
                                          stream=True, partial_images=1))
    assert [type(e).__name__ for e in edited] == ["ImageEditPartialImageEvent", "ImageEditCompletedEvent"]
    assert [m.id for m in client.models.list()] == ["qwen-image-tiny"]


def test_the_official_client_retrieves_a_model_and_every_unknown_route_is_an_openai_error(generations):
    """``models.retrieve`` (``GET /v1/models/{model}``), its 404 as the client raises it, and the router's own
    refusals (a path no route has, a method a path does not take) in OpenAI's error body."""
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=generations)
    model = client.models.retrieve("qwen-image-tiny")
    assert (model.id, model.object, model.owned_by) == ("qwen-image-tiny", "model", "omni-ray")
    conforms("Model", generations.get("/v1/models/qwen-image-tiny").json())
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("dall-e-3")
    assert info.value.body["param"] == "model" and info.value.body["code"] == "model_not_found"
    for method, path, status in (("GET", "/v1/images/variations", 404), ("POST", "/nowhere", 404),
                                 ("GET", "/v1/images/generations", 405), ("DELETE", "/v1/models", 405)):
        response = generations.request(method, path)
        assert response.status_code == status and not schema_errors("ErrorResponse", response.json()), (method, path)
        assert f"{method} {path}" in response.json()["error"]["message"]
        assert status != 405 or response.headers["allow"] in ("POST", "GET")
