"""End to end on a real local Ray cluster: `serve run` on the repository's config.yaml, then HTTP, the openai
client and the Ray-handle client, with pixels checked against diffusers' QwenImagePipeline in this process."""

import concurrent.futures
import itertools
import json
import re
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
import yaml
from conftest import REPO

from omni_ray.api.client import connect_ray
from testing.local_serve import LocalServe
from testing.openai_api import conforms
from testing.serving import (
    assert_stops_within_10_s_leaving_no_vllm_file,
    expected,
    png,
    post,
    scrape,
    stage_stats,
    total,
    within_one_level,
)
from testing.traces import format_tree, ours, read_spans, request_traces

pytestmark = pytest.mark.serve

TRACING = {"enabled": True, "exporter_import_path": "omni_ray.tracing.export:jsonl", "sampling_ratio": 1.0}
CLIENT_SPANS = ["decode", "decode", "denoise", "denoise", "encode_prompt", "request"]
ENGINE_SPANS = ["dit.denoise", "dit.denoise", "encoder.encode", "vae.decode", "vae.decode"]
@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    """`serve run` on the repository's config.yaml (a free port, the test checkpoint) on a fresh local cluster, its
    preset allowing run-time adapters from one folder, Ray Serve's tracing on (``tracing_config``) with omni-ray's
    JSON-lines exporter, every process writing its spans under one directory."""
    adapters, spans = tmp_path_factory.mktemp("adapters"), tmp_path_factory.mktemp("spans")
    preset = yaml.safe_load((REPO / "stage_configs" / "qwen_image_tiny.yaml").read_text())
    preset["lora"] = {"allow_runtime_updates": True, "roots": [str(adapters)]}
    # The tiny DiT learns its step times from 64x64 steps, whose fixed cost the fit reads as cost per token, so on a
    # slow machine its estimate of the 512x512 request below (LONG) passed 600 s (1,739 s, for a request that runs
    # in seconds) and admission refused it; these tests are about streams and aborts, not deadlines.
    preset.setdefault("requests", {})["timeout_s"] = 3600.0
    config = {**yaml.safe_load((REPO / "config.yaml").read_text()), "tracing_config": TRACING}
    path = tmp_path_factory.mktemp("config") / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with LocalServe(path, model=str(tiny_dir), preset=preset, env={"OMNI_RAY_TRACE_DIR": str(spans)}) as local:
        yield {"base": local.base_url, "address": local.address, "client": local.client_address,
               "metrics": local.metrics_url, "local": local, "adapters": adapters, "spans": spans}


@pytest.fixture(scope="module")
def reference(tiny_dir):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(tiny_dir)


def test_models_and_health(served):
    import openai

    with urllib.request.urlopen(served["base"] + "/v1/models") as response:
        assert json.loads(response.read())["data"][0]["id"] == "qwen-image-tiny"
    with urllib.request.urlopen(served["base"] + "/health") as response:
        assert response.status == 200
    assert openai.OpenAI(base_url=served["base"] + "/v1", api_key="unused").models.retrieve("qwen-image-tiny").id \
        == "qwen-image-tiny"
    status, body = post(served["base"] + "/v1/images/variations", {"prompt": "a cat"})  # no such route here
    assert status == 404 and body["error"]["type"] == "invalid_request_error" and "POST /v1/images/variations" in \
        body["error"]["message"]


def test_replicas_run_their_presets_threads_and_idle_threads_sleep(served):
    """Spinning OpenMP threads of three stage processes on two cores ate the gain of batching (issue 13)."""
    import psutil

    pids = served["local"].replica_pids()
    assert set(pids) >= {"Coordinator", "Encoder", "DiT", "VAE"}
    for name, pid in pids.items():
        env = psutil.Process(pid).environ()
        assert env.get("OMP_WAIT_POLICY") == "PASSIVE", name
        if name != "Coordinator":
            assert env.get("OMP_NUM_THREADS") == "2", name  # the tiny preset's torch_threads


def test_lora_adapters_load_generate_and_unload_through_the_openai_client(served, tiny_dir):
    """Issue 16: an adapter loaded at run time serves `model="A"` as diffusers' load_lora_weights does; an unknown
    adapter is a 404 naming `model`, a broken file a 400 naming `lora_path`, and the service keeps serving."""
    import openai
    from diffusers import QwenImagePipeline

    from testing.lora_files import make_adapter

    root = served["adapters"]
    adapter = str(make_adapter(tiny_dir, root / "A", rank=4, alpha=8, seed=1))
    (root / "broken").mkdir()
    (root / "broken" / "pytorch_lora_weights.safetensors").write_bytes(b"\x00" * 64)
    client = openai.OpenAI(base_url=served["base"] + "/v1", api_key="unused")
    load, unload = served["base"] + "/v1/load_lora_adapter", served["base"] + "/v1/unload_lora_adapter"
    body = {"seed": 3, "num_inference_steps": 2, "lora_scale": 0.8}

    assert post(load, {"lora_name": "A", "lora_path": adapter})[0] == 200
    assert [m.id for m in client.models.list()] == ["qwen-image-tiny", "A"]
    result = client.images.generate(model="A", prompt="a red cat", size="64x64", extra_body=body)
    reference = QwenImagePipeline.from_pretrained(tiny_dir)
    reference.load_lora_weights(adapter, adapter_name="A")
    reference.set_adapters("A", 0.8)
    image = reference("a red cat", height=64, width=64, num_inference_steps=2, output_type="np",
                      generator=torch.Generator("cpu").manual_seed(3)).images[0]
    assert within_one_level(png(result.data[0].b64_json), (image * 255).round().astype(np.uint8))

    with pytest.raises(openai.NotFoundError) as info:
        client.images.generate(model="B", prompt="a red cat", size="64x64")
    assert (info.value.param, info.value.code) == ("model", "model_not_found")
    for payload, param in (({"lora_name": "B", "lora_path": str(root / "broken")}, "lora_path"),
                           ({"lora_name": "B", "lora_path": str(root / "missing")}, "lora_path"),
                           ({"lora_name": "B", "lora_path": str(root / ".." / "elsewhere")}, "lora_path"),
                           ({"lora_name": "A", "lora_path": adapter}, "lora_name"),
                           ({"lora_name": "qwen-image-tiny", "lora_path": adapter}, "lora_name"),
                           ({"lora_name": "B"}, "lora_path")):
        status, response = post(load, payload)
        assert (status, response["error"]["param"]) == (400, param), response
    assert [m.id for m in client.models.list()] == ["qwen-image-tiny", "A"]  # nothing changed
    assert client.images.generate(prompt="a red cat", size="64x64", extra_body={"num_inference_steps": 2}).data

    assert post(unload, {"lora_name": "A"})[0] == 200
    with pytest.raises(openai.NotFoundError):
        client.images.generate(model="A", prompt="a red cat", size="64x64")
    assert post(unload, {"lora_name": "A"})[0] == 404
    assert stage_stats(served)["DiT"]["lora_loads"] == 1


def test_a_stack_of_adapters_through_the_official_client_and_the_page_equals_diffusers_set_adapters(served, tiny_dir):
    """Issue 52: two run-time adapters (ranks 4 and 8, the second on attention alone) stacked at weights 1.0 and 0.6
    through the openai client's extra_body are diffusers' set_adapters with those weights, and a few-step adapter
    (Lightning's recipe beside its file) stacked with the second is that with the recipe's steps, CFG and scheduler;
    on the page, the first two picked from the model list with their weights give the same image as the client, and
    a weight out of range is said beside it."""
    import openai
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    from testing.browser import browser_page, result_size
    from testing.lora_files import make_adapter

    root = served["adapters"]
    paths = {"S1": str(make_adapter(tiny_dir, root / "S1", rank=4, alpha=8, seed=1)),
             "S2": str(make_adapter(tiny_dir, root / "S2", rank=8, alpha=16, seed=4, targets=(
                 "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"))),
             "L": str(make_adapter(tiny_dir, root / "L", rank=4, alpha=8, seed=6))}
    lightning = {"base_shift": 1.0986122886681098, "max_shift": 1.0986122886681098, "max_image_seq_len": 8192,
                 "shift_terminal": None}
    (root / "L" / "recipe.json").write_text(json.dumps({"num_inference_steps": 4, "true_cfg_scale": 1.0,
                                                         "scheduler": lightning}))
    load, unload = served["base"] + "/v1/load_lora_adapter", served["base"] + "/v1/unload_lora_adapter"
    client = openai.OpenAI(base_url=served["base"] + "/v1", api_key="unused")
    stack = [{"name": "S1", "scale": 1.0}, {"name": "S2", "scale": 0.6}]
    try:
        for name, path in paths.items():
            assert post(load, {"lora_name": name, "lora_path": path})[0] == 200
        result = client.images.generate(prompt="a red cat", size="64x64", extra_body={
            "seed": 3, "num_inference_steps": 2, "loras": stack})
        fast = client.images.generate(prompt="a red cat", size="64x64", extra_body={
            "seed": 4, "negative_prompt": "blurry", "loras": [{"name": "L"}, {"name": "S2", "scale": 0.6}]})
        with pytest.raises(openai.BadRequestError) as info:
            client.images.generate(prompt="a red cat", size="64x64", extra_body={"loras": [{"name": "S3"}]})
        assert info.value.param == "loras[0].name"
        with browser_page() as page:
            page.goto(served["base"] + "/")
            for k, (name, weight) in enumerate((("S1", "1"), ("S2", "0.6"))):
                page.click("#add-adapter")  # the row comes once the model list is read
                page.wait_for_selector(f"#lora-{k}-name option[value='{name}']", state="attached")
                page.select_option(f"#lora-{k}-name", name)
                page.fill(f"#lora-{k}-scale", weight)
            page.fill("#size", "64x64")
            page.fill("#num_inference_steps", "2")
            page.fill("#seed", "3")
            page.fill("#prompt", "a red cat")
            page.click("#generate")
            assert result_size(page) == (64, 64)
            on_page = page.get_attribute(".card img.result", "src").split(",", 1)[1]
            page.fill("#lora-1-scale", "11")
            page.click("#generate")
            page.wait_for_selector('[data-error-for="loras[1].scale"]:not(:empty), [data-field="loras[1].scale"] '
                                   '.error:not(:empty)')
            assert "less than or equal to 10" in page.text_content('[data-field="loras[1].scale"] .error')
    finally:
        for name in paths:
            post(unload, {"lora_name": name})
    reference = QwenImagePipeline.from_pretrained(tiny_dir)
    for name, path in paths.items():
        reference.load_lora_weights(path, adapter_name=name)
    reference.set_adapters(["S1", "S2"], adapter_weights=[1.0, 0.6])
    image = reference("a red cat", height=64, width=64, num_inference_steps=2, output_type="np",
                      generator=torch.Generator("cpu").manual_seed(3)).images[0]
    expected = (image * 255).round().astype(np.uint8)
    assert within_one_level(png(result.data[0].b64_json), expected)
    assert within_one_level(png(on_page), expected)
    reference.set_adapters(["L", "S2"], adapter_weights=[1.0, 0.6])
    reference.scheduler = FlowMatchEulerDiscreteScheduler.from_config({**reference.scheduler.config, **lightning})
    image = reference("a red cat", negative_prompt="blurry", true_cfg_scale=1.0, height=64, width=64,
                      num_inference_steps=4, output_type="np",
                      generator=torch.Generator("cpu").manual_seed(4)).images[0]
    assert within_one_level(png(fast.data[0].b64_json), (image * 255).round().astype(np.uint8))


def test_http_images_match_diffusers_with_seed_per_image(served, reference):
    body = {"prompt": "a lighthouse at sunset", "n": 2, "size": "96x64", "seed": 7, "num_inference_steps": 3,
            "negative_prompt": "blurry", "true_cfg_scale": 4.0, "response_format": "b64_json"}
    status, response = post(served["base"] + "/v1/images/generations", body)
    assert status == 200, response
    assert len(response["data"]) == 2
    conforms("ImagesResponse", response)
    for i, item in enumerate(response["data"]):
        pixels = png(item["b64_json"])
        assert pixels.shape == (64, 96, 3)
        assert within_one_level(pixels, expected(reference, body["prompt"], 7 + i, 64, 96, 3, "blurry"))


def test_openai_client(served, reference):
    import openai

    client = openai.OpenAI(base_url=served["base"] + "/v1", api_key="unused")
    result = client.images.generate(
        model="qwen-image-tiny", prompt="a red cat", size="64x64", response_format="b64_json",
        extra_body={"seed": 3, "num_inference_steps": 2},
    )
    pixels = png(result.data[0].b64_json)
    assert within_one_level(pixels, expected(reference, "a red cat", 3, 64, 64, 2))
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(prompt="a red cat", size="65x64")
    assert info.value.param == "size"


def test_openai_image_parameters_through_the_openai_client(served):
    """Issue 17: quality maps to the preset's steps, size=auto takes its default, background, moderation and user are
    accepted and reported as OpenAI reports them; transparent backgrounds and styles are 400s naming the field, and an
    unknown model a 404 with code model_not_found."""
    import openai

    client = openai.OpenAI(base_url=served["base"] + "/v1", api_key="unused")
    result = client.images.generate(model="qwen-image-tiny", prompt="a red cat", size="auto", quality="low",
                                    background="opaque", moderation="low", user="u-1", output_format="webp",
                                    extra_body={"timings": True})
    # 256x256 is not among the three sizes OpenAI's schema allows in a response: the field is left out
    assert (result.size, result.quality, result.background, result.output_format) == (None, "low", "opaque", "webp")
    conforms("ImagesResponse", result.to_dict())
    assert result.data[0].model_extra["dit_passes"]["computed"] == 2  # quality=low: the tiny preset's 2 steps
    assert client.images.generate(prompt="a cat", size="64x64", background="auto", moderation="auto",
                                  quality="auto", safety_identifier="s-1").quality == "high"  # default_steps 8
    for param, fields in (("background", {"background": "transparent"}), ("style", {"style": "vivid"}),
                          ("quality", {"quality": "hd"})):
        with pytest.raises(openai.BadRequestError) as info:
            client.images.generate(prompt="a cat", size="64x64", **fields)
        assert info.value.param == param
    with pytest.raises(openai.NotFoundError) as info:
        client.images.generate(model="dall-e-3", prompt="a cat", size="64x64")
    assert (info.value.param, info.value.code) == ("model", "model_not_found")


def test_openai_client_streams_partial_images_then_the_image(served):
    """Issue 17: stream=True, partial_images=2 through the official client: two partial images (the DiT's predicted
    clean image, decoded) and then the image, equal to the same request not streamed."""
    import openai

    client = openai.OpenAI(base_url=served["base"] + "/v1", api_key="unused")
    fields = {"prompt": "a red cat", "size": "64x64", "extra_body": {"seed": 9, "num_inference_steps": 4}}
    events = list(client.images.generate(**fields, stream=True, partial_images=2))
    for event in events:
        conforms("ImageGenStreamEvent", event.to_dict())
    kinds = [(e.type, getattr(e, "partial_image_index", None)) for e in events]
    assert kinds == [("image_generation.partial_image", 0), ("image_generation.partial_image", 1),
                     ("image_generation.completed", None)]
    previews = [png(e.b64_json) for e in events if e.type == "image_generation.partial_image"]
    final = png(events[-1].b64_json)
    assert all(p.shape == final.shape == (64, 64, 3) for p in previews)
    # Within one level, as every streamed image here: the two runs may batch differently in the stages.
    assert within_one_level(final, png(client.images.generate(**fields).data[0].b64_json))


def test_the_page_generates_with_progress_and_previews_and_names_a_bad_field(served, tmp_path):
    """Issue 17, in a real headless Chromium: type a prompt and press Enter; the progress bar advances, previews
    appear, then an image of the chosen size with a download link. A bad size shows its error beside the size field.
    At a phone's width nothing overflows."""
    from testing.browser import WATCH, browser_page, fits_a_phone, result_size

    with browser_page() as page:
        page.goto(served["base"] + "/")
        assert "qwen-image-tiny" in page.text_content("#model")
        page.fill("#size", "96x64")
        # Enough steps that progress events reach the page in more than one network read: the tiny DiT steps a
        # 96x64 image in milliseconds, and six steps' events could all arrive (and render) at once.
        page.fill("#num_inference_steps", "40")
        page.fill("#seed", "5")
        page.fill("#prompt", "a lighthouse on a cliff at sunset")
        page.evaluate(WATCH)
        page.press("#prompt", "Enter")
        assert result_size(page) == (96, 64)
        seen = page.evaluate("window.seen")
        assert any(0 < value < total for value, total in seen["progress"]), seen["progress"]
        assert seen["previews"] >= 1
        assert page.get_attribute(".card a[download]", "href").startswith("data:image/png;base64,")
        page.screenshot(path=tmp_path / "page-generate.png", full_page=True)

        page.fill("#size", "65x64")
        page.click("#generate")
        page.wait_for_selector('[data-error-for="size"]:not(:empty)')
        assert "multiple of 16" in page.text_content('[data-error-for="size"]')
        assert page.text_content('[data-error-for="prompt"]') == ""
        page.screenshot(path=tmp_path / "page-error.png", full_page=True)
    with browser_page(390, 844) as phone:
        phone.goto(served["base"] + "/")
        assert fits_a_phone(phone)
        phone.screenshot(path=tmp_path / "page-phone.png", full_page=True)


def test_python_client_through_ray_and_http(served, reference):
    import ray

    from omni_ray.api.client import Client
    from omni_ray.errors import RequestError

    try:
        client = Client.ray(address=served["address"])
        via_ray = client.generate("a red cat", size="64x64", seed=11, num_inference_steps=2)
        streamed = client.generate("a red cat", size="64x64", seed=11, num_inference_steps=2, progress=True)
        assert np.asarray(streamed[0]).tolist() == np.asarray(via_ray[0]).tolist()
        with pytest.raises(RequestError, match="n"):
            Client.ray(address=served["address"]).generate("a red cat", n=11)
    finally:
        ray.shutdown()
    via_http = Client.http(served["base"]).generate("a red cat", size="64x64", seed=11, num_inference_steps=2)
    reference_pixels = expected(reference, "a red cat", 11, 64, 64, 2)
    for images in (via_ray, via_http):
        assert images[0].size == (64, 64)
        assert within_one_level(np.asarray(images[0]), reference_pixels)


LONG = {"prompt": "a very long request", "size": "512x512", "seed": 1, "num_inference_steps": 200,
        "negative_prompt": "blurry"}  # many seconds: a request stopped after its first step runs far fewer


def assert_one_more_aborted_after_few_steps(served, before: dict) -> None:
    deadline = time.monotonic() + 10
    while (dit := stage_stats(served)["DiT"])["running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert dit["running"] == 0 and dit["aborted"] == before["aborted"] + 1
    assert dit["steps"] - before["steps"] < 150


def queue_actors() -> list:
    import psutil

    titles = [(p.info["cmdline"] or [""])[0] for p in psutil.process_iter(["cmdline"])]
    return [title for title in titles if title.startswith("ray::_QueueActor")]  # ".get" while in a method


def test_the_python_client_over_ray_client_streams_as_it_happens_and_a_stream_left_stops(served, capsys):
    """Issue 35: the Python client from outside the cluster, through the head's Ray Client server (`ray://`),
    which streams no handle call: a plain and a streamed generation give the same image, the streamed one's
    progress drawn before the image came (through a queue actor the coordinator puts the events into as they
    happen); a client that stops reading after the first event stops the request there and leaves no queue."""
    import ray

    from omni_ray.api.client import Client

    before = stage_stats(served)["DiT"]
    try:
        client = Client.ray(address=served["client"])
        plain = client.generate("a red cat", size="64x64", seed=11, num_inference_steps=3)
        streamed = client.generate("a red cat", size="64x64", seed=11, num_inference_steps=3, progress=True)
        events = client._stream(LONG, None)  # what `progress=True` reads, left after the first event
        first = next(events)
        events.close()
        deadline = time.monotonic() + 10  # gone while the session lasts (its end would take the queue too)
        while (queues := queue_actors()) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        ray.shutdown()
    assert plain[0].size == (64, 64) and np.asarray(streamed[0]).tolist() == np.asarray(plain[0]).tolist()
    assert "3/3" in capsys.readouterr().err  # a step of the bar per progress event, then the image
    assert (first["type"], first["step"]) == ("image_generation.progress", 1)
    assert_one_more_aborted_after_few_steps(served, before)
    assert queues == []


def test_a_ray_client_driver_that_dies_mid_stream_stops_its_request(served):
    """Its session ends (here at once: Ray Client's default keeps it 30 s for the driver to reconnect), the queue
    it owned goes with it, and the coordinator stops the request at its next event."""
    import os
    import subprocess
    import sys

    driver = ("import json, os, sys\n"
              "from omni_ray.api.client import Client\n"
              "events = Client.ray(address=sys.argv[1])._stream(json.loads(sys.argv[2]), None)\n"
              "print(next(events)['type'], flush=True)\n"
              "os._exit(0)\n")
    before = stage_stats(served)["DiT"]
    died = subprocess.run([sys.executable, "-c", driver, served["client"], json.dumps(LONG)], check=False,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, RAY_CLIENT_RECONNECT_GRACE_PERIOD="0"))
    assert died.stdout == "image_generation.progress\n", died.stderr[-2000:]
    assert_one_more_aborted_after_few_steps(served, before)


def test_sixteen_concurrent_requests_complete_and_batch_in_the_dit(served):
    import ray
    from ray import serve

    def one(i):
        body = {"prompt": f"a watercolor of a mountain lake, variation {i}", "size": "64x64", "seed": i,
                "num_inference_steps": 8}
        return post(served["base"] + "/v1/images/generations", body)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert [status for status, _ in results] == [200] * 16
    assert all(png(r["data"][0]["b64_json"]).shape == (64, 64, 3) for _, r in results)
    try:
        connect_ray(served["address"])
        sizes = serve.get_deployment_handle("DiT", "omni-ray").stats.remote().result()["batch_sizes"]
    finally:
        ray.shutdown()
    assert max(sizes) > 1, sizes  # steps that advanced several requests at once


def test_invalid_request_is_a_400_naming_the_field(served):
    status, response = post(served["base"] + "/v1/images/generations", {"prompt": "a cat", "size": "64x60"})
    assert status == 400
    assert response["error"]["param"] == "size" and response["error"]["type"] == "invalid_request_error"
    status, response = post(served["base"] + "/v1/images/generations", b"not json")
    assert status == 400 and "JSON" in response["error"]["message"]
    status, response = post(served["base"] + "/v1/images/edits", {"prompt": "a cat"})
    assert status == 400 and response["error"]["param"] == "image"
    assert "does not edit images; use /v1/images/generations" in response["error"]["message"]


# --- reliability: bad input, cancellation, load, faults ---------------------------------------------------------

LONG_PROMPT = "word " * 1200  # over the encoder's 1058-token limit once templated

BAD_REQUESTS = [
    # (body, status, param)
    ({}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "   "}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": None}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": LONG_PROMPT}, 400, "prompt"),
    ({"prompt": "a cat", "negative_prompt": LONG_PROMPT, "true_cfg_scale": 4.0}, 400, "negative_prompt"),
    ({"prompt": "a cat", "negative_prompt": 3}, 400, "negative_prompt"),
    ({"prompt": "a cat", "size": "64"}, 400, "size"),
    ({"prompt": "a cat", "size": "axb"}, 400, "size"),
    ({"prompt": "a cat", "size": "64x60"}, 400, "size"),
    ({"prompt": "a cat", "size": "16x16"}, 400, "size"),
    ({"prompt": "a cat", "size": "1024x1024"}, 400, "size"),
    ({"prompt": "a cat", "size": 64}, 400, "size"),
    ({"prompt": "a cat", "n": 0}, 400, "n"),
    ({"prompt": "a cat", "priority": -101}, 400, "priority"),
    ({"prompt": "a cat", "timeout": -1}, 400, "timeout"),
    ({"prompt": "a cat", "n": 11}, 400, "n"),
    ({"prompt": "a cat", "n": "2"}, 400, "n"),
    ({"prompt": "a cat", "n": 2.5}, 400, "n"),
    ({"prompt": "a cat", "num_inference_steps": 0}, 400, "num_inference_steps"),
    ({"prompt": "a cat", "num_inference_steps": 201}, 400, "num_inference_steps"),
    ({"prompt": "a cat", "num_inference_steps": True}, 400, "num_inference_steps"),
    ({"prompt": "a cat", "true_cfg_scale": 0.5}, 400, "true_cfg_scale"),
    ({"prompt": "a cat", "true_cfg_scale": 100}, 400, "true_cfg_scale"),
    ({"prompt": "a cat", "true_cfg_scale": "high"}, 400, "true_cfg_scale"),
    ({"prompt": "a cat", "true_cfg_scale": float("nan")}, 400, "true_cfg_scale"),
    ({"prompt": "a cat", "response_format": "url"}, 400, "response_format"),
    ({"prompt": "a cat", "output_format": "gif"}, 400, "output_format"),
    ({"prompt": "a cat", "output_compression": 101}, 400, "output_compression"),
    ({"prompt": "a cat", "seed": -1}, 400, "seed"),
    ({"prompt": "a cat", "seed": "7"}, 400, "seed"),
    ({"prompt": "a cat", "model": "dall-e-3"}, 404, "model"),  # as OpenAI answers: code model_not_found
    ({"prompt": "a cat", "lora_scale": 0.5}, 400, "lora_scale"),  # a scale without an adapter
    ({"prompt": "a cat", "model": "qwen-image-tiny", "lora_scale": 11.0}, 400, "lora_scale"),
    ({"prompt": "a cat", "colour": "red"}, 400, "colour"),
    ({"prompt": "a cat", "cache": {"kind": "magcache", "threshold": 0.1}}, 400, "cache.kind"),
    ({"prompt": "a cat", "cache": {"kind": "teacache", "threshold": 5}}, 400, "cache.threshold"),
    ({"prompt": "a cat", "cache": "fast"}, 400, "cache"),
    ([{"prompt": "a cat"}], 400, None),
    (b"not json", 400, None),
    (b'{"prompt": "a cat", ', 400, None),
    (b'{"prompt": "' + b"x" * (2 << 20) + b'"}', 413, None),
]


def test_bad_requests_get_a_4xx_naming_the_field_and_never_reach_a_stage(served):
    assert len(BAD_REQUESTS) >= 25
    before = stage_stats(served)
    for body, status, param in BAD_REQUESTS:
        got, response = post(served["base"] + "/v1/images/generations", body)
        assert (got, response["error"]["param"]) == (status, param), (str(body)[:80], response)
        assert response["error"]["message"] and response["error"]["type"] == "invalid_request_error"
    after = stage_stats(served)
    assert {k: v["requests"] for k, v in after.items()} == {k: v["requests"] for k, v in before.items()}


def test_every_metric_the_grafana_dashboard_queries_is_exported(served):
    """k8s/grafana-omni-ray.json (issue 17): each series a panel queries (but Qwen-Image 2.1's) is in a scrape of
    this cluster, once the tests before this one have served images, LoRA adapters and bad requests. The gauges too,
    seconds after the last step: the stages keep them fresh (Ray exports a gauge for about two seconds after it was
    set)."""
    import re

    dashboard = json.loads((REPO / "k8s" / "grafana-omni-ray.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"ray_omni_\w+", target["expr"])
               if not panel["title"].startswith("Qwen-Image 2.1")}  # tests/test_serve21.py checks those
    assert len(queried) >= 10
    time.sleep(5)
    deadline = time.monotonic() + 30
    while missing := queried - {name for name, _ in scrape(served["metrics"])}:
        assert time.monotonic() < deadline, missing
        time.sleep(1)


def disconnect_after(served, body, seconds) -> int | None:
    """Sends ``body`` and hangs up after ``seconds`` (a client that went away): None, or the status of an answer
    that came first."""
    import http.client

    host, port = served["base"].removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=seconds)
    try:
        connection.request("POST", "/v1/images/generations", json.dumps(body), {"Content-Type": "application/json"})
        return connection.getresponse().status
    except TimeoutError:
        return None
    finally:
        connection.close()


def test_a_client_that_disconnects_aborts_its_request_and_others_are_unchanged(served, reference):
    # 200 steps at 256x256 with CFG: many seconds, where 200 steps at 64x64 can finish within the 1.5 s.
    long = {"prompt": "a very long request", "size": "256x256", "seed": 1, "num_inference_steps": 200,
            "negative_prompt": "blurry"}
    others = [{"prompt": f"a red cat, take {i}", "size": "64x64", "seed": 20 + i, "num_inference_steps": 6}
              for i in range(2)]
    before = stage_stats(served)["DiT"]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        cancelled = pool.submit(disconnect_after, served, long, 1.5)
        results = list(pool.map(lambda b: post(served["base"] + "/v1/images/generations", b), others))
        assert cancelled.result() is None
    deadline = time.monotonic() + 10
    while (dit := stage_stats(served)["DiT"])["running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert dit["running"] == 0 and dit["aborted"] == before["aborted"] + 1
    # The 200-step request stopped early: the DiT ran fewer steps than it alone needs (the others' 12 steps included;
    # how many it ran in its 1.5 s depends on the machine: 151 on one fresh-clone run).
    assert dit["steps"] - before["steps"] < 200
    for body, (status, response) in zip(others, results):
        assert status == 200
        pixels = png(response["data"][0]["b64_json"])
        assert within_one_level(pixels, expected(reference, body["prompt"], body["seed"], 64, 64, 6))


# --- observability: metrics and request ids ---------------------------------------------------------------------


def quiet(url: str, timeout: float = 30.0) -> dict:
    """A scrape once the earlier tests' last requests have reached the exporter: two in a row agree (Ray exports
    every second here)."""
    moving = ("event_loop", "cpu_seconds")  # the coordinator's watch samples these all the time
    omni = lambda samples: {k: v for k, v in samples.items()
                            if k[0].startswith("ray_omni_") and not any(m in k[0] for m in moving)}
    deadline = time.monotonic() + timeout
    last = omni(scrape(url))
    while True:
        time.sleep(2.5)
        samples = scrape(url)
        if omni(samples) == last or time.monotonic() > deadline:
            return samples
        last = omni(samples)


def test_prometheus_metrics_per_stage(served):
    def settled(check, timeout=60):
        deadline = time.monotonic() + timeout
        while not check(samples := scrape(served["metrics"])):
            assert time.monotonic() < deadline, sorted({n for n, _ in samples if "omni" in n})
            time.sleep(1)
        return samples

    def exported(samples, name, stage="dit"):
        return any(n == name and f'stage="{stage}"' in labels for n, labels in samples)

    before = quiet(served["metrics"])
    bodies = [{"prompt": "a red cat", "size": "64x64", "seed": 1, "num_inference_steps": 3, "n": 2},
              {"prompt": "a cup", "size": "64x64", "seed": 2, "num_inference_steps": 3},
              {"prompt": "a bowl", "size": "64x64", "seed": 3, "num_inference_steps": 3, "negative_prompt": "dark"},
              {"prompt": "a vase", "size": "64x64", "seed": 4, "num_inference_steps": 3, "negative_prompt": "dark",
               "cache": {"kind": "teacache", "threshold": 1.5}}]  # TeaCache: the middle step reuses
    for body in bodies:
        assert post(served["base"] + "/v1/images/generations", body)[0] == 200
    assert post(served["base"] + "/v1/images/generations", {"prompt": "a cat", "n": 0})[0] == 400

    def delta(samples, name, **labels):
        return total(samples, name, **labels) - total(before, name, **labels)

    samples = settled(lambda s: delta(s, "ray_omni_images_generated_total") >= 5
                      and delta(s, "ray_omni_errors_total", type="RequestError") >= 1
                      and delta(s, "ray_omni_stage_request_latency_seconds_count", stage="vae") >= 5
                      and delta(s, "ray_omni_dit_passes_total") >= 21)
    assert delta(samples, "ray_omni_images_generated_total", stage="coordinator") == 5
    assert delta(samples, "ray_omni_request_latency_seconds_count", stage="coordinator") == 4
    assert delta(samples, "ray_omni_errors_total", stage="coordinator", type="RequestError") == 1
    # 3 steps each: 2 images without CFG, 1 without, 2 with (two passes a step), of which one reuses its middle step
    assert delta(samples, "ray_omni_dit_passes_total", stage="dit", outcome="computed") == 6 + 3 + 6 + 4
    assert delta(samples, "ray_omni_dit_passes_total", stage="dit", outcome="reused") == 2
    for stage, calls in (("encoder", 4), ("dit", 5), ("vae", 5)):  # a request's prompt is encoded once
        assert delta(samples, "ray_omni_stage_request_latency_seconds_count", stage=stage) == calls, stage
        assert delta(samples, "ray_omni_step_latency_seconds_count", stage=stage) >= 1, stage
        assert ("ray_omni_queue_length" in {n for n, _ in samples}), stage
    # The encoder's prompt cache: "a bowl" and "dark" again (another seed) are found, not encoded again.
    cached = settled(lambda s: exported(s, "ray_omni_encoder_prompt_cache_bytes", "encoder"))
    again = {"prompt": "a bowl", "size": "64x64", "seed": 6, "num_inference_steps": 3, "negative_prompt": "dark"}
    assert post(served["base"] + "/v1/images/generations", again)[0] == 200
    hits = settled(lambda s: total(s, "ray_omni_encoder_prompt_cache_total", outcome="hit")
                   - total(cached, "ray_omni_encoder_prompt_cache_total", outcome="hit") >= 2)
    assert (total(hits, "ray_omni_encoder_prompt_cache_total", outcome="miss")
            == total(cached, "ray_omni_encoder_prompt_cache_total", outcome="miss"))
    assert total(hits, "ray_omni_encoder_prompt_cache_bytes", stage="encoder") > 0
    # The DiT ran 3 steps per request: at least 3 steps. While a request denoises, the batch gauge counts it (within
    # the preset's limit); a second after its last step, it reads 0 and the queue length is still exported.
    assert delta(samples, "ray_omni_step_latency_seconds_count", stage="dit") >= 3
    long = {"prompt": "a slow cat", "size": "64x64", "seed": 5, "num_inference_steps": 60}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(post, served["base"] + "/v1/images/generations", long)
        busy = settled(lambda s: total(s, "ray_omni_running_batch_size", stage="dit") >= 1)
        assert total(busy, "ray_omni_running_batch_size", stage="dit") <= 8
        assert running.result()[0] == 200
    idle = settled(lambda s: exported(s, "ray_omni_running_batch_size")
                   and total(s, "ray_omni_running_batch_size", stage="dit") == 0)
    assert exported(idle, "ray_omni_queue_length") and total(idle, "ray_omni_queue_length", stage="dit") == 0
    # The coordinator watches its event loop (a sample every 50 ms) and counts its process's CPU time.
    samples = settled(lambda s: total(s, "ray_omni_event_loop_stall_seconds_count", stage="coordinator") >= 10
                      and total(s, "ray_omni_process_cpu_seconds_total", stage="coordinator") > 0)
    assert total(samples, "ray_omni_event_loop_stall_seconds_bucket", stage="coordinator", le="+Inf") >= 10
    assert total(samples, "ray_omni_event_loop_cpu_wait_seconds_count", stage="coordinator") >= 10


def test_a_request_id_flows_through_every_stage_and_back(served):
    import glob
    import uuid

    request_id = f"trace-{uuid.uuid4().hex[:12]}"
    body = json.dumps({"prompt": "a red cat", "size": "64x64", "seed": 1, "num_inference_steps": 2}).encode()
    request = urllib.request.Request(served["base"] + "/v1/images/generations", body,
                                     {"Content-Type": "application/json", "x-request-id": request_id})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.headers["x-request-id"] == request_id
    logs = "/tmp/ray/session_latest/logs/serve"
    for stage in ("Coordinator", "Encoder", "DiT", "VAE"):
        deadline = time.monotonic() + 20
        while not any(request_id in open(path).read() for path in glob.glob(f"{logs}/replica_omni-ray_{stage}_*.log")):
            assert time.monotonic() < deadline, f"{request_id} not in the {stage} replica's log"
            time.sleep(0.5)


def stream_events(served, body, headers=None) -> list[dict]:
    data = json.dumps({**body, "stream": True}).encode()
    request = urllib.request.Request(served["base"] + "/v1/images/generations", data,
                                     {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        return [json.loads(line[len(b"data: "):]) for line in response if line.startswith(b"data: ")]


def test_streaming_sends_one_progress_event_per_step_then_the_same_image(served):
    body = {"prompt": "a lighthouse", "size": "64x64", "seed": 5, "num_inference_steps": 4,
            "negative_prompt": "blurry"}
    assert [e["type"] for e in stream_events(served, body)] == ["image_generation.completed"]  # OpenAI's events only
    events = stream_events(served, {**body, "progress": True})
    assert [e["type"] for e in events] == ["image_generation.progress"] * 4 + ["image_generation.completed"]
    assert [(e["index"], e["step"], e["total_steps"]) for e in events[:4]] == [(0, s, 4) for s in range(1, 5)]
    status, plain = post(served["base"] + "/v1/images/generations", {**body, "timings": True})
    conforms("ImagesResponse", plain)
    assert status == 200
    assert events[-1]["b64_json"] == plain["data"][0]["b64_json"]  # byte-identical PNG
    assert set(plain["data"][0]["timings_ms"]) == {"encoder", "dit", "vae"}
    assert plain["data"][0]["dit_passes"] == {"computed": 8, "reused": 0}  # 4 steps, two CFG passes each
    assert all(ms > 0 for ms in plain["data"][0]["timings_ms"].values())
    timings, queued = plain["data"][0]["timings_ms"], plain["data"][0]["queued_ms"]
    assert set(queued) == set(timings) and all(0 <= queued[stage] < timings[stage] for stage in timings)
    assert events[-1]["size"] == "auto" and events[-1]["output_format"] == "png"  # 64x64 is not one of OpenAI's
    conforms("ImageGenStreamEvent", events[-1])


def test_streaming_n_images_and_the_clients_progress_bar(served, capsys):
    from omni_ray.api.client import Client

    events = stream_events(served, {"prompt": "a cup", "size": "64x64", "seed": 9, "num_inference_steps": 3, "n": 2,
                                    "progress": True})
    for index in (0, 1):
        mine = [e for e in events if e["index"] == index]
        assert [e.get("step") for e in mine] == [1, 2, 3, None] and mine[-1]["type"] == "image_generation.completed"
    client = Client.http(served["base"])
    with_bar = client.generate("a cup", size="64x64", seed=9, num_inference_steps=3, n=2, progress=True)
    without = client.generate("a cup", size="64x64", seed=9, num_inference_steps=3, n=2)
    assert [np.asarray(i).tolist() for i in with_bar] == [np.asarray(i).tolist() for i in without]
    assert "6/6" in capsys.readouterr().err  # tqdm drew the bar to the end


def test_a_text_to_image_app_inpaints_an_image_where_the_mask_is_transparent(served, tiny_dir):
    """/v1/images/edits with an image and OpenAI's mask on a text-to-image preset: diffusers'
    QwenImageInpaintPipeline (the image stretched to the output size), through the official client; without the
    mask the route is refused naming `image`."""
    import openai
    from diffusers import QwenImageInpaintPipeline
    from PIL import Image

    from testing.reference import openai_mask, reference_masked, source_image
    from testing.serving import file_bytes

    client = openai.OpenAI(base_url=served["base"] + "/v1", api_key="unused")
    source = source_image(150, 120, seed=3)
    repaint = np.zeros((120, 150), bool)
    repaint[30:90, 40:120] = True
    events = list(client.images.edit(image=("in.png", file_bytes(source), "image/png"), stream=True,
                                     mask=("m.png", openai_mask(repaint), "image/png"), prompt="a cat", size="64x96",
                                     extra_body={"seed": 2, "num_inference_steps": 5, "strength": 0.8}))
    assert [type(event).__name__ for event in events] == ["ImageEditCompletedEvent"]
    expected = reference_masked(QwenImageInpaintPipeline.from_pretrained(tiny_dir), source,
                                Image.fromarray(repaint.astype(np.uint8) * 255), seed=2, prompt="a cat",
                                num_inference_steps=5, strength=0.8, height=96, width=64)
    assert within_one_level(png(events[-1].b64_json), expected)
    with pytest.raises(openai.BadRequestError) as info:
        client.images.edit(image=("in.png", file_bytes(source), "image/png"), prompt="a cat")
    assert info.value.param == "image" and "mask" in info.value.message


def test_48_streams_16_at_a_time_each_equal_to_its_plain_image(served):
    """Streams under concurrency lose nothing: the latents a stream hands on are owned by the coordinator. Each
    image equals the plain request's within one level: both ran in step batches of whatever else was in flight, and
    a batch's padding moves float sums in the last bits (see test_dit_engine's TOLERANCE)."""
    bodies = [{"prompt": f"a harbour at dawn, take {i}", "size": "64x64", "seed": 300 + i,
               "num_inference_steps": 3, "n": 1 + i % 2} for i in range(48)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        streams = list(pool.map(lambda body: stream_events(served, body), bodies))
        plains = list(pool.map(lambda body: post(served["base"] + "/v1/images/generations", body), bodies))
    for body, events, (status, plain) in zip(bodies, streams, plains):
        assert status == 200, plain
        assert not [e for e in events if e["type"] == "error"], events[-1]
        completed = sorted((e for e in events if e["type"] == "image_generation.completed"), key=lambda e: e["index"])
        assert [e["index"] for e in completed] == list(range(body["n"]))
        for event, item in zip(completed, plain["data"]):
            assert within_one_level(png(event["b64_json"]), png(item["b64_json"]))


def replica_names(served) -> dict[str, str]:
    import ray

    return {name.split("#")[1]: name for name in (a["name"] for a in ray.util.list_named_actors(all_namespaces=True))
            if name.startswith("SERVE_REPLICA::omni-ray#")}


def sse_outcome(served, body) -> tuple[int, list[dict]]:
    try:
        return 200, stream_events(served, body)
    except urllib.error.HTTPError as err:
        return err.code, [json.loads(err.read())]


# What the object store may hold past its baseline after the mixed load: Ray Serve's own objects. The requests' objects
# at 64x64 are under Ray's 100 KB inlining limit and never reach the store; what was seen there after the load, in 1
# CI run in 5, was one object of 111 KB and a few small ones (150 KB in all), the large one a local reference of a Serve
# worker process from a task that had finished.
SERVE_OWN_OBJECTS = 1 << 20


def post_traced(url: str, body: dict, request_id: str) -> int:
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


def test_each_request_is_one_trace_across_the_coordinator_and_the_stage_replicas(served):
    local, spans_dir = served["local"], served["spans"]
    for request_id in ("traced-1", "traced-2"):
        body = {"prompt": "a lighthouse", "size": "64x64", "n": 2, "num_inference_steps": 3, "user": "team-a"}
        assert post_traced(local.base_url + "/v1/images/generations", body, request_id) == 200
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


def test_mixed_load_survives_the_death_of_each_stage_replica(served, reference):
    """300 requests, 16 at a time: text to image (n 1-3), streamed, invalid and cancelled by the client, while the
    encoder, the DiT and the VAE replica are each killed once. No valid request fails: each lost stage call is issued
    again. Every invalid one is a 400 naming its field, nothing hangs, the object store returns to its baseline
    (give or take Serve's own bookkeeping)."""
    import ray

    store_bytes = served["local"].store_bytes

    connect_ray(served["address"], namespace="serve")
    try:
        baseline = store_bytes()
        invalid = [b for b in BAD_REQUESTS if isinstance(b[0], dict)]
        finished = []

        def one(i):
            start = time.monotonic()
            if i % 5 == 0:
                body, status, param = invalid[i // 5 % len(invalid)]
                got, response = post(served["base"] + "/v1/images/generations", body)
                return "invalid", (got, response["error"]["param"]) == (status, param), time.monotonic() - start
            body = {"prompt": f"a mountain lake, variation {i % 7}", "size": "64x64", "seed": i, "n": 1 + i % 3,
                    "num_inference_steps": 3, **({"negative_prompt": "blurry"} if i % 2 else {})}
            if i % 10 == 3:
                status = disconnect_after(served, {**body, "num_inference_steps": 200}, 0.3)
                return "cancelled", status, time.monotonic() - start
            if i % 4 == 1:
                outcome = ("streamed", (body, *sse_outcome(served, body)))
            else:
                outcome = ("ok", (body, *post(served["base"] + "/v1/images/generations", body, timeout=300)))
            finished.append(i)
            return (*outcome, time.monotonic() - start)

        def killer():
            """Kills each stage's replica once, a third of the way apart, while requests are in flight."""
            for stage, after in (("Encoder", 40), ("DiT", 100), ("VAE", 160)):
                while len(finished) < after:
                    time.sleep(0.05)
                ray.kill(ray.get_actor(replica_names(served)[stage], namespace="serve"), no_restart=True)
                killed.append(stage)
                if stage == "Encoder":  # vLLM takes seconds to start: /health says which stage it waits for
                    unready.append(wait_for_health(served, lambda code, body: code == 503, timeout_s=30))

        def wait_for_health(served, ready, timeout_s):
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    with urllib.request.urlopen(served["base"] + "/health", timeout=10) as response:
                        code, body = response.status, json.loads(response.read())
                except urllib.error.HTTPError as err:
                    code, body = err.code, json.loads(err.read())
                if ready(code, body) or time.monotonic() > deadline:
                    return code, body
                time.sleep(0.1)

        killed, unready = [], []
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(17) as pool:
            kills = pool.submit(killer)
            outcomes = list(pool.map(one, range(300)))
            kills.result(timeout=60)
        elapsed = time.monotonic() - start
        assert killed == ["Encoder", "DiT", "VAE"]
        assert unready == [(503, {"status": "unavailable", "waiting_for": ["Encoder"]})]
        assert wait_for_health(served, lambda code, body: code == 200, timeout_s=60) == (200, {"status": "ok"})
        latencies = sorted(seconds for kind, _, seconds in outcomes if kind in ("ok", "streamed"))
        print(f"\nmixed load with three replica kills: 300 requests in {elapsed:.1f} s; valid ones p50 "
              f"{latencies[len(latencies) // 2]:.2f} s, max {latencies[-1]:.2f} s")
        kinds = [kind for kind, _, _ in outcomes]
        assert (kinds.count("invalid"), kinds.count("cancelled")) == (60, 30)
        assert all(ok for kind, ok, _ in outcomes if kind == "invalid")
        assert all(status is None for kind, status, _ in outcomes if kind == "cancelled"), outcomes
        for kind, (body, status, response), _ in (o for o in outcomes if o[0] in ("ok", "streamed")):
            assert status == 200, (kind, body, response)
            if kind == "streamed":
                errors = [e for e in response if e["type"] == "error"]
                assert not errors, (body, errors)
                completed = sorted((e for e in response if e["type"] == "image_generation.completed"),
                                   key=lambda e: e["index"])
                images = [e["b64_json"] for e in completed]
            else:
                images = [item["b64_json"] for item in response["data"]]
            assert len(images) == body["n"]
            if body["seed"] % 30 == 1:  # a sample, pixel-checked against diffusers
                assert within_one_level(png(images[0]), expected(reference, body["prompt"], body["seed"], 64, 64, 3,
                                                                 body.get("negative_prompt")))
        assert max(seconds for _, _, seconds in outcomes) < 300  # nothing hung
        deadline = time.monotonic() + 30
        while (used := store_bytes()) > baseline and time.monotonic() < deadline:
            time.sleep(0.5)
        from ray._private.internal_api import memory_summary

        summary = memory_summary(served["address"], line_wrap=False, stats_only=False)
        large = [line for line in summary.splitlines() if re.search(r"\| +\d{6,}\.\d B |\| +[\d.]+ (KB|MB) ", line)]
        assert used <= baseline + SERVE_OWN_OBJECTS, (used - baseline, "\n".join(large[:40]), summary[-1500:])
    finally:
        ray.shutdown()  # a driver still connected would be ended by the fixture's `ray stop --force`
    stats = stage_stats(served)
    assert all(s["running"] == 0 for s in stats.values()), stats


def test_a_redeploy_that_restarts_the_dit_under_load_loses_no_request(served, tiny_dir, tmp_path):
    """The app redeployed with another DiT batch limit while requests flow: Serve starts new replicas and the old
    ones finish what they hold; a call that still lands on a replica going away is issued again."""
    import ray
    import yaml
    from ray import serve

    from deployments.app import build_app

    preset = yaml.safe_load((REPO / "stage_configs/qwen_image_tiny.yaml").read_text())
    preset["dit"]["max_batch_size"] = 4
    preset.setdefault("requests", {})["timeout_s"] = 3600.0  # as the served fixture's: new replicas' first steps
    # taught their step fit a rate that put 64x64 requests past 600 s, and admission refused them (503)
    (tmp_path / "preset.yaml").write_text(yaml.safe_dump(preset))
    finished, results = [], []
    numbers, redeployed = itertools.count(), threading.Event()

    def one(i):
        body = {"prompt": f"a field of tulips, take {i}", "size": "64x64", "seed": i, "num_inference_steps": 4,
                "n": 1 + i % 2}
        outcome = sse_outcome(served, body) if i % 3 == 0 else post(served["base"] + "/v1/images/generations", body)
        finished.append(i)
        return body, outcome

    def client():
        """One of eight clients sending one request after another until three of its own began after the redeploy
        returned: requests flow before, through and after the handover however fast the machine is."""
        after = 0
        while after < 3:
            after += redeployed.is_set()
            results.append(one(next(numbers)))

    connect_ray(served["address"], namespace="serve")
    try:
        dit_before = replica_names(served)["DiT"]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            clients = [pool.submit(client) for _ in range(8)]
            while len(finished) < 10:
                time.sleep(0.05)
            try:
                serve.run(build_app({"stage_config": str(tmp_path / "preset.yaml"), "model": str(tiny_dir)}),
                          name="omni-ray", route_prefix="/")
                redeployed_at = len(finished)
            finally:
                redeployed.set()  # the clients stop even if the redeploy failed
            for future in clients:
                future.result(timeout=300)
        assert replica_names(served)["DiT"] != dit_before  # the DiT was restarted
    finally:
        ray.shutdown()
    assert len(finished) >= redeployed_at + 3 * 8  # requests still flowed when the new replicas took over
    for body, (status, response) in results:
        assert status == 200, (body, response)
        if isinstance(response, list):  # streamed
            assert not [e for e in response if e["type"] == "error"], response[-1]
            assert sum(e["type"] == "image_generation.completed" for e in response) == body["n"]
        else:
            assert len(response["data"]) == body["n"]


def test_sigterm_stops_serve_run_within_10_s_and_leaves_no_vllm_file(served):
    """Last in this module: it stops the app, as Kubernetes stops a pod."""
    import signal

    assert_stops_within_10_s_leaving_no_vllm_file(served, signal.SIGTERM)

