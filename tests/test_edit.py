"""Image editing on the tiny Qwen-Image-Edit checkpoint, in process: parity with diffusers' QwenImageEditPipeline,
VAE encoding, the DiT batching edits, and the checks on an uploaded image."""

import io

import numpy as np
import pytest
import torch
from conftest import REPO
from PIL import Image

from omni_ray.api.images import load_input_images, working_size
from omni_ray.api.planning import plan_request
from omni_ray.api.schema import parse_request
from omni_ray.config import ConfigError, load_config
from omni_ray.engine.core import EngineCore
from omni_ray.engine.dit_scheduler import DiTScheduler
from omni_ray.engine.vae_scheduler import VaeScheduler
from omni_ray.errors import PayloadTooLargeError, RequestError
from omni_ray.families.qwen_image.facts import EDIT
from omni_ray.records import DecodeRequest, DenoiseParams, DenoiseRequest, ImageEncodeRequest
from omni_ray.runners.denoise import DenoiseRunner
from omni_ray.runners.vae import VaeRunner
from testing.numerics import assert_reordered
from testing.reference import PromptEncoder, ReferencePipeline, load_reference, reference_edit, source_image
from testing.serving import file_bytes as png

PRESET = REPO / "stage_configs/qwen_image_edit_tiny.yaml"


@pytest.fixture(scope="module")
def config(edit_dir):
    return load_config(PRESET, model=str(edit_dir))


@pytest.fixture(scope="module")
def reference(edit_dir):
    return load_reference(edit_dir)


@pytest.fixture(scope="module")
def local(config):
    return ReferencePipeline(config)


CASES = {
    # name: (input width, height, negative prompt, requested size)
    "wide 180x100, CFG off": (180, 100, None, None),
    "wide 180x100, CFG on": (180, 100, "blurry, low quality", None),
    "tall 120x240, CFG on": (120, 240, "dark", None),
    "tall 120x240, CFG off, output 128x64": (120, 240, None, (64, 128)),
}


@pytest.mark.parametrize("case", CASES)
def test_edits_match_diffusers_within_one_level(config, reference, local, case):
    width, height, negative, size = CASES[case]
    source = source_image(width, height, seed=len(case))
    pixels = load_input_images([png(source)], config).vae[0]
    work_height, work_width = working_size(width, height, config.edit.image_area)
    assert pixels.shape == (work_height, work_width, 3)
    out_height, out_width = size or (work_height, work_width)
    expected = reference_edit(
        reference, config.edit.image_area, source, seed=5, prompt="make the disc blue", negative_prompt=negative,
        true_cfg_scale=4.0, num_inference_steps=3, **({"height": size[0], "width": size[1]} if size else {}),
    )
    got = local.generate(
        ["make the disc blue"], seeds=[5], height=out_height, width=out_width, num_inference_steps=3,
        negative_prompts=[negative] if negative else None, true_cfg_scale=4.0, image=pixels,
    )[0]
    assert got.shape == expected.shape == (out_height, out_width, 3)
    assert np.abs(got.astype(int) - expected.astype(int)).max() <= 1


def test_the_input_image_steers_the_edit(config, local):
    edits = [
        local.generate(["make it red"], seeds=[0], height=96, width=160, num_inference_steps=2,
                       image=load_input_images([png(source_image(180, 100, seed))], config).vae[0])[0]
        for seed in (1, 2)
    ]
    # A random model barely listens to its conditioning, but a different input image moves pixels by more than the
    # one level that rounding can (measured: 7 levels at most, 0.57 on average).
    assert np.abs(edits[0].astype(int) - edits[1].astype(int)).max() > 3


def test_diffusers_as_pinned_drops_mrope_for_the_image(config, edit_dir, reference):
    """The reason the reference passes mm_token_type_ids (see omni_ray/reference.py): without them the embeddings of
    every token after the first image token differ. Ours are transformers' with M-RoPE, exactly."""
    source = source_image(180, 100, seed=0)
    resized = Image.fromarray(load_input_images([png(source)], config).vae[0])
    with_mrope, _ = reference.encode_prompt("make it red", image=resized, device="cpu")
    plain, _ = load_reference(edit_dir, token_types=False).encode_prompt("make it red", image=resized, device="cpu")
    ours = PromptEncoder(str(edit_dir), template=EDIT).encode(["make it red"], (np.asarray(resized),))[0].embeds
    assert torch.equal(ours, with_mrope[0])
    first_image_token = 1  # after the dropped 64 tokens: <|vision_start|>, then the image
    assert torch.equal(plain[0, : first_image_token + 1], with_mrope[0, : first_image_token + 1])
    assert (plain[0, first_image_token + 1 :] - with_mrope[0, first_image_token + 1 :]).abs().max() > 0.1


def test_vae_encodes_same_size_images_together_as_diffusers_does(config, edit_dir, reference):
    runner = VaeRunner.load(str(edit_dir))
    images = [load_input_images([png(source_image(w, h, seed))], config).vae[0] for seed, (w, h) in
              enumerate([(180, 100), (200, 110), (120, 240)])]
    assert images[0].shape == images[1].shape != images[2].shape
    core = EngineCore(VaeScheduler(max_batch_size=4), runner)
    for i, image in enumerate(images):
        core.add_request(ImageEncodeRequest(f"e{i}", image))
    core.add_request(DecodeRequest("d", runner.encode([images[0]])[0]))
    steps = [core.step() for _ in range(3)]
    assert [[o.request_id for o in step] for step in steps] == [["e0", "e1"], ["e2"], ["d"]]
    results = {o.request_id: o.result for step in steps for o in step}
    for i, image in enumerate(images):
        height, width = image.shape[:2]
        pixels = reference.image_processor.preprocess(Image.fromarray(image), height, width).unsqueeze(2)
        expected = reference._encode_vae_image(pixels, generator=None)
        expected = reference._pack_latents(expected, 1, 16, height // 8, width // 8)[0]
        latents = results[f"e{i}"]
        assert (latents.height, latents.width) == (height, width)
        assert (latents.latents - expected).abs().max().item() < 1e-4


def test_dit_batches_edits_of_one_key_and_keeps_each_result(config, edit_dir):
    encoder = PromptEncoder(str(edit_dir), template=EDIT)
    vae = VaeRunner.load(str(edit_dir))
    runner = DenoiseRunner.load(str(edit_dir))
    wide = [load_input_images([png(source_image(180, 100, seed))], config).vae[0] for seed in range(3)]
    tall = load_input_images([png(source_image(120, 240, 9))], config).vae[0]

    def edit(request_id, image, prompt, seed, steps=2):
        return DenoiseRequest(request_id, DenoiseParams(96, 96, steps, seed), encoder.encode([prompt], (image,))[0],
                              images=(vae.encode([image])[0],))

    requests = [edit(f"w{i}", image, f"make it {color}", seed=i, steps=2 + i)
                for i, (image, color) in enumerate(zip(wide, ["red", "green", "a painting"]))]
    requests.append(edit("t", tall, "make it red", seed=0))
    plain = PromptEncoder(str(edit_dir), template=EDIT)  # a request without image latents: another key
    requests.append(DenoiseRequest("p", DenoiseParams(96, 96, 2, 0), plain.encode(["make it red"], (wide[0],))[0]))
    assert len({request.batch_key for request in requests}) == 3

    def run(batch):
        core = EngineCore(DiTScheduler(max_batch_size=8, max_wait_steps=8), runner)
        for request in batch:
            core.add_request(request)
        results, steps = {}, []
        while core.has_unfinished_requests():
            outputs = core.step()
            steps.append(sorted(o.request_id for o in outputs))
            results.update({o.request_id: o.result for o in outputs if o.finish_reason == "stop"})
        return results, steps

    together, steps = run(requests)
    assert steps[:4] == [["w0", "w1", "w2"], ["w0", "w1", "w2"], ["w1", "w2"], ["w2"]]
    assert sorted(steps[4:]) == [["p"], ["p"], ["t"], ["t"]]  # other keys never join the wide edits' forward
    for request in requests:
        alone = run([request])[0][request.request_id]
        assert_reordered(together[request.request_id].latents, alone.latents)
    assert (together["w0"].latents - together["p"].latents).abs().max() > 0.1  # the image latents matter


# Uploads: every bad image is a 4xx that names `image`.


def test_an_image_is_resized_to_its_working_size(config):
    pixels = load_input_images([png(source_image(180, 100, 0), "JPEG")], config).vae[0]
    assert pixels.shape == (96, 160, 3) and pixels.dtype == np.uint8
    assert working_size(1024, 1024, 1024 * 1024) == (1024, 1024)
    assert working_size(1920, 1080, 1024 * 1024) == (768, 1376)  # diffusers' calculate_dimensions for 16:9


def truncated(format: str, keep: int | None = None) -> bytes:
    data = png(source_image(180, 100, 0), format)
    return data[: keep or len(data) // 2]


def test_camera_jpegs_with_several_pictures_are_taken(config):
    """Phones write MPO (a JPEG with a second picture, such as a gain map): the first picture is the photo."""
    buffer = io.BytesIO()
    source_image(180, 100, 0).save(buffer, format="MPO", save_all=True, append_images=[source_image(180, 100, 1)])
    assert Image.open(io.BytesIO(buffer.getvalue())).format == "MPO"
    assert load_input_images([buffer.getvalue()], config).vae[0].shape == (96, 160, 3)


BAD_IMAGES = {
    "missing": (None, RequestError, "required"),
    "empty": (b"", RequestError, "an empty file"),
    "not an image": (b"%PDF-1.4 definitely not pixels" * 10, RequestError, "not a readable image"),
    "truncated PNG": (truncated("PNG"), RequestError, "corrupt or truncated"),
    "JPEG cut in its header": (truncated("JPEG", 200), RequestError, "corrupt or truncated"),
    "WebP cut in its header": (truncated("WEBP", 40), RequestError, "corrupt or truncated"),
    "GIF": (png(source_image(64, 64, 0), "GIF"), RequestError, "GIF files are not supported"),
    "extreme aspect": (png(Image.new("RGB", (4000, 10))), RequestError, "working width 2560 is outside 32..512"),
}


@pytest.mark.parametrize("case", BAD_IMAGES)
def test_bad_images_are_refused_naming_the_field(config, case):
    data, error, message = BAD_IMAGES[case]
    with pytest.raises(error, match=message) as info:
        load_input_images([data] if data is not None else [], config)
    assert info.value.param == "image" and info.value.status_code == 400


def test_an_oversized_image_is_a_413(config):
    small = config.model_copy(update={"edit": config.edit.model_copy(update={"max_image_bytes": 1000})})
    with pytest.raises(PayloadTooLargeError, match="the limit is 1000") as info:
        load_input_images([png(source_image(180, 100, 0))], small)
    assert info.value.param == "image" and info.value.status_code == 413


def test_image_tokens_counted_without_torch_are_qwen_vl_processors(edit_dir):
    """The coordinator counts an image's vision tokens without torch (``tokenizer.VisionPatches``): the same counts
    as Qwen2.5-VL's image processor, for the checkpoint's settings and for a file with min_pixels and max_pixels."""
    from transformers import AutoImageProcessor, Qwen2VLImageProcessor

    from omni_ray.tokenizer import PromptTokenizer, VisionPatches

    sides = (10, 28, 56, 96, 100, 160, 384, 1000, 1328, 4000)
    sizes = [(h, w) for h in sides for w in sides if max(h, w) / min(h, w) < 200]  # the processor's own limit
    processor = AutoImageProcessor.from_pretrained(str(edit_dir), subfolder="processor")
    tokenizer = PromptTokenizer(str(edit_dir), EDIT)
    bounded = {"min_pixels": 256 * 28 * 28, "max_pixels": 1024 * 28 * 28, "patch_size": 14, "merge_size": 2}
    other = Qwen2VLImageProcessor(**bounded)
    for count, reference in ((tokenizer.image_tokens, processor), (VisionPatches.from_config(bounded).tokens, other)):
        got = [count(h, w) for h, w in sizes]
        assert got == [reference.get_number_of_image_patches(h, w, {}) // 4 for h, w in sizes]
    assert len(set(got)) > 10  # the bounds and the rounding at work


def test_edit_plans_take_form_fields_and_count_the_image_tokens(config, edit_dir):
    from omni_ray.tokenizer import PromptTokenizer

    tokenizer = PromptTokenizer(str(edit_dir), EDIT)
    pixels = load_input_images([png(source_image(180, 100, 0))], config).vae[0]
    form = {"prompt": "make it red", "n": "2", "seed": "7", "true_cfg_scale": "3", "negative_prompt": "dark",
            "stream": "false"}
    plan = plan_request(parse_request(form, form=True), config, tokenizer.num_tokens, pixels)
    assert (plan.height, plan.width, plan.request.n, plan.seed, plan.request.negative_prompt) == (96, 160, 2, 7, "dark")
    assert plan.request.true_cfg_scale == 3.0 and plan.inputs.vae == plan.inputs.encoder == (pixels,)
    sized = plan_request(parse_request({**form, "size": "64x128"}, form=True), config, tokenizer.num_tokens, pixels)
    assert (sized.height, sized.width) == (128, 64)
    # The image's tokens count against the encoder's limit: 96x160 is 84x168 for the ViT, 18 merged patches.
    assert tokenizer.num_tokens("make it red", ((96, 160),)) == (len(tokenizer.tokenize("make it red", 1)) - 1, 18)
    with pytest.raises(RequestError, match="prompt: .* tokens with the prompt template") as info:
        plan_request(parse_request({"prompt": "word " * 1100}, form=True), config, tokenizer.num_tokens, pixels)
    assert info.value.param == "prompt"
    with pytest.raises(RequestError, match="n: .*integer") as info:
        parse_request({"prompt": "x", "n": "two"}, form=True)
    assert info.value.param == "n"
    with pytest.raises(RequestError, match="edits images; send an .image. and a .prompt. to /v1/images/edits") as info:
        plan_request({"prompt": "a cat"}, config)
    assert info.value.param == "image"


def test_an_edit_preset_needs_an_edit_checkpoint(tiny_dir, edit_dir):
    with pytest.raises(ConfigError, match="model: .* is a QwenImagePipeline checkpoint, but this preset edits"):
        load_config(PRESET, model=str(tiny_dir))
    with pytest.raises(ConfigError, match="is a QwenImageEditPipeline checkpoint, but this preset generates"):
        load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(edit_dir))


@pytest.mark.vllm  # the command runs the three engines
def test_the_in_process_pipeline_edits_from_the_command_line(config, edit_dir, tmp_path):
    from omni_ray.pipeline import main

    source_image(300, 200, 0).save(tmp_path / "in.png")
    main(["make it blue", "--image", str(tmp_path / "in.png"), "--stage-config", str(PRESET), "--model",
          str(edit_dir), "--steps", "2", "--out", str(tmp_path / "out.png")])
    assert Image.open(tmp_path / "out.png").size == (160, 96)  # 300x200 at 128x128 pixels, sides of 32
