"""Qwen-Image-Layered served: `serve run config.layered.yaml` on the tiny layered checkpoint, the official openai
client decomposing an RGBA image with a prompt and with an empty one (the encoder's caption standing for it, and
coming from its cache for a repeated image), 2 and 4 layers, CFG off and on, n=2, JSON and streamed (one completed
event per layer), every layer within one level of diffusers' QwenImageLayeredPipeline; bad input a 400 naming its
field; 16 concurrent decompositions and a client that leaves. Last, on the same app, the page in a headless Chromium:
an uploaded RGBA image, layers out of the preset's bounds refused beside the field before sending and by the server's
400, then decomposed with an empty prompt into its layers view (each layer over a checkerboard, their composite, the
caption that stood for the prompt)."""

import base64
import concurrent.futures
import http.client
import io
import time

import numpy as np
import openai
import pytest
import yaml
from conftest import REPO
from PIL import Image

from omni_ray.config import load_config
from omni_ray.families.qwen_image_layered.facts import working_size
from testing.local_serve import LocalServe
from testing.openai_api import conforms
from testing.reference import reference_layers, rgba_source, source_image
from testing.serving import file_bytes, png, stage_stats, within_one_level

pytestmark = pytest.mark.serve

PRESET = REPO / "stage_configs/qwen_image_layered_tiny.yaml"
SOURCE = rgba_source(72, 40, seed=3)
STEPS = 3


@pytest.fixture(scope="module")
def served(layered_dir):
    with LocalServe(REPO / "config.layered.yaml", model=str(layered_dir)) as local:
        yield {"base": local.base_url, "address": local.address, "metrics": local.metrics_url}


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served["base"] + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def config(layered_dir):
    return load_config(PRESET, model=str(layered_dir))


@pytest.fixture(scope="module")
def reference(layered_dir):
    from diffusers import QwenImageLayeredPipeline

    pipe = QwenImageLayeredPipeline.from_pretrained(layered_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def upload(image=SOURCE):
    return ("layers.png", file_bytes(image), "image/png")


def expected_layers(reference, config, seed, prompt, layers, negative=None):
    return reference_layers(reference, SOURCE, config.edit.resolutions[0], seed, config.encoder.caption_max_tokens,
                            prompt=prompt, layers=layers, negative_prompt=negative, num_inference_steps=STEPS,
                            use_en_prompt=True)


@pytest.mark.parametrize(("prompt", "layers", "negative"), [("a red kite over a beach", 2, None), ("", 4, " ")],
                         ids=["prompt, 2 layers, CFG off", "captioned, 4 layers, CFG on"])
def test_the_official_client_decomposes_an_image_as_diffusers_does(client, reference, config, prompt, layers,
                                                                   negative):
    extra = {"seed": 11, "layers": layers, "num_inference_steps": STEPS,
             **({"negative_prompt": negative} if negative else {})}
    result = client.images.edit(image=upload(), prompt=prompt, n=2, extra_body=extra)
    conforms("ImagesResponse", result.to_dict())
    assert result.background == "transparent" and len(result.data) == 2 * layers
    for i in range(2):
        expected, caption = expected_layers(reference, config, 11 + i, prompt, layers, negative)
        for k in range(layers):
            item = result.data[i * layers + k]
            pixels = png(item.b64_json)
            assert pixels.shape == (*working_size(SOURCE.height, SOURCE.width, config.edit.resolutions[0]), 4)
            assert within_one_level(pixels, expected[k]), (i, k)
            assert item.revised_prompt == caption  # None with a prompt


def test_a_repeated_image_is_captioned_from_the_encoders_cache(served, client):
    image = upload(rgba_source(48, 64, seed=8))
    first = client.images.edit(image=image, prompt="", extra_body={"layers": 2, "num_inference_steps": 1})
    before = stage_stats(served)["Encoder"]
    again = client.images.edit(image=image, prompt="", extra_body={"layers": 2, "num_inference_steps": 1,
                                                                   "seed": 4})
    after = stage_stats(served)["Encoder"]
    assert again.data[0].revised_prompt == first.data[0].revised_prompt
    assert after["captioned"] == before["captioned"] and after["caption_hits"] == before["caption_hits"] + 1


def test_the_official_client_streams_one_completed_event_per_layer(client, reference, config):
    events = list(client.images.edit(image=upload(), prompt="", stream=True, partial_images=1,
                                     extra_body={"seed": 11, "layers": 2, "num_inference_steps": STEPS}))
    assert [type(event).__name__ for event in events] == ["ImageEditPartialImageEvent"] + \
        ["ImageEditCompletedEvent"] * 2
    expected, caption = expected_layers(reference, config, 11, "", 2)
    for k, event in enumerate(events[1:]):
        data = event.to_dict()
        assert (data["index"], data["layer"], data["revised_prompt"]) == (k, k, caption)
        assert event.background == "transparent" and within_one_level(png(event.b64_json), expected[k])


@pytest.mark.parametrize(("fields", "image", "param"), [
    ({"layers": "9"}, None, "layers"),
    ({"layers": "1"}, None, "layers"),
    ({"resolution": "1024"}, None, "resolution"),
    ({}, ("bad.png", b"not a png", "image/png"), "image"),
])
def test_bad_input_is_a_400_naming_the_field(served, fields, image, param):
    import requests

    response = requests.post(served["base"] + "/v1/images/edits", data={"prompt": "a cat", **fields},
                             files={"image": image or upload()}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_16_concurrent_decompositions_and_a_client_that_leaves(served, client):
    """Under load (prompts and captions, 2 to 4 layers, CFG on and off, sent at once) every request is answered
    with its layers, the DiT batches rows of one layer count, and a client that hung up mid-run is aborted."""

    def decompose(i):
        extra = {"seed": i, "layers": 2 + i % 3, "num_inference_steps": 4,
                 **({"negative_prompt": "dark", "true_cfg_scale": 2.0} if i % 2 else {})}
        result = client.images.edit(image=upload(rgba_source(64, 48, seed=i % 4)),
                                    prompt="" if i % 4 == 0 else f"a poster, take {i}", extra_body=extra)
        return len(result.data) == 2 + i % 3 and all(item.b64_json for item in result.data)

    def leave():
        host, port = served["base"].removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=1.5)
        boundary = "omni-ray-layers"
        fields = {"prompt": "a very long request", "layers": "8", "num_inference_steps": "200"}
        parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
                 for name, value in fields.items()]
        image = f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n'
        parts.append(f"{image}Content-Type: image/png\r\n\r\n".encode() + file_bytes(SOURCE)
                     + f"\r\n--{boundary}--\r\n".encode())
        try:
            connection.request("POST", "/v1/images/edits", b"".join(parts),
                               {"Content-Type": f"multipart/form-data; boundary={boundary}"})
            return connection.getresponse().status
        except TimeoutError:
            return None
        finally:
            connection.close()

    before = stage_stats(served)["DiT"]
    with concurrent.futures.ThreadPoolExecutor(17) as pool:
        left = pool.submit(leave)
        answers = list(pool.map(decompose, range(16)))
        assert left.result() is None
    assert all(answers)
    deadline = time.monotonic() + 30
    while (dit := stage_stats(served)["DiT"])["running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert dit["running"] == 0 and dit["aborted"] == before["aborted"] + 1
    batched = {size: count - before["batch_sizes"].get(size, 0) for size, count in dit["batch_sizes"].items()}
    assert any(int(size) > 1 and count > 0 for size, count in batched.items()), dit["batch_sizes"]


def rgba_image(width: int, height: int) -> Image.Image:
    """A photo-like image whose alpha falls from opaque at the left to clear at the right."""
    alpha = np.broadcast_to(np.linspace(255, 0, width).astype(np.uint8), (height, width))[..., None]
    return Image.fromarray(np.concatenate([np.asarray(source_image(width, height, seed=5)), alpha], axis=-1))


def over(layers: list[np.ndarray]) -> np.ndarray:
    """The layers drawn over one another, bottom first (PIL's alpha_composite: a canvas's source-over)."""
    canvas = Image.new("RGBA", layers[0].shape[1::-1])
    for layer in layers:
        canvas = Image.alpha_composite(canvas, Image.fromarray(layer))
    return np.asarray(canvas)


def premultiplied(pixels: np.ndarray) -> np.ndarray:
    """Colour times alpha, as a canvas keeps it (a low alpha's colour does not survive it)."""
    return np.concatenate([pixels[..., :3].astype(float) * pixels[..., 3:] / 255, pixels[..., 3:]], axis=-1)


def test_the_page_decomposes_an_uploaded_image_into_layers(served, tmp_path):
    """In a headless Chromium on the tiny layered preset: the Layers fields show (the preset's buckets, no size);
    9 layers are refused beside the field before sending and, the client's check off, by the server's 400 beside it;
    2 layers of an RGBA image with an empty prompt come back as 2 layer cards labelled bottom to top, a composite
    drawn bottom first (the layers over one another) and the server's caption."""
    from testing.browser import browser_page, fits_a_phone

    rgba_image(96, 64).save(tmp_path / "rgba.png")
    buckets = yaml.safe_load(PRESET.read_text())["edit"]["resolutions"]
    with browser_page() as page:
        sent = []
        page.on("request", lambda request: sent.append(request.url) if "/v1/" in request.url else None)
        page.goto(served["base"] + "/")
        assert page.is_visible("#layers") and not page.is_visible("#size")
        assert page.input_value("#layers") == "4"
        assert page.eval_on_selector("#resolution", "select => [...select.options].map(o => +o.value)") == buckets
        page.set_input_files("#image", str(tmp_path / "rgba.png"))
        page.wait_for_selector("#image-preview", state="visible")

        page.fill("#layers", "9")
        page.click("#generate")
        page.wait_for_selector('[data-field="layers"] .error:not(:empty)')
        assert "from 2 to 8" in page.text_content('[data-field="layers"] .error')
        assert sent == []  # said on the page, not sent
        page.eval_on_selector("#layers", "input => input.removeAttribute('max')")  # the client's check off
        page.click("#generate")
        page.wait_for_function("document.querySelector('[data-field=\"layers\"] .error').textContent"
                               ".startsWith('layers:')", timeout=60_000)  # the server's 400, beside the field
        assert len(sent) == 1

        page.fill("#layers", "2")
        page.fill("#num_inference_steps", "2")
        page.fill("#seed", "7")
        assert page.input_value("#prompt") == ""  # the server captions the image
        page.click("#generate")
        page.wait_for_function("document.querySelector('.card .status')?.textContent.startsWith('done')",
                               timeout=180_000)
        assert page.text_content('[data-field="layers"] .error') == ""
        labels = page.eval_on_selector_all(".card .layers figcaption", "labels => labels.map(l => l.textContent)")
        assert labels == ["Composite", "Layer 1 (bottom)", "Layer 2 (top)"]
        caption = page.text_content(".card .caption")
        assert page.is_visible(".card .caption") and caption.split(": ", 1)[1].strip(), caption
        layers = [np.asarray(Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))))
                  for src in page.eval_on_selector_all(".card .layer img", "images => images.map(i => i.src)")]
        assert [layer.shape for layer in layers] == [layers[0].shape] * 2 and layers[0].shape[2] == 4
        composite = np.array(page.eval_on_selector(".card .composite canvas", """canvas => Array.from(
            canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data)"""), np.uint8)
        composite = composite.reshape(layers[0].shape)
        bottom_first, top_first = (np.abs(premultiplied(composite) - premultiplied(over(order))).max()
                                   for order in (layers, layers[::-1]))
        # A canvas keeps 8-bit premultiplied colour, rounded at each draw: a few levels from PIL's exact compositing.
        assert bottom_first <= 4 and bottom_first < top_first, (bottom_first, top_first)
        page.screenshot(path=tmp_path / "page-layers.png", full_page=True)
        page.set_viewport_size({"width": 390, "height": 844})
        assert fits_a_phone(page)
