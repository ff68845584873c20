"""Qwen-Image-Layered's captions in the encoder stage: vLLM's generating engine, on the pooling engine's weights,
writes the tokens ``QwenImageLayeredPipeline.get_image_caption`` generates (transformers' ``generate``, greedy), for
RGBA and RGB images in both languages; the caption cache, concurrent captions, aborts, and the transformers runner.

The tiny edit checkpoint stands in for Qwen-Image-Layered's text encoder (the same Qwen2.5-VL with its vision tower
and processor); its config is the edit preset's with ``family: qwen-image-layered``, as the layered preset's will be.
"""

import types

import numpy as np
import pytest
import torch
from conftest import REPO, encode_all
from diffusers import QwenImageLayeredPipeline
from PIL import Image
from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

from omni_ray.config import load_config
from omni_ray.engine.builders import build_encoder_core
from omni_ray.families import family_of
from omni_ray.families.qwen_image_layered import facts as qwen_image_layered
from omni_ray.records import Caption, CaptionRequest, EncodeRequest
from omni_ray.runners.simulated import SimulatedCaptioner
from omni_ray.runners.transformers_encoder import TransformersCaptioner

pytestmark = pytest.mark.vllm

MAX_TOKENS = 64  # the pipeline's 512, cut for the test's time: the tiny model never writes its end-of-text token
CAPTION_PIXELS = 4 * 128 * 128  # the captioner's image bound on the CPU (the layered preset's is 2 x 1024 x 1024)


def images() -> dict[str, np.ndarray]:
    """Working-size images as the pipeline hands them to the processor: an RGBA one with transparent pixels (whose
    colour Qwen2.5-VL's processor still reads: it drops the alpha), an RGB one of another size."""
    rng = np.random.default_rng(0)
    rgba = rng.integers(0, 256, (96, 128, 4), dtype=np.uint8)
    rgba[..., 3] = np.where(rng.random((96, 128)) < 0.5, 0, 255)
    return {"rgba": rgba, "rgb": rng.integers(0, 256, (128, 96, 3), dtype=np.uint8)}


@pytest.fixture(scope="module")
def config(edit_dir):
    config = load_config(REPO / "stage_configs/qwen_image_edit_tiny.yaml", model=str(edit_dir))
    encoder = config.encoder.model_copy(update={"caption_max_tokens": MAX_TOKENS})
    return config.model_copy(update={"family": qwen_image_layered.FAMILY, "encoder": encoder})


@pytest.fixture(scope="module")
def core(config):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(family_of(config), "caption_image_pixels", CAPTION_PIXELS)
        core = build_encoder_core(config)
    yield core
    core.shutdown()


@pytest.fixture(scope="module")
def reference(edit_dir):
    """The pipeline's ``get_image_caption`` on the checkpoint's processor and Qwen2.5-VL, ``max_new_tokens`` cut to
    ``MAX_TOKENS``: (text, new token ids) of a PIL image."""
    processor = AutoProcessor.from_pretrained(edit_dir, subfolder="processor")
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(edit_dir, subfolder="text_encoder").eval()
    templates = QwenImageLayeredPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, processor=None,
                                         transformer=None)
    generated = {}

    def generate(**inputs):
        inputs["max_new_tokens"] = MAX_TOKENS
        with torch.no_grad():
            out = model.generate(**inputs)
        generated["ids"] = out[0, inputs["input_ids"].shape[1]:].tolist()
        return out

    pipeline = types.SimpleNamespace(vl_processor=processor, text_encoder=types.SimpleNamespace(generate=generate),
                                     image_caption_prompt_en=templates.image_caption_prompt_en,
                                     image_caption_prompt_cn=templates.image_caption_prompt_cn)

    def caption(image: np.ndarray, language: str) -> tuple[str, list[int]]:
        text = QwenImageLayeredPipeline.get_image_caption(pipeline, Image.fromarray(image),
                                                          use_en_prompt=language == "en", device="cpu")
        return text, generated["ids"]

    caption.model = model
    return caption


def captions(core, requests) -> dict[str, Caption]:
    return encode_all(core, requests)[0]


def test_shares_the_pooling_engine_s_weights(core, reference):
    """The generating model holds the pooling model's parameters themselves, and its own head is the checkpoint's."""
    captioner = core.encoder.captioner
    pooling = dict(core.encoder.core.model_executor.driver_worker.worker.model_runner.model.named_parameters())
    generating = dict(captioner.model.named_parameters())
    assert set(generating) - set(pooling) == {"language_model.lm_head.weight"}
    assert all(generating[name] is parameter for name, parameter in pooling.items())
    head, expected = generating["language_model.lm_head.weight"], reference.model.lm_head.weight
    assert torch.equal(head[: len(expected)], expected) and not head[len(expected):].any()  # vLLM pads the vocab


@pytest.mark.parametrize("language", ["en", "zh"])
def test_captions_are_the_pipeline_s(core, reference, language):
    pictures = images()
    requests = [CaptionRequest(f"{language}-{name}", image, language) for name, image in pictures.items()]
    results = captions(core, requests)
    for name, image in pictures.items():
        text, token_ids = reference(image, language)
        got = results[f"{language}-{name}"]
        assert len(token_ids) == MAX_TOKENS and list(got.token_ids) == token_ids, name
        assert got.text == text and text and not got.cached


def test_a_repeated_image_s_caption_comes_from_the_cache(core):
    image = images()["rgba"].copy()
    image[0, 0, 0] ^= 1  # captioned by no other test
    (first,) = captions(core, [CaptionRequest("first", image, "en")]).values()
    before = core.stats()
    core.add_request(CaptionRequest("again", image.copy(), "en"))
    assert not core.captioning and not core.encoder.captioner.generated  # no new vLLM sequence
    (again,) = captions(core, []).values()  # served by the step after it was added
    after = core.stats()
    assert again.cached and not first.cached and again.token_ids == first.token_ids and again.text == first.text
    assert (after.captioned, after.caption_hits) == (before.captioned, before.caption_hits + 1)
    (other,) = captions(core, [CaptionRequest("zh", image, "zh")]).values()  # the language is in the key
    assert not other.cached and core.stats().captioned == after.captioned + 1


def test_concurrent_captions_and_one_of_the_same_image(core, reference):
    rng = np.random.default_rng(7)
    first, second = (rng.integers(0, 256, (64, 96, 4), dtype=np.uint8) for _ in range(2))
    before = core.stats().captioned
    results, steps = encode_all(core, [CaptionRequest("a", first), CaptionRequest("b", second),
                                       CaptionRequest("a-again", first.copy())])
    assert core.stats().captioned == before + 2  # the third waited for the first's caption
    assert steps == MAX_TOKENS  # the two ran together, a token each per step
    assert results["a"].token_ids == results["a-again"].token_ids != results["b"].token_ids
    assert list(results["b"].token_ids) == reference(second, "en")[1]


def test_abort(core):
    image = np.full((64, 64, 3), 9, np.uint8)
    core.add_request(CaptionRequest("gone", image))
    core.add_request(CaptionRequest("stays", image.copy()))
    core.abort_requests(["gone"])
    assert len(core.captioning) == 1  # the one sequence still has a reader
    core.step()
    core.abort_requests(["stays"])
    assert not core.captioning and not core.encoder.captioner.generated and not core.has_unfinished_requests()
    assert core.step() == []
    (result,) = captions(core, [CaptionRequest("after", image)]).values()  # the engine runs on
    assert len(result.token_ids) == MAX_TOKENS and not result.cached


def test_prompts_still_encode_beside_captions(core, reference, config):
    """The pooling engine (with the vision tower it loads for the captioner) gives a text-only prompt the embeddings
    transformers' Qwen2.5-VL gives it, after captions ran on the shared modules, and in a step with a caption."""
    core.add_request(CaptionRequest("beside", images()["rgb"][:64, :64].copy()))
    results = captions(core, [EncodeRequest("text", "a red cat", None)])
    assert isinstance(results["beside"], Caption)
    token_ids = core.tokenizer.tokenize("a red cat")
    with torch.no_grad():
        hidden = reference.model(input_ids=torch.tensor([token_ids]), output_hidden_states=True).hidden_states[-1][0]
    expected = hidden[core.tokenizer.template.drop:]
    got = results["text"].prompt.embeds
    assert got.shape == expected.shape and (got - expected).abs().max().item() < 1e-4


def test_the_transformers_runner_writes_the_same_captions(config, reference):
    core = build_encoder_core(config.model_copy(update={"encoder": config.encoder.model_copy(
        update={"runner": "transformers"})}))
    assert isinstance(core.captioner, TransformersCaptioner)
    pictures = images()
    results = captions(core, [CaptionRequest(name, image, "zh") for name, image in pictures.items()])
    for name, image in pictures.items():
        text, token_ids = reference(image, "zh")
        assert list(results[name].token_ids) == token_ids and results[name].text == text


def test_simulated_captions_are_a_function_of_the_image(config):
    core = build_encoder_core(config.model_copy(update={"encoder": config.encoder.model_copy(
        update={"runner": "simulated"})}))
    assert isinstance(core.captioner, SimulatedCaptioner)
    first, second = images().values()
    results = captions(core, [CaptionRequest("a", first), CaptionRequest("b", second),
                              CaptionRequest("c", first.copy(), "zh")])
    assert results["a"].token_ids == results["c"].token_ids != results["b"].token_ids and results["a"].text
    (again,) = captions(core, [CaptionRequest("again", first.copy())]).values()
    assert again.cached and again.token_ids == results["a"].token_ids


def test_a_preset_without_captions_refuses_them(edit_dir):
    config = load_config(REPO / "stage_configs/qwen_image_edit_tiny.yaml", model=str(edit_dir))
    core = build_encoder_core(config.model_copy(update={"encoder": config.encoder.model_copy(
        update={"runner": "simulated"})}))
    with pytest.raises(Exception, match="writes no captions"):
        core.add_request(CaptionRequest("no", images()["rgb"]))
    assert not core.has_unfinished_requests()
