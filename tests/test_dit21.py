"""Qwen-Image 2.1's DiT runner (omni_ray/families/qwen_image_2_1/denoise.py) on the tiny 2.1 checkpoint: equal to
diffusers' QwenImage21Pipeline, step-level batching of different prompts over cached conditions, pausing, the condition cache
freed when a request leaves, and LoRA adapters per row."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from PIL import Image

from omni_ray.config import ParallelSettings
from omni_ray.families.qwen_image_2_1 import facts as qwen_image21
from omni_ray.families.qwen_image_2_1.denoise import Denoise21Runner
from omni_ray.records import DenoiseBatch, DenoiseParams, DenoiseRequest, Latents, LoraRef, PromptEmbeds
from omni_ray.runners.lora import read_lora
from omni_ray.runners.parallel.mesh import Mesh
from testing.numerics import assert_reordered

# Against diffusers (which recomputes the condition every step with use_kv_cache=False): 3e-6 measured on latents of
# magnitude 4 after four steps. Batched against alone: the padded condition keys change the order of float sums only
# (testing.numerics).
DIFFUSERS_TOLERANCE = 1e-4
SIZE = (64, 96)  # (height, width) of the outputs: 4 x 6 latent tokens
RESOLUTION = 64  # the pipeline's output_resolution: condition images take about 64 x 64 pixels
SIGMAS = (1.0, 0.75, 0.5, 0.25)  # the tiny checkpoint's sample_sigmas
ADAPTER_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "img_mlp.proj", "img_mlp.gate_layer", "img_mlp.out",
                   "txt_in.in_layer", "img_in", "modulation.1", "proj_out")


def condition_images() -> list[Image.Image]:
    """A wide RGB image and a tall RGBA one: at RESOLUTION they work at 32 x 96 and 96 x 32 pixels."""
    rng = np.random.default_rng(0)
    wide = Image.fromarray(rng.integers(0, 255, (64, 128, 3), dtype=np.uint8))
    tall = Image.fromarray(rng.integers(0, 255, (128, 64, 4), dtype=np.uint8), mode="RGBA")
    return [wide, tall]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from omni_ray.families.qwen_image_2_1.tiny import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny21", seed=0)


@pytest.fixture(scope="module")
def pipe(checkpoint):
    from diffusers import QwenImage21Pipeline

    pipe = QwenImage21Pipeline.from_pretrained(checkpoint)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def adapter(checkpoint, tmp_path_factory) -> str:
    """A rank-4 adapter of 2.1's Linears (every one the pipeline's PEFT names), its weights drawn from a seed."""
    from diffusers import QwenImage21Pipeline, QwenImage21Transformer2DModel
    from peft import LoraConfig, get_peft_model_state_dict

    transformer = QwenImage21Transformer2DModel.from_pretrained(checkpoint, subfolder="transformer")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(ADAPTER_TARGETS))
    transformer.add_adapter(config)
    generator = torch.Generator().manual_seed(1)
    for name, parameter in transformer.named_parameters():
        if "lora_" in name:
            parameter.data = torch.randn(parameter.shape, generator=generator) * 0.1
    out = tmp_path_factory.mktemp("adapters") / "A"
    QwenImage21Pipeline.save_lora_weights(out, transformer_lora_layers=get_peft_model_state_dict(transformer),
                                          transformer_lora_adapter_metadata=config.to_dict())
    return str(out)


@pytest.fixture(scope="module")
def runner(checkpoint, adapter):
    runner = Denoise21Runner.load(str(checkpoint), max_loras=2)
    runner.add_lora(("A", adapter), read_lora(adapter, runner.lora_shapes))
    return runner


class Inputs:
    """What the encoder and the VAE stages hand the DiT, made by the pipeline's own ``encode_prompt`` and
    ``prepare_latents`` from images preprocessed as its ``__call__`` does."""

    def __init__(self, pipe, images: list[Image.Image]):
        from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions

        self.pipe, self.sizes, self.encoder_images, vae_images = pipe, [], [], []
        for image in images:
            image = image.convert("RGBA")
            width, height, _ = calculate_dimensions(RESOLUTION**2, image.size[0] / image.size[1])
            self.sizes.append((height, width))
            self.encoder_images.append(pipe.image_processor.resize(image, width=width, height=height))
            vae_images.append(pipe.image_processor.preprocess(image, width=width, height=height).unsqueeze(2))
        self.images: tuple[Latents, ...] = ()
        if images:
            _, latents = pipe.prepare_latents(vae_images, 1, 64, *SIZE, torch.float32, "cpu", None)
            counts = [qwen_image21.image_tokens(*size) for size in self.sizes]
            self.images = tuple(Latents(part[0], *size) for part, size in zip(latents.split(counts, dim=1),
                                                                               self.sizes))

    def prompt(self, text: str) -> PromptEmbeds:
        embeds, mask, slots = self.pipe.encode_prompt(text, image=self.encoder_images or None, device="cpu")
        tokens = embeds.shape[1] if mask is None else int(mask[0].sum())
        return PromptEmbeds(embeds[0, :tokens], slots[0, :tokens] if self.encoder_images else None)

    def request(self, request_id: str, prompt: str, negative: str | None = None, seed: int = 3, steps: int = 4,
                scale: float = 4.0, **params) -> DenoiseRequest:
        sigmas = SIGMAS if steps == len(SIGMAS) else None
        return DenoiseRequest(
            request_id,
            DenoiseParams(*SIZE, steps, seed, scale, true_cfg=negative is not None, sigmas=sigmas, **params),
            self.prompt(prompt), self.prompt(negative) if negative is not None else None, self.images)


def run_alone(runner, request: DenoiseRequest) -> torch.Tensor:
    """The request's final latents, stepped alone from admission to the end."""
    batch = DenoiseBatch([request], [request.request_id], [])
    while True:
        output = runner.execute_model(batch)
        assert not output.errors, output.errors
        if request.request_id in output.finished:
            return output.finished[request.request_id].latents
        batch = DenoiseBatch([], [request.request_id], [])


def record_rows(runner) -> list[int]:
    """The rows of every forward from now on (``img_in``'s input: 1 for a first step, the batch's passes after)."""
    rows = []
    runner.transformer.img_in.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    return rows


def cache_tensors(runner, request_id: str) -> list[weakref.ref]:
    """Weak references to the request's condition caches' tensors: dead once nothing holds them."""
    return [weakref.ref(tensor) for one in runner.states[request_id].passes
            for tensor in (one.cache.keys, one.cache.values, one.cache.target_rope)]


def gone(refs: list[weakref.ref]) -> bool:
    gc.collect()
    return all(ref() is None for ref in refs)


@pytest.mark.parametrize("num_images", [0, 1, 2], ids=["t2i", "edit-1-image", "edit-2-images"])
@pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "true-cfg"])
def test_final_latents_equal_diffusers_pipeline(pipe, runner, num_images, cfg):
    images = condition_images()[:num_images]
    prompt, negative = "a red cat sitting on a wooden table", "blurry, low quality" if cfg else None
    expected = pipe(prompt, image=images or None, negative_prompt=negative, true_cfg_scale=4.0, height=SIZE[0],
                    width=SIZE[1], output_resolution=RESOLUTION, generator=torch.Generator().manual_seed(3),
                    output_type="latent", use_kv_cache=False).images[0]
    ours = run_alone(runner, Inputs(pipe, images).request("r", prompt, negative))
    assert ours.shape == (qwen_image21.image_tokens(*SIZE), 64)
    assert (ours - expected).abs().max().item() <= DIFFUSERS_TOLERANCE
    assert runner.states == {} and runner.cache_bytes() == 0


def test_the_condition_matters(pipe, runner):
    """The condition image moves the result (so the equality above would notice a condition read wrongly)."""
    inputs = Inputs(pipe, condition_images()[:1])
    request = inputs.request("r", "a red cat")
    flipped = Latents(inputs.images[0].latents.flip(0), *inputs.sizes[0])
    other = DenoiseRequest("o", request.params, request.prompt, None, (flipped,))
    assert (run_alone(runner, request) - run_alone(runner, other)).abs().max() > 1e-2


def test_different_prompts_step_together_as_each_alone(pipe, runner):
    """Three edits with prompts and negatives of different token counts, seeds, scales and step counts: their first
    steps run pass by pass, their later ones in one forward of six rows, each equal to its request alone."""
    inputs = Inputs(pipe, condition_images()[:1])
    requests = [
        inputs.request("r0", "a red cat", "blurry", seed=1, scale=4.0, previews=(2,)),
        inputs.request("r1", "an oil painting of a lighthouse on a cliff at sunset, waves", "dark, noisy, ugly",
                       seed=2, scale=2.5, steps=3),
        inputs.request("r2", "a cup of coffee", " ", seed=3, scale=6.0),
    ]
    assert len({r.prompt.num_tokens for r in requests}) == 3
    alone = {r.request_id: run_alone(runner, r) for r in requests}
    rows = record_rows(runner)
    ids = [r.request_id for r in requests]
    outputs = [runner.execute_model(DenoiseBatch(requests, ids, []))]
    while runner.states:
        outputs.append(runner.execute_model(DenoiseBatch([], [i for i in ids if i in runner.states], [])))
    together = {rid: latents.latents for output in outputs for rid, latents in output.finished.items()}
    assert rows == [1] * 6 + [6, 6, 4]  # six first passes, then 3 x 2 cached rows; r1 finished after 3 steps
    assert [sorted(output.previews) for output in outputs] == [[], ["r0"], [], []]
    assert outputs[1].previews["r0"].latents.shape == (qwen_image21.image_tokens(*SIZE), 64)
    for request_id, latents in together.items():
        assert_reordered(latents, alone[request_id], request_id)
    assert (together["r0"] - together["r2"]).abs().max() > 0.1  # rows swapping would show


def test_the_dit_engine_core_steps_it_as_it_steps_qwen_images(pipe, runner):
    """The engine core and scheduler hold this runner as they hold ``DenoiseRunner``: one step batch of three."""
    from omni_ray.engine.core import DiTEngineCore
    from omni_ray.engine.dit_scheduler import DiTScheduler
    from testing.engines import run_to_completion

    inputs = Inputs(pipe, condition_images()[:1])
    requests = [inputs.request(f"r{i}", prompt, "blurry", seed=i)
                for i, prompt in enumerate(["a red cat", "a lighthouse at sunset over the sea", "a cup"])]
    alone = {r.request_id: run_alone(runner, r) for r in requests}
    core = DiTEngineCore(DiTScheduler(max_batch_size=8, max_wait_steps=4), runner)
    for request in requests:
        core.add_request(request)
    results, batches = run_to_completion(core)
    assert batches == [["r0", "r1", "r2"]] * 4
    for request_id, latents in results.items():
        assert_reordered(latents.latents, alone[request_id], request_id)
    assert runner.states == {} and runner.cache_bytes() == 0


def test_a_paused_request_keeps_its_cache_and_ends_as_alone(pipe, runner):
    """A request sits out two steps while a more urgent one steps: its cache stays, and both end as alone."""
    inputs = Inputs(pipe, condition_images())
    slow = inputs.request("slow", "a lighthouse at night", "blurry", seed=5)
    urgent = inputs.request("urgent", "a small robot reading a book", "ugly", seed=6, priority=-1)
    alone = {r.request_id: run_alone(runner, r) for r in (slow, urgent)}
    runner.execute_model(DenoiseBatch([slow], ["slow"], []))
    held = runner.cache_bytes("slow")
    assert held > 0
    for _ in range(2):
        runner.execute_model(DenoiseBatch([urgent] if "urgent" not in runner.states else [], ["urgent"], []))
        assert runner.cache_bytes("slow") == held and runner.states["slow"].step_index == 1
    results = {}
    while runner.states:
        output = runner.execute_model(DenoiseBatch([], sorted(runner.states), []))
        results.update({rid: latents.latents for rid, latents in output.finished.items()})
    for request_id, latents in results.items():
        assert_reordered(latents, alone[request_id], request_id)


def test_the_cache_is_the_conditions_keys_and_values_and_leaves_when_the_request_finishes(pipe, runner):
    inputs = Inputs(pipe, condition_images())
    request = inputs.request("r", "a red cat", "blurry")
    runner.execute_model(DenoiseBatch([request], ["r"], []))
    transformer = runner.transformer.config
    sizes = tuple(inputs.sizes)
    kv = sum(qwen_image21.cache_bytes(qwen_image21.condition_tokens(p.num_tokens, sizes), transformer.num_layers,
                                      transformer.num_attention_heads * transformer.attention_head_dim, 4)
             for p in (request.prompt, request.negative))
    rope = 2 * qwen_image21.image_tokens(*SIZE) * transformer.attention_head_dim // 2 * 8  # complex64, two passes
    assert runner.cache_bytes("r") == runner.cache_bytes() == kv + rope
    refs = cache_tensors(runner, "r")
    while "r" in runner.states:
        runner.execute_model(DenoiseBatch([], ["r"], []))
    assert runner.cache_bytes() == 0 and gone(refs)


def test_an_aborted_requests_cache_leaves_with_it(pipe, runner):
    request = Inputs(pipe, condition_images()[:1]).request("r", "a red cat", "blurry")
    runner.execute_model(DenoiseBatch([request], ["r"], []))
    refs = cache_tensors(runner, "r")
    assert runner.cache_bytes("r") > 0
    runner.execute_model(DenoiseBatch([], [], ["r"]))
    assert runner.states == {} and runner.cache_bytes() == 0 and gone(refs)


def test_a_failing_request_fails_alone_and_its_cache_leaves(pipe, runner):
    """One request's cached step raises (its latents broken after its first step): it fails, its cache goes, the
    other request runs on to its result alone. Requests the transformer cannot read fail at admission."""
    inputs = Inputs(pipe, condition_images()[:1])
    doomed, fine = inputs.request("doomed", "a red cat", "blurry"), inputs.request("fine", "a cup", "dark", seed=4)
    expected = run_alone(runner, fine)
    runner.execute_model(DenoiseBatch([doomed, fine], ["doomed", "fine"], []))
    refs = cache_tensors(runner, "doomed")
    runner.states["doomed"].latents = runner.states["doomed"].latents[..., :32]
    output = runner.execute_model(DenoiseBatch([], ["doomed", "fine"], []))
    assert sorted(output.errors) == ["doomed"] and output.progress == {"fine": (2, 4)}
    assert "doomed" not in runner.states and runner.cache_bytes("doomed") == 0 and gone(refs)
    while runner.states:
        output = runner.execute_model(DenoiseBatch([], ["fine"], []))
    assert_reordered(output.finished["fine"].latents, expected)

    narrow = DenoiseRequest("narrow", doomed.params, PromptEmbeds(torch.ones(5, 32)), doomed.negative, doomed.images)
    no_slots = DenoiseRequest("no-slots", doomed.params, PromptEmbeds(doomed.prompt.embeds), doomed.negative,
                              doomed.images)
    output = runner.execute_model(DenoiseBatch([narrow, no_slots], ["narrow", "no-slots"], []))
    assert "prompt: embeddings (5, 32)" in str(output.errors["narrow"])
    assert "prompt: 0 image slots, the condition images take 3" in str(output.errors["no-slots"])
    assert runner.states == {}


def test_an_adapter_applies_to_its_row_only_and_equals_diffusers(pipe, runner, adapter):
    """One row with the adapter and one without, in one batch (true CFG, an edit): each equals itself alone, and
    the adapter's equals diffusers' load_lora_weights (PEFT) at the same scale."""
    inputs = Inputs(pipe, condition_images()[:1])
    lora = LoraRef("A", adapter, 0.7)
    adapted = inputs.request("adapted", "a red cat", "blurry", loras=(lora,))
    plain = inputs.request("plain", "a red cat", "blurry")
    alone = {r.request_id: run_alone(runner, r) for r in (adapted, plain)}
    rows = record_rows(runner)
    output = runner.execute_model(DenoiseBatch([adapted, plain], ["adapted", "plain"], []))
    while runner.states:
        output = runner.execute_model(DenoiseBatch([], ["adapted", "plain"], []))
    assert max(rows) == 4
    for request_id, latents in output.finished.items():
        assert_reordered(latents.latents, alone[request_id], request_id)
    assert (alone["adapted"] - alone["plain"]).abs().max() > 1e-2

    pipe.load_lora_weights(adapter, adapter_name="A")
    pipe.set_adapters("A", 0.7)
    try:
        expected = pipe("a red cat", image=condition_images()[:1], negative_prompt="blurry", true_cfg_scale=4.0,
                        height=SIZE[0], width=SIZE[1], output_resolution=RESOLUTION,
                        generator=torch.Generator().manual_seed(3), output_type="latent",
                        use_kv_cache=False).images[0]
    finally:
        pipe.unload_lora_weights()
    assert (alone["adapted"] - expected).abs().max().item() <= DIFFUSERS_TOLERANCE


def test_a_gang_is_refused_naming_dit_parallel(runner):
    with pytest.raises(ValueError, match="dit.parallel"):
        Denoise21Runner(runner.transformer, runner.scheduler_config, mesh=Mesh(ParallelSettings(cfg=2), 0, {}))
