"""The page on Qwen-Image-Layered, served: `serve run` on the tiny layered preset, a headless Chromium uploading an
RGBA image, told of layers out of the preset's bounds before sending and shown the server's 400 beside the field,
then decomposing the image with an empty prompt into its layers view (each layer over a checkerboard, their
composite, the caption that stood for the prompt)."""

import base64
import io

import numpy as np
import pytest
import yaml
from conftest import REPO
from PIL import Image

from testing.local_serve import LocalServe
from testing.reference import source_image

PRESET = REPO / "stage_configs" / "qwen_image_layered_tiny.yaml"

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def served(layered_dir):
    with LocalServe(REPO / "config.yaml", model=str(layered_dir), preset=yaml.safe_load(PRESET.read_text())) as local:
        yield local.base_url


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
        page.goto(served + "/")
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
