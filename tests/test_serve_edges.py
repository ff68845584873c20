"""The served app's edges (issue 28) on a real local Ray cluster: API keys from OMNI_RAY_API_KEY, run-time adapters
that every coordinator replica serves (two replicas here, one of them killed and replaced), the page asking for
the key in Chromium, and a key's quota (OMNI_RAY_KEY_LIMITS) holding across both coordinator replicas.

The same app holds a tiny ControlNet-Union and an inpainting ControlNet (issue 39), so ControlNet served needs no
cluster of its own: the official client sending `control` with base64 images and a multipart form with the images
as files, each image within one level of diffusers' QwenImageControlNetPipeline; an inpainting ControlNet's control
with OpenAI's mask, as JSON and as a `control_mask` file, within one level of QwenImageControlNetInpaintPipeline;
bad controls a 400 naming the field; the page's Control section."""

import base64
import json
import time
import urllib.error
import urllib.request

import openai
import psutil
import pytest
import yaml
from conftest import REPO

from testing.local_serve import LocalServe
from testing.lora_files import make_adapter
from testing.openai_api import conforms
from testing.serving import file_bytes, png, scrape, stage_stats, total, within_one_level

pytestmark = pytest.mark.serve
KEYS = ("sk-omni-first", "sk-omni-second")
LIMITED = "sk-omni-limited"  # key2, the only key with a quota
QUOTA_RPM = 4
COORDINATOR = "ray::ServeReplica:omni-ray:Coordinator"


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    from omni_ray.checkpoints.tiny import write_controlnet

    adapters, nets = tmp_path_factory.mktemp("adapters"), tmp_path_factory.mktemp("controlnets")
    preset = yaml.safe_load((REPO / "stage_configs" / "qwen_image_tiny.yaml").read_text())
    preset["coordinator"]["num_replicas"] = 2
    preset["lora"] = {"allow_runtime_updates": True, "roots": [str(adapters)]}
    preset["controlnets"] = {"union": str(write_controlnet(nets / "union", tiny_dir, seed=1)),
                             "inpaint": str(write_controlnet(nets / "inpaint", tiny_dir, seed=2, inpaint=True))}
    with LocalServe(REPO / "config.yaml", model=str(tiny_dir), preset=preset,
                    env={"OMNI_RAY_API_KEY": ",".join((*KEYS, LIMITED)),
                         "OMNI_RAY_KEY_LIMITS": f"key2: rpm={QUOTA_RPM}"}) as local:
        yield local, adapters


def call(base: str, path: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(base + path, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def keyed(key: str = KEYS[0]) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_routes_take_the_key_and_the_official_client_sends_it(served):
    local, _ = served
    body = {"prompt": "a red cat", "size": "64x64", "num_inference_steps": 2}
    for headers in ({}, keyed("sk-wrong"), {"X-Api-Key": KEYS[0]}, {"Authorization": KEYS[0]}):
        for path, payload in (("/v1/images/generations", body), ("/v1/models", None)):
            status, response = call(local.base_url, path, payload, headers)
            assert status == 401, (path, headers)
            conforms("ErrorResponse", response)
            assert response["error"]["code"] == "invalid_api_key" and "sk-" not in response["error"]["message"]
    assert call(local.base_url, "/health")[0] == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=local.base_url + "/v1", api_key="sk-wrong").models.list()
    for key in KEYS:
        client = openai.OpenAI(base_url=local.base_url + "/v1", api_key=key)
        result = client.images.generate(prompt="a red cat", size="64x64", extra_body={"num_inference_steps": 2})
        conforms("ImagesResponse", result.to_dict())
    events = list(client.images.generate(prompt="a red cat", size="64x64", stream=True, partial_images=1,
                                         extra_body={"num_inference_steps": 3}))
    assert [event.type for event in events] == ["image_generation.partial_image", "image_generation.completed"]
    for event in events:
        conforms("ImageGenStreamEvent", event.to_dict())
    assert "OMNI_RAY_API_KEY is not set" not in local.log() and KEYS[0] not in local.log()


def coordinator_pids() -> set[int]:
    return {p.pid for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[0].startswith(COORDINATOR)}


def test_every_coordinator_replica_serves_a_run_time_adapter_and_so_does_a_replacement(served, tiny_dir):
    local, adapters = served
    assert len(coordinator_pids()) == 2
    make_adapter(tiny_dir, adapters / "A", rank=4, seed=1)
    status, loaded = call(local.base_url, "/v1/load_lora_adapter", {"lora_name": "A", "lora_path": "A"}, keyed())
    assert (status, loaded) == (200, {"lora_name": "A", "status": "loaded"})
    body = {"prompt": "a red cat", "size": "64x64", "num_inference_steps": 2, "model": "A"}

    def every_replica_serves_it() -> None:
        # The proxy spreads requests over both replicas: 16 in a row all reach one with odds of 2 in 65,536.
        for _ in range(16):
            status, models = call(local.base_url, "/v1/models", headers=keyed())
            assert status == 200 and [m["id"] for m in models["data"]] == ["qwen-image-tiny", "A"]
            assert str(adapters) not in json.dumps(models)  # no path in any response
        for _ in range(3):
            assert call(local.base_url, "/v1/images/generations", body, keyed(KEYS[1]))[0] == 200

    every_replica_serves_it()
    before = coordinator_pids()
    victim = psutil.Process(min(before))
    victim.kill()
    victim.wait(30)
    deadline = time.monotonic() + 120
    while not (len(after := coordinator_pids()) == 2 and not after & {victim.pid}) or \
            call(local.base_url, "/health")[0] != 200:
        assert time.monotonic() < deadline, "no replacement coordinator replica within 120 s"
        time.sleep(1)
    time.sleep(3)  # the proxy learns that the killed replica is gone
    every_replica_serves_it()
    assert call(local.base_url, "/v1/unload_lora_adapter", {"lora_name": "A"}, keyed())[0] == 200
    for _ in range(8):
        assert call(local.base_url, "/v1/images/generations", body, keyed())[0] == 404


def test_the_page_asks_for_the_key(served):
    from testing.browser import browser_page, result_size

    local, _ = served
    with browser_page() as page:
        page.goto(local.base_url + "/")
        assert page.is_visible("#api_key")
        page.fill("#prompt", "a lighthouse")
        page.fill("#size", "64x64")
        page.fill("#num_inference_steps", "2")
        page.fill("#api_key", "sk-wrong")
        page.click("#generate")
        page.wait_for_selector('[data-error-for="api_key"]:not(:empty)')
        assert "API key" in page.text_content('[data-error-for="api_key"]')
        page.fill("#api_key", KEYS[1])
        page.click("#generate")
        assert result_size(page) == (64, 64)


def test_a_keys_quota_holds_across_both_coordinator_replicas(served):
    """20 requests of key2 (4 a minute) spread over the two coordinator replicas by Serve's router: 4 answered, 16
    refused with a 429 in OpenAI's shape, both replicas among those that charged or refused them (their counters
    are in one ledger actor); the other keys are not limited."""
    local, _ = served
    body = {"prompt": "a red cat", "size": "64x64", "num_inference_steps": 2}
    answers = [call(local.base_url, "/v1/images/generations", body, keyed(LIMITED)) for _ in range(20)]
    assert [status for status, _ in answers].count(200) == QUOTA_RPM
    refused = [response for status, response in answers if status != 200]
    assert len(refused) == 20 - QUOTA_RPM
    for response in refused:
        conforms("ErrorResponse", response)
        assert (response["error"]["code"], response["error"]["type"]) == ("rate_limit_exceeded", "requests")
        assert "key2 on requests per minute (RPM): Limit 4, Used 4" in response["error"]["message"]
    request = urllib.request.Request(local.base_url + "/v1/images/generations", json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **keyed(LIMITED)})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=60)
    assert err.value.code == 429 and 1 <= int(err.value.headers["Retry-After"]) <= 60
    assert call(local.base_url, "/v1/images/generations", body, keyed(KEYS[0]))[0] == 200
    deadline = time.monotonic() + 30
    while True:  # the replicas' counters reach the exporter every second
        samples = scrape(local.metrics_url)
        charged = total(samples, "ray_omni_quota_requests_total", key="key2")
        refusals = total(samples, "ray_omni_quota_refusals_total", key="key2", limit="rpm")
        if (charged, refusals) == (QUOTA_RPM, 21 - QUOTA_RPM) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert (charged, refusals) == (QUOTA_RPM, 21 - QUOTA_RPM)
    workers = {labels.split('WorkerId="')[1].split('"')[0] for (name, labels), value in samples.items()
               if name in ("ray_omni_quota_requests_total", "ray_omni_quota_refusals_total") and value
               and 'key="key2"' in labels}
    assert len(workers) == 2  # both replicas took key2's requests; the ledger held the limit over both
    # Each refused request was admitted first (reserved at the DiT until its calls come): refused, it gave that up.
    assert stage_stats({"address": local.address})["DiT"]["reservations"] == 0


def test_controlled_generations_as_json_and_multipart_equal_diffusers(served, tiny_dir):
    """ControlNet served (issue 39): the official client sending `control` with a base64 image (extra_body), and a
    multipart form with the image as a file, each within one level of diffusers' QwenImageControlNetPipeline; an
    unknown controlnet a 400 naming it."""
    import requests
    from diffusers import QwenImageControlNetModel, QwenImageControlNetPipeline, QwenImagePipeline

    from testing.reference import reference_controlnet, source_image

    local, _ = served
    client = openai.OpenAI(base_url=local.base_url + "/v1", api_key=KEYS[0])
    net = QwenImageControlNetModel.from_pretrained(local.preset["controlnets"]["union"])
    reference = QwenImageControlNetPipeline(controlnet=net, **QwenImagePipeline.from_pretrained(tiny_dir).components)
    control_image = source_image(96, 64, seed=9)
    png_file = file_bytes(control_image)
    expected = reference_controlnet(reference, [control_image], 12, prompt="a harbour", num_inference_steps=4,
                                    controlnet_conditioning_scale=0.9)
    control = {"name": "union", "scale": 0.9}
    result = client.images.generate(prompt="a harbour", size="96x64", extra_body={
        "seed": 12, "num_inference_steps": 4, "control": [{**control, "image": base64.b64encode(png_file).decode()}]})
    assert within_one_level(png(result.data[0].b64_json), expected)
    response = requests.post(local.base_url + "/v1/images/generations", timeout=120, headers=keyed(), data={
        "prompt": "a harbour", "size": "96x64", "seed": "12", "num_inference_steps": "4",
        "control": json.dumps([control])}, files=[("control_image", ("c.png", png_file, "image/png"))])
    assert response.status_code == 200, response.text
    assert within_one_level(png(response.json()["data"][0]["b64_json"]), expected)
    unknown = [{"name": "canny", "image": base64.b64encode(png_file).decode()}]
    status, body = call(local.base_url, "/v1/images/generations",
                        {"prompt": "a harbour", "size": "96x64", "control": unknown}, keyed())
    assert status == 400 and body["error"]["param"] == "control[0].name", body


def test_inpainting_control_as_json_and_multipart_equals_diffusers(served, tiny_dir):
    import numpy as np
    import requests
    from diffusers import QwenImageControlNetInpaintPipeline, QwenImageControlNetModel

    from testing.reference import openai_mask, reference_controlnet_inpaint, source_image

    local, _ = served
    net = QwenImageControlNetModel.from_pretrained(local.preset["controlnets"]["inpaint"])
    reference = QwenImageControlNetInpaintPipeline.from_pretrained(tiny_dir, controlnet=net)
    control_image = source_image(96, 64, seed=3)
    repaint = np.zeros((64, 96), bool)
    repaint[8:40, 30:90] = True
    image_file, mask_file = file_bytes(control_image), openai_mask(repaint)
    expected = reference_controlnet_inpaint(reference, control_image, repaint, 14, prompt="a taxi",
                                            num_inference_steps=4, controlnet_conditioning_scale=1.1)
    fields = {"prompt": "a taxi", "size": "96x64", "seed": 14, "num_inference_steps": 4}
    encoded = {"image": base64.b64encode(image_file).decode(), "mask": base64.b64encode(mask_file).decode()}
    status, body = call(local.base_url, "/v1/images/generations",
                        {**fields, "control": [{"name": "inpaint", "scale": 1.1, **encoded}]}, keyed())
    assert status == 200, body
    assert within_one_level(png(body["data"][0]["b64_json"]), expected)
    response = requests.post(local.base_url + "/v1/images/generations", timeout=120, headers=keyed(), data={
        **{k: str(v) for k, v in fields.items()}, "control": json.dumps([{"name": "inpaint", "scale": 1.1}])},
        files=[("control_image", ("c.png", image_file, "image/png")),
               ("control_mask", ("m.png", mask_file, "image/png"))])
    assert response.status_code == 200, response.text
    assert within_one_level(png(response.json()["data"][0]["b64_json"]), expected)
    status, body = call(local.base_url, "/v1/images/generations",
                        {**fields, "control": [{"name": "inpaint", "image": encoded["image"]}]}, keyed())
    assert status == 400 and body["error"]["param"] == "control[0].mask", body


def test_the_page_generates_with_a_control_image(served, tmp_path):
    """In a headless Chromium: the page's Control section takes a control image (its thumbnail shows, the empty size
    takes its size), names one of another size than the output before sending, shows the server's 400 beside the
    part it names, and generates the image the same request sends over HTTP (within one level); at most
    requests.max_controls (2) ControlNets; it fits a phone's width."""
    from testing.browser import browser_page, fits_a_phone, result_size
    from testing.reference import source_image

    local, _ = served
    png_file = file_bytes(source_image(96, 64, seed=9))
    (tmp_path / "edges.png").write_bytes(png_file)
    with browser_page() as page:
        sent = []
        page.on("request", lambda request: sent.append(request.url) if "/v1/" in request.url else None)
        page.goto(local.base_url + "/")
        page.fill("#api_key", KEYS[0])
        page.click("#add-control")
        assert page.eval_on_selector("#control-0-name", "select => [...select.options].map(o => o.value)") == ["union"]
        page.click("#add-control")
        assert page.is_disabled("#add-control")  # requests.max_controls: 2
        page.click('[data-field="control[1]"] .remove')
        page.set_input_files("#control-0-image", str(tmp_path / "edges.png"))
        page.wait_for_selector(".control-preview", state="visible")
        page.wait_for_function("document.getElementById('size').value !== ''")
        assert page.input_value("#size") == "96x64"  # the output takes the control image's size

        page.fill("#size", "64x64")
        page.fill("#prompt", "a harbour")
        page.click("#generate")
        page.wait_for_selector('[data-field="control[0].image"] .error:not(:empty)')
        assert "96x64, but the output is 64x64" in page.text_content('[data-field="control[0].image"] .error')
        assert sent == []  # said on the page, not sent
        page.fill("#size", "96x64")
        page.fill("#control-0-scale", "20")
        page.click("#generate")
        page.wait_for_selector('[data-field="control[0].scale"] .error:not(:empty)')  # the server's 400
        assert "control[0].scale" in page.text_content('[data-field="control[0].scale"] .error')
        assert page.text_content('[data-field="control[0].image"] .error') == ""

        page.fill("#control-0-scale", "0.9")
        page.fill("#num_inference_steps", "4")
        page.fill("#seed", "12")
        page.click("#generate")
        assert result_size(page) == (96, 64)
        shown = page.get_attribute(".card img.result", "src").removeprefix("data:image/png;base64,")
        page.screenshot(path=tmp_path / "page-control.png", full_page=True)
        page.set_viewport_size({"width": 390, "height": 844})
        assert fits_a_phone(page)
    control = [{"name": "union", "image": base64.b64encode(png_file).decode(), "scale": 0.9}]
    status, body = call(local.base_url, "/v1/images/generations", {
        "prompt": "a harbour", "size": "96x64", "seed": 12, "num_inference_steps": 4, "true_cfg_scale": 4,
        "control": control}, keyed())
    assert status == 200, body
    assert within_one_level(png(shown), png(body["data"][0]["b64_json"]))
