"""The ingress's routes without a Ray cluster: the CrossEngineCoordinator over a fake stage protocol, its routes
attached by build_api, driven by starlette's TestClient. test_serve.py runs the same routes over the real stage
deployments."""

import asyncio
import base64
import io
import json

import numpy as np
import pytest
from conftest import REPO
from fastapi.testclient import TestClient
from PIL import Image

from deployments.http.api_keys import ApiKeys
from deployments.http.routes import ROUTES
from omni_ray.api.images import working_size
from omni_ray.config import LoraEntry, LoraSettings, load_config
from omni_ray.errors import OverloadedError, RequestError
from omni_ray.runners import lora as lora_module
from omni_ray.runners.lora import AdapterFiles
from testing import coordinator
from testing.coordinator import MemoryAdapters
from testing.fake_stages import FakeStages

ERROR_FIELDS = {"message", "type", "param", "code"}


def client_for(config, stages=None, unready=list, **options) -> tuple[TestClient, FakeStages]:
    stages = stages or FakeStages()
    return coordinator.client(config, stages, unready=unready, **options), stages


def allowing_runtime_adapters(config, *roots):
    return config.model_copy(update={"lora": LoraSettings(allow_runtime_updates=True, roots=roots or ("/adapters",))})


@pytest.fixture(scope="module")
def config(tiny_dir):
    return load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir))


@pytest.fixture(scope="module")
def client(config):
    return client_for(config)[0]


def image_of(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))))


def events_of(response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: ")]


def test_json_response_carries_each_image_from_the_stages(client):
    response = client.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x96", "n": 2, "seed": 5})
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    body = response.json()
    assert "size" not in body  # OpenAI's schema allows three sizes there; the image has its own
    images = [image_of(item["b64_json"]) for item in body["data"]]
    assert [image.shape for image in images] == [(96, 64, 3)] * 2
    assert [int(image[0, 0, 0]) for image in images] == [5, 6]  # the fake's pixels are each image's seed


def test_streamed_events_are_previews_then_the_image_and_progress_only_when_asked(client):
    body = {"prompt": "a cat", "size": "64x64", "seed": 3, "stream": True, "partial_images": 1,
            "num_inference_steps": 4}
    response = client.post("/v1/images/generations", json=body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    kinds = [event["type"] for event in events_of(response)]
    assert kinds == ["image_generation.partial_image", "image_generation.completed"]
    preview, completed = events_of(response)
    assert int(image_of(preview["b64_json"])[0, 0, 0]) == 3 + 2  # the fake's preview of step 2
    assert int(image_of(completed["b64_json"])[0, 0, 0]) == 3
    asked = events_of(client.post("/v1/images/generations", json={**body, "progress": True}))
    assert [event["type"] for event in asked] == ["image_generation.progress"] * 2 + [
        "image_generation.partial_image"] + ["image_generation.progress"] * 2 + ["image_generation.completed"]
    assert [(event["step"], event["total_steps"]) for event in asked if "step" in event] == [(1, 4), (2, 4), (3, 4),
                                                                                           (4, 4)]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a cat", "size": "65x64"}, "size"),
    ({"prompt": "a cat", "n": 0}, "n"),
    ({"prompt": "a cat", "colour": "red"}, "colour"),
    ({"prompt": "  "}, "prompt"),
    ({"prompt": "a cat", "true_cfg_scale": "high"}, "true_cfg_scale"),
    ({"prompt": "a cat", "priority": 101}, "priority"),
    ({"prompt": "a cat", "priority": 1.5}, "priority"),
    ({"prompt": "a cat", "timeout": 0}, "timeout"),
    ({"prompt": "a cat", "timeout": 100000}, "timeout"),
    ({"prompt": "a cat", "user": "u" * 257}, "user"),
])
def test_a_bad_field_is_a_400_naming_it(client, body, param):
    response = client.post("/v1/images/generations", json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and set(error) == ERROR_FIELDS
    assert error["type"] == "invalid_request_error" and error["message"].startswith(param)


def test_a_body_that_is_not_json_is_a_400(client):
    response = client.post("/v1/images/generations", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    for body in ([{"prompt": "a cat"}], "a cat", 3):
        response = client.post("/v1/images/generations", json=body)
        assert response.status_code == 400 and "JSON object" in response.json()["error"]["message"], body


def test_an_unknown_model_is_a_404_model_not_found(client):
    response = client.post("/v1/images/generations", json={"prompt": "a cat", "model": "dall-e-3"})
    error = response.json()["error"]
    assert response.status_code == 404 and error["code"] == "model_not_found" and error["param"] == "model"


def test_the_images_route_a_preset_does_not_serve_is_a_400_naming_image(client, edit_dir):
    files = {"image": ("cat.png", b"\x89PNG not really", "image/png")}
    for response in (client.post("/v1/images/edits", data={"prompt": "make it blue"}, files=files),
                     client.post("/v1/images/edits", json={"prompt": "a cat"})):
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "image" and "/v1/images/generations" in error["message"]
    edit_config = load_config(REPO / "stage_configs/qwen_image_edit_tiny.yaml", model=str(edit_dir))
    response = client_for(edit_config)[0].post("/v1/images/generations", json={"prompt": "a cat"})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "image" and "/v1/images/edits" in error["message"]


def test_an_upload_is_edited_at_its_working_size(edit_dir):
    config = load_config(REPO / "stage_configs/qwen_image_edit_tiny.yaml", model=str(edit_dir))
    client, stages = client_for(config)
    buffer = io.BytesIO()
    Image.fromarray(np.full((200, 100, 3), 200, np.uint8)).save(buffer, format="PNG")
    files = {"image": ("tall.png", buffer.getvalue(), "image/png")}
    response = client.post("/v1/images/edits", data={"prompt": "make it blue", "seed": "7"}, files=files)
    assert response.status_code == 200, response.text
    (stored,) = [call.args[0] for call in stages.calls_to("put_image")]
    height, width = stored.shape[:2]
    assert (height, width) == working_size(100, 200, config.edit.image_area) and height > width  # aspect kept
    assert image_of(response.json()["data"][0]["b64_json"]).shape == (height, width, 3)
    bad = client.post("/v1/images/edits", data={"prompt": "x"}, files={"image": ("a.png", b"nope", "image/png")})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "image"


def test_a_failed_stream_sends_the_same_error_body_as_json(config):
    client, _ = client_for(config, FakeStages(fail={"decode": OverloadedError("queue full", 3.0, "vae")}))
    as_json = client.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64"})
    assert as_json.status_code == 503 and as_json.headers["retry-after"] == "3"
    streamed = client.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64", "stream": True})
    event = events_of(streamed)[-1]
    assert event["type"] == "error" and event["error"] == as_json.json()["error"]
    assert set(event["error"]) == ERROR_FIELDS and event["error"]["type"] == "overloaded_error"


def test_health_models_and_the_page(config):
    waiting = ["Encoder"]
    client, _ = client_for(config, unready=lambda: waiting)
    assert client.get("/health").status_code == 503 and client.get("/health").json()["waiting_for"] == ["Encoder"]
    waiting.clear()
    assert client.get("/health").json() == {"status": "ok"}
    (base,) = client.get("/v1/models").json()["data"]
    assert base["id"] == config.name and base["created"] > 0
    page = client.get("/")
    assert page.status_code == 200 and config.name in page.text
    assert client.get("/web/app.js").status_code == 200 and client.get("/web/nope.js").status_code == 404


def page_settings(html: str) -> dict:
    """The settings page.py wrote into the page for app.js."""
    tag = '<script id="settings" type="application/json">'
    start = html.index(tag) + len(tag)
    return json.loads(html[start:html.index("</script>", start)])


def test_the_page_is_told_the_preset_s_controlnets_where_they_run(config):
    """The page offers ControlNets (its Control section) on a text-to-image preset that holds some, up to
    requests.max_controls; none on one without, nor on an edit preset (which refuses `control`)."""
    from deployments.http.page import page_html
    from omni_ray.config import EditConfig

    plain = page_settings(client_for(config)[0].get("/").text)
    assert (plain["controlnets"], plain["max_controls"], plain["edit"]) == ([], 0, False)
    held = config.model_copy(update={"controlnets": {"union": "/nets/union", "canny": "/nets/canny"}})
    controlled = page_settings(client_for(held)[0].get("/").text)
    assert controlled["controlnets"] == ["union", "canny"]
    assert controlled["max_controls"] == config.requests.max_controls == 2
    edit = page_settings(page_html(held.model_copy(update={"edit": EditConfig()})))
    assert (edit["controlnets"], edit["max_controls"], edit["edit"]) == ([], 0, True)


def test_the_page_is_told_a_layered_preset_s_buckets_and_layer_bounds(config):
    """On a Qwen-Image-Layered preset the page offers its Layers fields: the preset's resolution buckets (the first
    the server's default), 2 to 8 layers (4 by default) and the caption languages (English the default); on a
    text-to-image, an edit or a 2.1 preset, none."""
    from deployments.http.page import page_html
    from omni_ray.config import EditConfig

    plain = page_settings(client_for(config)[0].get("/").text)
    assert (plain["family"], plain["layered"]) == ("qwen-image", None)
    assert page_settings(page_html(config.model_copy(update={"edit": EditConfig()})))["layered"] is None
    assert page_settings(page_html(config.model_copy(update={"family": "qwen-image-2.1"})))["layered"] is None
    layered = config.model_copy(update={"family": "qwen-image-layered", "edit": EditConfig(resolutions=(64, 128))})
    settings = page_settings(client_for(layered)[0].get("/").text)
    assert (settings["family"], settings["edit"], settings["controlnets"]) == ("qwen-image-layered", True, [])
    assert settings["layered"] == {"resolutions": [64, 128], "min_layers": 2, "max_layers": 8, "default_layers": 4,
                                   "caption_languages": ["en", "zh"]}


def test_adapters_are_checked_by_the_dit_before_they_are_listed(config):
    client, stages = client_for(allowing_runtime_adapters(config))
    loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "style", "lora_path": "/adapters/style"})
    assert loaded.status_code == 200 and [c.args for c in stages.calls_to("check_lora")] == [("/adapters/style",)]
    assert loaded.json() == {"lora_name": "style", "status": "loaded"}  # no path in any response
    models = client.get("/v1/models").json()["data"]
    assert [model["id"] for model in models] == [config.name, "style"]
    assert "/adapters" not in json.dumps(models)
    again = client.post("/v1/load_lora_adapter", json={"lora_name": "style", "lora_path": "/adapters/style"})
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "style"}).status_code == 200
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "style"}).status_code == 404


def test_a_run_time_adapter_s_recipe_fills_the_fields_a_request_leaves_out(config):
    """The recipe the DiT found beside a run-time adapter rides with it in the store: a request naming the adapter
    gets its steps, true CFG scale (1: off, despite the negative prompt) and scheduler settings."""

    class WithRecipe(FakeStages):
        async def check_lora(self, path):
            await super().check_lora(path)
            return LoraEntry(path=path, recipe={"num_inference_steps": 3, "true_cfg_scale": 1.0,
                                                "scheduler": {"shift": 3.0, "use_dynamic_shifting": False}})

    client, stages = client_for(allowing_runtime_adapters(config), stages=WithRecipe())
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "fast", "lora_path": "/adapters/fast"}
                       ).status_code == 200
    body = {"prompt": "a cat", "negative_prompt": "blurry", "size": "64x64", "model": "fast"}
    assert client.post("/v1/images/generations", json=body).status_code == 200
    assert client.post("/v1/images/generations", json={**body, "num_inference_steps": 2, "true_cfg_scale": 2.0}
                       ).status_code == 200
    assert client.post("/v1/images/generations", json={**body, "quality": "auto"}).status_code == 200
    recipe, own, auto = (call.args[1] for call in stages.calls_to("denoise"))
    assert auto.num_inference_steps == 3  # quality "auto", as SDKs send it, leaves the steps to the recipe
    assert (recipe.num_inference_steps, recipe.true_cfg, [lora.name for lora in recipe.loras]) == (3, False, ["fast"])
    assert recipe.scheduler == (("shift", 3.0), ("use_dynamic_shifting", False))
    assert (own.num_inference_steps, own.true_cfg, own.true_cfg_scale) == (2, True, 2.0)
    assert own.scheduler == recipe.scheduler


KEYED_ROUTES = [("POST", "/v1/images/generations"), ("POST", "/v1/images/edits"), ("GET", "/v1/models"),
                ("GET", "/v1/models/{model}"), ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter")]


def test_every_v1_route_takes_an_api_key_when_the_server_has_keys(config):
    client, stages = client_for(allowing_runtime_adapters(config), api_keys=ApiKeys.from_env(
        {"OMNI_RAY_API_KEY": "sk-first, sk-second"}))
    # a new /v1 route must be listed in KEYED_ROUTES too
    assert {path for _, path, _ in ROUTES.values() if path.startswith("/v1/")} == {path for _, path in KEYED_ROUTES}
    wrong = [{}, {"Authorization": "Bearer sk-third"}, {"Authorization": "sk-first"}, {"X-Api-Key": "sk-first"},
             {"Authorization": "Basic sk-first"}]
    for method, path in KEYED_ROUTES:
        for headers in wrong:
            response = client.request(method, path.format(model=config.name), headers=headers, json={"prompt": "a cat"})
            error = response.json()["error"]
            assert response.status_code == 401, (path, headers)
            assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_api_key", None)
            assert "sk-" not in error["message"]  # a key is never echoed
    assert not stages.calls  # nothing reached the stages
    for key in ("sk-first", "sk-second"):
        response = client.post("/v1/images/generations", headers={"Authorization": f"Bearer {key}"},
                               json={"prompt": "a cat", "size": "64x64"})
        assert response.status_code == 200
    assert client.get("/health").status_code == 200 and client.get("/web/app.js").status_code == 200
    page = client.get("/")
    assert page.status_code == 200 and '"api_key": true' in page.text  # the page asks for the key
    assert '"api_key": false' in client_for(config)[0].get("/").text


def test_runtime_adapters_are_refused_unless_the_preset_allows_them(config):
    client, stages = client_for(config)
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "s", "lora_path": "/adapters/s"}),
                       ("/v1/unload_lora_adapter", {"lora_name": "s"})):
        response = client.post(path, json=body)
        assert response.status_code == 403 and "lora.allow_runtime_updates" in response.json()["error"]["message"]
    assert not stages.calls_to("check_lora")


def test_coordinators_sharing_a_store_serve_each_others_adapters(config):
    """Two coordinator replicas over one store (the app's is the cluster's key-value store): an adapter loaded
    through one is served by the other, and by a replica started after; unloaded through one, by neither."""
    config = allowing_runtime_adapters(config)
    store = MemoryAdapters()
    first, stages = client_for(config, adapters=store)
    second, _ = client_for(config, stages, adapters=store)
    body = {"prompt": "a cat", "size": "64x64", "model": "style", "num_inference_steps": 2}
    assert second.post("/v1/images/generations", json=body).status_code == 404
    assert first.post("/v1/load_lora_adapter", json={"lora_name": "style", "lora_path": "/adapters/s"}).status_code \
        == 200
    later, _ = client_for(config, stages, adapters=store)
    for client in (second, later):
        assert client.post("/v1/images/generations", json=body).status_code == 200
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [config.name, "style"]
    (lora,) = stages.calls_to("denoise")[-1].args[1].loras
    assert (lora.name, lora.path) == ("style", "/adapters/s")
    assert second.post("/v1/load_lora_adapter", json={"lora_name": "style", "lora_path": "/adapters/s"}).status_code \
        == 400
    assert later.post("/v1/unload_lora_adapter", json={"lora_name": "style"}).status_code == 200
    assert first.post("/v1/images/generations", json=body).status_code == 404


class ConfinedStages(FakeStages):
    """The fake stages with the DiT's real check of a run-time adapter's path."""

    def __init__(self, root):
        super().__init__()
        self.files = AdapterFiles(roots=[str(root)])

    async def check_lora(self, path):
        return self.files.check(path, {})  # no Linear layers: any file that is read is refused as not fitting


def test_adapter_paths_outside_the_roots_are_refused_without_reading_them(config, tmp_path, monkeypatch):
    root, outside = tmp_path / "adapters", tmp_path / "private"
    root.mkdir(), outside.mkdir()
    secret = outside / "pytorch_lora_weights.safetensors"
    secret.write_bytes(b"\x00" * 64)
    (root / "inside.safetensors").write_bytes(b"\x00" * 64)
    (root / "link").symlink_to(outside)
    (root / "file_link.safetensors").symlink_to(secret)
    read = []
    monkeypatch.setattr(lora_module, "read_lora", lambda path, shapes: read.append(path) or {})
    client, _ = client_for(allowing_runtime_adapters(config, str(root)), ConfinedStages(root))
    for path in (str(secret), str(outside), f"{root}/../private/pytorch_lora_weights.safetensors", "../private",
                 str(root / "link" / "pytorch_lora_weights.safetensors"), str(root / "file_link.safetensors"),
                 "link", "/etc/passwd", str(tmp_path)):
        response = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
        error = response.json()["error"]
        assert (response.status_code, error["param"]) == (400, "lora_path"), path
        assert str(tmp_path) not in json.dumps(error) and "private" not in error["message"]  # no path echoed
    assert read == []  # nothing outside the root was read
    loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "inside.safetensors"})
    assert loaded.status_code == 200 and read == [str(root / "inside.safetensors")]  # relative: under the root


def test_a_recipe_beside_a_run_time_adapter_is_read_only_under_the_roots(config, tmp_path, monkeypatch):
    """A recipe.json that links outside ``lora.roots`` is refused like the adapter would be, unread; a bad one is a
    400 naming ``lora_path`` that echoes no path; a good one rides with the adapter."""
    root, outside = tmp_path / "adapters", tmp_path / "private"
    root.mkdir(), outside.mkdir()
    (outside / "secret.json").write_text('{"num_inference_steps": 4}')
    recipes = {"linked": None, "bad": '{"num_inference_steps": 0}', "good": '{"num_inference_steps": 4}'}
    for name, recipe in recipes.items():
        (root / name).mkdir()
        (root / name / "pytorch_lora_weights.safetensors").write_bytes(b"\x00" * 64)
        if recipe is None:
            (root / name / "recipe.json").symlink_to(outside / "secret.json")
        else:
            (root / name / "recipe.json").write_text(recipe)
    monkeypatch.setattr(lora_module, "read_lora", lambda path, shapes: {})
    client, stages = client_for(allowing_runtime_adapters(config, str(root)), ConfinedStages(root))
    for name in ("linked", "bad"):
        response = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": name})
        error = response.json()["error"]
        assert (response.status_code, error["param"]) == (400, "lora_path"), name
        assert str(tmp_path) not in json.dumps(error) and name not in error["message"].split("lora_path")[1]
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "good", "lora_path": "good"}).status_code == 200
    client.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64", "model": "good"})
    (call,) = stages.calls_to("denoise")
    assert call.args[1].num_inference_steps == 4


class EstimatingStages(FakeStages):
    """Fake stages whose DiT says it would finish any request in ``seconds``."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds, self.asked = seconds, []

    async def estimate(self, plan, request_id=None, budget_s=None):
        self.asked.append((plan, request_id, budget_s))
        return self.seconds


def test_a_request_the_queue_cannot_finish_by_its_deadline_is_refused_at_once(config):
    stages = EstimatingStages(20.0)
    client, _ = client_for(config, stages)
    body = {"prompt": "a cat", "size": "64x64", "num_inference_steps": 3, "n": 2, "timeout": 5, "priority": 1}
    for streamed in (False, True):  # a stream is refused before it starts: a 503, not an error event
        response = client.post("/v1/images/generations", json={**body, "stream": streamed})
        error = response.json()["error"]
        # The DiT's budget: the deadline less 1 s for the other stages (none seen yet) and a margin: 3.2 s.
        assert response.status_code == 503 and response.headers["retry-after"] == "17"
        assert error["type"] == "overloaded_error" and "past its 5 s deadline" in error["message"]
    assert not stages.calls  # no stage was asked anything
    plan, request_id, budget = stages.asked[0]
    assert request_id and budget == pytest.approx((5 - 1 - 0.5) / 1.1)
    assert (plan.request.priority, plan.request.n, plan.num_inference_steps, plan.timeout_s) == (1, 2, 3, 5)
    assert plan.work_tokens > 16  # 64x64 is 16 image tokens; the prompt's come on top
    response = client.post("/v1/images/generations", json={**body, "timeout": 30}, headers={"x-request-id": "r7"})
    assert response.status_code == 200
    assert [call.args[1].priority for call in stages.calls_to("denoise")] == [1, 1]
    assert stages.asked[-1][1] == "r7"  # admitted under the id its calls run under (r7-0, r7-1)
    assert [call.args[0] for call in stages.calls_to("denoise")] == ["r7-0", "r7-1"]


def test_the_dit_shares_steps_between_api_keys_or_else_users(config):
    keyed, stages = client_for(config, api_keys=ApiKeys(["sk-a", "sk-b"]))
    for key in ("sk-a", "sk-b"):
        response = keyed.post("/v1/images/generations", headers={"Authorization": f"Bearer {key}"},
                              json={"prompt": "a cat", "size": "64x64", "user": "mallory"})
        assert response.status_code == 200
    assert [call.args[1].tenant for call in stages.calls_to("denoise")] == ["key0", "key1"]  # never the key itself
    open_client, stages = client_for(config)
    open_client.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64", "user": "alice"})
    open_client.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64"})
    assert [call.args[1].tenant for call in stages.calls_to("denoise")] == ["alice", ""]


class ListQueue:
    """What ``generate_into`` puts events into (a ``ray.util.queue.Queue`` across Ray), as a list; its actor dies
    after ``lives_for`` puts."""

    def __init__(self, lives_for: int | None = None):
        self.items, self.lives_for = [], lives_for

    async def put_async(self, item):
        if self.lives_for is not None and len(self.items) >= self.lives_for:
            raise RuntimeError("the actor died")  # Ray's ActorDiedError
        self.items.append(item)


def test_generate_into_puts_the_stream_then_none_and_stops_the_request_when_its_queue_is_gone(config):
    """The stream of a Ray Client caller (issue 35), which Ray Client cannot stream a handle call to."""
    body = {"prompt": "a cat", "size": "64x64", "seed": 3, "num_inference_steps": 2, "progress": True}
    queue = ListQueue()
    asyncio.run(coordinator.coordinator(config).generate_into(queue, body))
    assert [item and item["type"] for item in queue.items] == ["image_generation.progress"] * 2 + [
        "image_generation.completed", None]
    refused = ListQueue()
    with pytest.raises(RequestError, match="n"):  # the call's error, once None tells the caller to look
        asyncio.run(coordinator.coordinator(config).generate_into(refused, {**body, "n": 11}))
    assert refused.items == [None]

    stages = FakeStages(hang="decode")
    gone = coordinator.coordinator(config, stages)

    async def caller_gone():
        with pytest.raises(RuntimeError, match="died"):
            await gone.generate_into(ListQueue(lives_for=1), {**body, "n": 2})
        await asyncio.sleep(0.05)  # the request's calls are cancelled on the next turns of the loop

    asyncio.run(caller_gone())
    assert (gone.in_flight, gone.served) == (0, 1)  # the request ended
    assert stages.calls_to("encode_prompt")[0].cancelled and all(call.cancelled for call in stages.calls_to("decode"))


class RaceQueue:
    """A Ray Client caller's queue (``ray.util.queue.Queue``'s ``get``) whose wait times out just before the call
    puts its last events and returns: they are there once the caller sees the call over."""

    def __init__(self, response, last):
        self.items, self.response, self.last = ["progress"], response, last

    def get(self, block=True, timeout=None):
        from ray.util.queue import Empty

        if not self.items:
            if self.response.done:
                raise Empty
            self.items, self.response.done = list(self.last), True  # put, and returned, as the wait timed out
            raise Empty
        return self.items.pop(0)

    def shutdown(self, force=False):
        self.shut = True


class DoneResponse:
    done = cancelled = False

    def result(self, timeout_s=None):
        if not self.done:
            raise TimeoutError
        return None

    def cancel(self):
        self.cancelled = True


def test_a_ray_client_stream_reads_what_the_call_put_before_it_returned(monkeypatch):
    """The queue's wait can time out just before the call puts its last events and returns: they are read, not lost
    (the image would be)."""
    from ray.util import queue as ray_queue

    from omni_ray.api import client

    response = DoneResponse()
    queue = RaceQueue(response, ["completed", None])
    monkeypatch.setattr(ray_queue, "Queue", lambda actor_options: queue)
    handle = type("Handle", (), {"generate_into": type("M", (), {"remote": staticmethod(lambda *a, **k: response)})})
    assert list(client._queued_events(handle, {}, None, None)) == ["progress", "completed"]
    assert queue.shut and not response.cancelled
    lost = DoneResponse()  # a call that ended without its None (its replica lost) ends the stream
    lost_queue = RaceQueue(lost, [])
    monkeypatch.setattr(ray_queue, "Queue", lambda actor_options: lost_queue)
    lost_handle = type("Handle", (), {"generate_into": type("M", (), {"remote": staticmethod(lambda *a, **k: lost)})})
    assert list(client._queued_events(lost_handle, {}, None, None)) == ["progress"]


def test_a_ray_client_connection_the_head_fails_to_start_is_tried_again(monkeypatch):
    """The head's server for a Ray Client connection at times fails to start (once in a CI run): the client connects
    on a later try; a cluster address is tried once, and a Ray Client one that fails every time raises its error."""
    import ray

    from omni_ray.api import client

    calls = []

    def init(address, failures, **options):
        calls.append(address)
        if len(calls) <= failures:
            raise ConnectionAbortedError("Initialization failure from server")

    monkeypatch.setattr(client.time, "sleep", lambda s: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda address, **options: init(address, 1, **options))
    client.connect_ray("ray://head:10001")
    assert calls == ["ray://head:10001"] * 2
    calls.clear()
    with pytest.raises(ConnectionAbortedError):
        client.connect_ray("127.0.0.1:6379")
    assert calls == ["127.0.0.1:6379"]
    calls.clear()
    monkeypatch.setattr(ray, "init", lambda address, **options: init(address, 9, **options))
    with pytest.raises(ConnectionAbortedError):
        client.connect_ray("ray://head:10001")
    assert calls == ["ray://head:10001"] * 3


def test_connecting_again_closes_a_connection_left_open(monkeypatch):
    """After ray.shutdown, a Ray call from one of Serve's handle threads connects the process again by itself: the
    next connect_ray closes that connection instead of failing as "ray.init twice"."""
    import ray

    from omni_ray.api import client

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: not calls)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(ray, "init", lambda address, **options: calls.append(address))
    client.connect_ray("127.0.0.1:6379")
    assert calls == ["shutdown", "127.0.0.1:6379"]


def test_a_stack_of_adapters_rides_to_the_dit_and_each_bad_one_is_a_400_naming_its_field(config, edit_dir):
    """``loras`` (JSON, and JSON text in a multipart edit's form): each adapter with its scale reaches the DiT, one
    recipe's fields apply; every refusal names its field and no stage is called."""
    recipe = {"num_inference_steps": 3, "true_cfg_scale": 1.0, "scheduler": {"shift": 3.0}}
    config = config.model_copy(update={
        "loras": {"A": LoraEntry(path="/a"), "T": LoraEntry(path="/t"), "B": LoraEntry(path="/b"),
                  "L": LoraEntry(path="/l", recipe=recipe), "M": LoraEntry(path="/m", recipe=recipe)},
        "dit": config.dit.model_copy(update={"max_loras": 4})})
    client, stages = client_for(config)
    body = {"prompt": "a cat", "negative_prompt": "blurry", "size": "64x64"}
    stack = [{"name": "L", "scale": 1.0}, {"name": "T", "scale": 0.6}]
    assert client.post("/v1/images/generations", json={**body, "loras": stack}).status_code == 200
    assert client.post("/v1/images/generations", json={**body, "model": config.name, "loras": [{"name": "A"}]}
                       ).status_code == 200
    assert client.post("/v1/images/generations", json={**body, "loras": []}).status_code == 200  # the base model
    with_recipe, one, none = (call.args[1] for call in stages.calls_to("denoise"))
    assert [(lora.name, lora.path, lora.scale) for lora in with_recipe.loras] == [("L", "/l", 1.0), ("T", "/t", 0.6)]
    assert (with_recipe.num_inference_steps, with_recipe.true_cfg) == (3, False)
    assert with_recipe.scheduler == (("shift", 3.0),)
    assert [(lora.name, lora.scale) for lora in one.loras] == [("A", 1.0)] and none.loras == ()
    assert (one.num_inference_steps, one.true_cfg) == (config.requests.default_steps, True)

    calls = len(stages.calls)
    refused = [
        ({"loras": [{"name": "A"}, {"name": "X"}]}, "loras[1].name", "'X' is not an adapter here"),
        ({"loras": [{"name": "A"}, {"name": "A", "scale": 0.5}]}, "loras[1].name", "named twice"),
        ({"loras": [{"name": "A", "scale": 11}]}, "loras[0].scale", "less than or equal to 10"),
        ({"loras": [{"name": "A", "scale": -0.5}]}, "loras[0].scale", "greater than or equal to 0"),
        ({"loras": [{"scale": 1.0}]}, "loras[0].name", "Field required"),
        ({"loras": [{"name": "A", "weight": 1.0}]}, "loras[0].weight", "unknown parameter"),
        ({"loras": {"name": "A"}}, "loras", "valid list"),
        ({"loras": [{"name": "L"}, {"name": "M"}]}, "loras", "'L' and 'M' both have a sampling recipe"),
        ({"loras": [{"name": n} for n in "ATBL"]}, "loras", "at most 3 (lora.max_per_request)"),
        ({"model": "A", "loras": [{"name": "T"}]}, "loras", "put 'A' in `loras`"),
        ({"loras": [{"name": "T"}], "lora_scale": 0.5}, "lora_scale", "each adapter has its own scale"),
    ]
    for extra, param, says in refused:
        response = client.post("/v1/images/generations", json={**body, **extra})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == param and says in error["message"], (extra, error)
    slots = config.model_copy(update={"dit": config.dit.model_copy(update={"max_loras": 2})})
    response = client_for(slots)[0].post("/v1/images/generations", json={**body, "loras": stack + [{"name": "A"}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "loras"
    assert "at most 2 (the DiT's max_loras slots)" in response.json()["error"]["message"]
    assert len(stages.calls) == calls  # none reached a stage

    edit_config = load_config(REPO / "stage_configs/qwen_image_edit_tiny.yaml", model=str(edit_dir))
    edit_config = edit_config.model_copy(update={"loras": config.loras})
    edits, edit_stages = client_for(edit_config)
    buffer = io.BytesIO()
    Image.fromarray(np.full((64, 64, 3), 200, np.uint8)).save(buffer, format="PNG")
    files = {"image": ("a.png", buffer.getvalue(), "image/png")}
    form = {"prompt": "make it blue", "loras": json.dumps(stack)}
    assert edits.post("/v1/images/edits", data=form, files=files).status_code == 200
    (params,) = (call.args[1] for call in edit_stages.calls_to("denoise"))
    assert [(lora.name, lora.scale) for lora in params.loras] == [("L", 1.0), ("T", 0.6)]
    response = edits.post("/v1/images/edits", data={**form, "loras": "[{'name': 'A'}]"}, files=files)
    assert response.status_code == 400 and response.json()["error"]["param"] == "loras"
    assert "expected a JSON list" in response.json()["error"]["message"]
