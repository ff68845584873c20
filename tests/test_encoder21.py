"""Qwen-Image 2.1's encoder: Qwen3-VL under vLLM's EngineCore (and transformers as the fallback) gives what
``QwenImage21Pipeline.encode_prompt`` gives: the last decoder layer's states before the final norm, prompt and
condition images in one sequence, the system turn dropped, and the image slots (its ``image_pad_mask``)."""

import numpy as np
import pytest
import torch
from conftest import REPO, encode_all
from diffusers import QwenImage21Pipeline
from PIL import Image

from omni_ray.config import load_config
from omni_ray.engine.builders import build_encoder_core
from omni_ray.families.qwen_image_2_1.facts import format_prompt, vision_slots
from omni_ray.families.qwen_image_2_1.tokenizer import Qwen21Tokenizer
from omni_ray.records import EncodeRequest
from omni_ray.runners.vision import to_pil
from omni_ray.tokenizer import tokenizer_for

TOLERANCE = 1e-4  # float32 on a CPU; measured: 4.6e-6 at most


def _images() -> tuple[np.ndarray, np.ndarray]:
    """An RGB condition image and an RGBA one with every alpha from clear to opaque, both at working sizes."""
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    rgba = rng.integers(0, 256, (32, 96, 4), dtype=np.uint8)
    rgba[0, :3, 3] = (0, 128, 255)
    return rgb, rgba


RGB, RGBA = _images()
CASES = {  # request id -> (prompt, negative prompt, condition images)
    "text": ("a red cat sitting on a wooden chair", "blurry", ()),
    "one": ("make the sky purple", "", (RGB,)),
    "two": ("put the cat from picture 1 on the chair of picture 2", "low quality", (RGB, RGBA)),
}


@pytest.fixture(scope="module")
def ckpt21(tmp_path_factory):
    from omni_ray.families.qwen_image_2_1.tiny import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny21", seed=0)


@pytest.fixture(scope="module")
def config(ckpt21):
    return load_config(REPO / "stage_configs/qwen_image_2_1_tiny.yaml", model=str(ckpt21))


@pytest.fixture(scope="module")
def reference(ckpt21):
    return QwenImage21Pipeline.from_pretrained(ckpt21)


@pytest.fixture(scope="module")
def core(config):
    """One vLLM engine for the module (10 to 17 s to start)."""
    core = build_encoder_core(config)
    yield core
    core.shutdown()


def _pictures(images):
    return [Image.fromarray(image) for image in images] or None


def _transformers_states(reference, prompt: str, images) -> torch.Tensor:
    """Transformers' Qwen3-VL over the pipeline's processor inputs: the last layer's states before the final norm
    (the pipeline's hook), the whole sequence."""
    pictures = [to_pil(image) for image in images] or None
    inputs = reference.processor(text=[format_prompt(prompt, len(images))], images=pictures, return_tensors="pt")
    norm = reference.text_encoder.model.language_model.norm
    handle = norm.register_forward_hook(lambda module, args, output: args[0])
    try:
        with torch.no_grad():
            out = reference.text_encoder(**inputs, output_hidden_states=True)
    finally:
        handle.remove()
    return out.hidden_states[-1][0]


def test_tokenizer_counts_as_the_pipeline(ckpt21, config, reference):
    tokenizer = tokenizer_for(config)
    assert isinstance(tokenizer, Qwen21Tokenizer)
    assert tokenizer.template.drop == reference._drop_idx
    for prompt, _, images in CASES.values():
        pictures = [to_pil(image) for image in images] or None
        ids = reference.processor(text=[format_prompt(prompt, len(images))], images=pictures).input_ids[0]
        sizes = tuple(image.shape[:2] for image in images)
        count = tokenizer.num_tokens(prompt, sizes)
        assert count.total == len(ids) and count.image == sum(vision_slots(*size) for size in sizes)
        slots = tokenizer.image_slots(tokenizer.tokenize(prompt, len(images)), sizes)
        _, _, mask = reference.encode_prompt(prompt, image=_pictures(images), device="cpu")
        assert slots.tolist() == mask[0].tolist()
    assert tokenizer.tokenize("") == tokenizer.tokenize(" ")  # an empty prompt reads as one space


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_vllm_states_equal_transformers_before_the_final_norm(core, reference, case):
    prompt, _, images = CASES[case]
    tokenizer, encoder = core.tokenizer, core.encoder
    encoder.add(f"raw-{case}", tokenizer.tokenize(prompt, len(images)), images)
    finished = {}
    while not finished:
        finished = encoder.step()
    got = finished[f"raw-{case}"]
    expected = _transformers_states(reference, prompt, images)
    assert got.shape == expected.shape
    difference = (got - expected).abs().max().item()
    print(f"{case}: {len(images)} image(s), {got.shape[0]} tokens, max |vLLM - transformers| = {difference:.2e}")
    assert difference < TOLERANCE
    # The comparison tells the two states apart: the normalised ones are far from these.
    normed = reference.text_encoder.model.language_model.norm(expected)
    assert (normed - expected).abs().max().item() > 100 * TOLERANCE


@pytest.mark.vllm
def test_encoder_core_gives_the_pipeline_s_encode_prompt(core, reference):
    requests = [EncodeRequest(case, prompt, negative, images) for case, (prompt, negative, images) in CASES.items()]
    requests.append(EncodeRequest("no-cfg", "a lighthouse", None, (RGBA,)))
    results, _ = encode_all(core, requests)
    for request in requests:
        got = results[request.request_id]
        for part, text in (("prompt", request.prompt), ("negative", request.negative_prompt)):
            embeds = getattr(got, part)
            if text is None:
                assert embeds is None
                continue
            expected, mask, image_pad_mask = reference.encode_prompt(text, image=_pictures(request.images),
                                                                     device="cpu")
            assert mask is None
            assert embeds.embeds.shape == expected[0].shape
            assert (embeds.embeds - expected[0]).abs().max().item() < TOLERANCE
            assert embeds.image_slots.dtype == torch.bool
            assert torch.equal(embeds.image_slots, image_pad_mask[0])
            assert int(embeds.image_slots.sum()) == sum(vision_slots(*image.shape[:2]) for image in request.images)


@pytest.mark.vllm
def test_prompt_cache_hits_on_a_repeat_and_misses_when_an_image_changes(core):
    cache = core.cache
    assert cache is not None
    request = EncodeRequest("c1", "a cat in a hat", "blurry", (RGB, RGBA))
    first, _ = encode_all(core, [request])
    encoded, hits = core.num_encoded, cache.num_hits
    again, _ = encode_all(core, [EncodeRequest("c2", request.prompt, request.negative_prompt, request.images)])
    assert core.num_encoded == encoded and cache.num_hits == hits + 2
    for part in ("prompt", "negative"):
        a, b = getattr(first["c1"], part), getattr(again["c2"], part)
        assert torch.equal(a.embeds, b.embeds) and torch.equal(a.image_slots, b.image_slots)
    changed = RGBA.copy()
    changed[5, 7, 3] ^= 1  # one alpha value
    encode_all(core, [EncodeRequest("c3", request.prompt, request.negative_prompt, (RGB, changed))])
    assert core.num_encoded == encoded + 2 and cache.num_hits == hits + 2
    fewer, _ = encode_all(core, [EncodeRequest("c4", request.prompt, None, (RGB,))])  # another template
    assert core.num_encoded == encoded + 3 and int(fewer["c4"].prompt.image_slots.sum()) == vision_slots(64, 64)


def test_transformers_runner_gives_the_pipeline_s_encode_prompt(config, reference):
    """``encoder.runner: transformers``: text prompts batched (right-padded), each prompt with images alone."""
    config = config.model_copy(update={"encoder": config.encoder.model_copy(
        update={"runner": "transformers", "max_num_seqs": 4, "cache_bytes": 0})})
    core = build_encoder_core(config)
    requests = [EncodeRequest(case, prompt, negative, images) for case, (prompt, negative, images) in CASES.items()]
    requests.append(EncodeRequest("short", "a cup", "dark", ()))
    results, steps = encode_all(core, requests)
    # Four seats at a time (max_num_seqs), filled in arrival order: the texts share steps, each sequence with images
    # runs alone; 8 sequences take 6 steps rather than 8.
    assert steps == 6
    for request in requests:
        for part in ("prompt", "negative"):
            text = getattr(request, "prompt" if part == "prompt" else "negative_prompt")
            embeds = getattr(results[request.request_id], part)
            expected, _, image_pad_mask = reference.encode_prompt(text, image=_pictures(request.images), device="cpu")
            assert embeds.embeds.shape == expected[0].shape
            assert (embeds.embeds - expected[0]).abs().max().item() < TOLERANCE
            assert torch.equal(embeds.image_slots, image_pad_mask[0])
