"""LoRA adapters per request (issue 16): parity with diffusers' load_lora_weights, mixed adapters in one step batch,
the file checks, and which adapters a DiT replica keeps resident."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from conftest import REPO

from omni_ray.config import ConfigError, LoraEntry, load_config, parse_config
from omni_ray.engine.lora_residency import LoraResidency
from omni_ray.errors import EngineError, NotFoundError, RequestError
from omni_ray.pipeline import Pipeline
from omni_ray.records import DenoiseParams, DenoiseRequest, LoraRef
from omni_ray.runners.denoise import DenoiseRunner
from omni_ray.runners.lora import read_lora
from testing.engines import AdapterRecordingDiT, run_batch
from testing.lora_files import make_adapter, to_kohya
from testing.numerics import assert_reordered
from testing.reference import PromptEncoder


@pytest.fixture(scope="module")
def adapters(tiny_dir, tmp_path_factory):
    """Adapters of different ranks, alphas and targets, and a copy of one in kohya's spelling."""
    root = tmp_path_factory.mktemp("loras")
    made = {
        "A": make_adapter(tiny_dir, root / "A", rank=4, alpha=8, seed=1),
        "B": make_adapter(tiny_dir, root / "B", rank=8, seed=2, metadata=False,
                          targets=("to_q", "to_v", "img_mlp.net.2", "txt_mlp.net.0.proj", "img_mod.1")),
    }
    made["B_kohya"] = to_kohya(made["B"], root / "B_kohya", alpha=4.0)
    return {name: str(path) for name, path in made.items()}


@pytest.fixture(scope="module")
def diffusers_pipe(tiny_dir):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(tiny_dir)


def diffusers_image(pipe, adapter: str | None, scale: float, body: dict, true_cfg_scale: float = 4.0) -> np.ndarray:
    if adapter is None:
        pipe.disable_lora()
    else:
        pipe.unload_lora_weights()
        pipe.load_lora_weights(adapter, adapter_name="x")
        pipe.set_adapters("x", scale)
    width, height = (int(side) for side in body["size"].split("x"))
    image = pipe(body["prompt"], negative_prompt=body.get("negative_prompt"), true_cfg_scale=true_cfg_scale,
                 height=height,
                 width=width, num_inference_steps=body["num_inference_steps"],
                 generator=torch.Generator("cpu").manual_seed(body["seed"]), output_type="np").images[0]
    return (image * 255).round().astype(np.uint8)


def test_a_request_with_an_adapter_equals_diffusers_load_lora_weights(tiny_dir, adapters, diffusers_pipe):
    """Through the whole in-process request path (vLLM encoder, step-batching DiT, VAE), adapters of rank 4 (alpha 8)
    and 8 (no config in the file), at scales 0.7 and 1.3, and the rank-8 one in kohya's spelling."""
    config = load_config(REPO / "stage_configs" / "qwen_image_tiny.yaml", model=str(tiny_dir))
    config = config.model_copy(update={"loras": {name: LoraEntry(path=adapters[file]) for name, file in
                                                  (("A", "A"), ("B", "B"), ("K", "B_kohya"))}})
    pipeline = Pipeline(config)
    try:
        body = {"prompt": "a red cat", "negative_prompt": "blurry", "size": "64x64", "num_inference_steps": 3,
                "seed": 5}
        (base,) = asyncio.run(pipeline.generate(body))
        for model, scale, path in (("A", 0.7, adapters["A"]), ("B", 1.3, adapters["B"]), ("K", 1.0, adapters["B"])):
            (ours,) = asyncio.run(pipeline.generate({**body, "model": model, "lora_scale": scale}))
            reference = diffusers_image(diffusers_pipe, path, scale, body)
            assert np.abs(ours.pixels.astype(int) - reference).max() <= 1, model
            assert np.abs(base.pixels.astype(int) - reference).max() > 20, model  # the adapter changes the image
        with pytest.raises(NotFoundError) as info:
            asyncio.run(pipeline.generate({**body, "model": "C"}))
        assert info.value.param == "model" and info.value.code == "model_not_found"
        with pytest.raises(RequestError) as info:
            asyncio.run(pipeline.generate({**body, "lora_scale": 0.5}))
        assert info.value.param == "lora_scale"
    finally:
        pipeline.shutdown()


def test_edits_take_adapters_too(edit_dir, tmp_path):
    """The edit preset's DiT (the input image's tokens beside the noisy ones) with an adapter equals diffusers'
    QwenImageEditPipeline after load_lora_weights."""
    from omni_ray.api.images import load_input_images
    from testing.reference import load_reference, reference_edit, source_image
    from testing.serving import file_bytes as png

    adapter = str(make_adapter(edit_dir, tmp_path / "E", rank=4, alpha=4, seed=3))
    config = load_config(REPO / "stage_configs" / "qwen_image_edit_tiny.yaml", model=str(edit_dir))
    config = config.model_copy(update={"loras": {"E": LoraEntry(path=adapter)}})
    source = source_image(180, 100, seed=1)
    pipeline = Pipeline(config)
    try:
        body = {"prompt": "make the disc blue", "negative_prompt": "blurry", "num_inference_steps": 3, "seed": 5}
        pixels = load_input_images([png(source)], config).vae[0]
        (ours,) = asyncio.run(pipeline.generate({**body, "model": "E", "lora_scale": 0.9}, pixels))
        (base,) = asyncio.run(pipeline.generate(body, pixels))
    finally:
        pipeline.shutdown()
    reference = load_reference(edit_dir)
    reference.load_lora_weights(adapter, adapter_name="E")
    reference.set_adapters("E", 0.9)
    expected = reference_edit(reference, config.edit.image_area, source, seed=5, prompt=body["prompt"],
                              negative_prompt="blurry", true_cfg_scale=4.0, num_inference_steps=3)
    assert ours.pixels.shape == expected.shape
    assert np.abs(ours.pixels.astype(int) - expected.astype(int)).max() <= 1
    assert np.abs(base.pixels.astype(int) - expected.astype(int)).max() > 20


# Qwen-Image-Lightning's scheduler settings (ModelTC/Qwen-Image-Lightning, generate_with_diffusers.py): a shift of 3
# at any size; its authors sample with 4 or 8 steps and true CFG off.
LIGHTNING = {"base_image_seq_len": 256, "base_shift": math.log(3), "max_image_seq_len": 8192, "max_shift": math.log(3),
             "shift": 1.0, "shift_terminal": None, "time_shift_type": "exponential", "use_dynamic_shifting": True}


def test_a_few_step_adapter_s_recipe_shares_step_batches_and_equals_diffusers(tiny_dir, adapters, diffusers_pipe,
                                                                               tmp_path):
    """An adapter whose recipe (beside its file) sets 4 steps, true CFG off and Lightning's scheduler, in step
    batches with a base-model request (6 steps) and a second adapter (5 steps): each image is diffusers' with its
    own settings (load_lora_weights, the recipe's scheduler), and a request's own fields win over the recipe."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    lightning = tmp_path / "lightning"
    shutil.copytree(adapters["A"], lightning)
    (lightning / "recipe.json").write_text(json.dumps(
        {"num_inference_steps": 4, "true_cfg_scale": 1.0, "scheduler": LIGHTNING}))
    data = yaml.safe_load((REPO / "stage_configs" / "qwen_image_tiny.yaml").read_text())
    data.update(model=str(tiny_dir), loras={"L": str(lightning), "B": adapters["B"]})
    config = parse_config(data)
    assert config.loras["L"].recipe.num_inference_steps == 4 and config.loras["B"].recipe is None
    pipeline = Pipeline(config)
    bodies = {
        "base": {"prompt": "a red cat", "size": "64x64", "num_inference_steps": 6, "seed": 5},
        "L": {"prompt": "a red cat", "negative_prompt": "blurry", "size": "64x64", "seed": 6, "model": "L"},
        "B": {"prompt": "a blue cup", "size": "64x64", "num_inference_steps": 5, "seed": 7, "model": "B"},
    }

    async def together():
        return await asyncio.gather(*(pipeline.generate(body) for body in bodies.values()))

    try:
        results = dict(zip(bodies, (images[0] for images in asyncio.run(together()))))
        assert max(pipeline.stages.dit.stats.core.batch_sizes) == 3  # all three in one step, each with its own sigmas
        (own,) = asyncio.run(pipeline.generate({**bodies["L"], "num_inference_steps": 2, "true_cfg_scale": 3.0}))
    finally:
        pipeline.shutdown()
    base_scheduler = diffusers_pipe.scheduler
    try:
        assert np.abs(results["base"].pixels.astype(int) - diffusers_image(diffusers_pipe, None, 1.0, bodies["base"]
                                                                            )).max() <= 1
        assert np.abs(results["B"].pixels.astype(int) - diffusers_image(diffusers_pipe, adapters["B"], 1.0,
                                                                        bodies["B"])).max() <= 1
        diffusers_pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config({**base_scheduler.config, **LIGHTNING})
        expected = diffusers_image(diffusers_pipe, adapters["A"], 1.0, {**bodies["L"], "num_inference_steps": 4},
                                   true_cfg_scale=1.0)
        assert np.abs(results["L"].pixels.astype(int) - expected).max() <= 1
        assert np.abs(results["base"].pixels.astype(int) - expected).max() > 20
        # The request's own steps and scale (CFG on, with its negative prompt) over the recipe's; its scheduler stays.
        expected = diffusers_image(diffusers_pipe, adapters["A"], 1.0, {**bodies["L"], "num_inference_steps": 2},
                                   true_cfg_scale=3.0)
        assert np.abs(own.pixels.astype(int) - expected).max() <= 1
    finally:
        diffusers_pipe.scheduler = base_scheduler


def test_a_bad_recipe_is_refused_naming_it(tiny_dir, adapters, tmp_path):
    data = yaml.safe_load((REPO / "stage_configs" / "qwen_image_tiny.yaml").read_text())
    data.update(model=str(tiny_dir), loras={"L": {"path": adapters["A"], "recipe": {"scheduler": {"shfit": 3}}}})
    with pytest.raises(ConfigError, match=r"loras.L.recipe: .*scheduler: shfit not among"):
        parse_config(data)
    beside = tmp_path / "beside"
    shutil.copytree(adapters["A"], beside)
    (beside / "recipe.json").write_text('{"num_inference_steps": 0}')
    data.update(loras={"L": str(beside)})
    with pytest.raises(ConfigError, match=r"loras.L.recipe: recipe file: num_inference_steps: .*greater than or equal"):
        parse_config(data)


@pytest.fixture(scope="module")
def runner(tiny_dir, adapters):
    runner = DenoiseRunner.load(str(tiny_dir), max_loras=2)
    for name in ("A", "B"):
        runner.add_lora((name, adapters[name]), read_lora(adapters[name], runner.lora_shapes))
    return runner


def test_a_step_batch_of_different_adapters_equals_each_alone(tiny_dir, adapters, runner):
    """Adapters A, B, none and A at another scale, with and without cache acceleration, in one step batch (true CFG,
    so each request's two passes use its adapter): each row equals its request run alone."""
    from omni_ray.config import CacheSettings

    encoder = PromptEncoder(str(tiny_dir))
    prompts = encoder.encode(["a red cat", "a lighthouse", "a cup of tea", "a red cat"])
    negatives = encoder.encode(["blurry", "blurry", "dark", "blurry"])
    choices = [LoraRef("A", adapters["A"], 1.0), LoraRef("B", adapters["B"], 0.8), None,
               LoraRef("A", adapters["A"], 0.4)]
    caches = [None, CacheSettings(kind="first_block", threshold=0.2), None, None]
    requests = [DenoiseRequest(f"r{i}", DenoiseParams(64, 64, 4, 7, 4.0, caches[i], true_cfg=True,
                                                       loras=(choices[i],) if choices[i] else ()), prompts[i],
                               negatives[i])
                for i in range(4)]

    def run(batch):
        return run_batch(runner, batch)

    together, batches = run(requests)
    assert max(len(batch) for batch in batches) == 4  # one batch of four
    alone = {}
    for request in requests:
        alone.update(run([request])[0])
    for request_id, latents in together.items():
        assert_reordered(latents.latents, alone[request_id].latents, request_id)
    # Rows 0 and 3 differ only by A's scale, 0 and 2 by adapter: the test would notice rows swapping adapters.
    assert (together["r0"].latents - together["r3"].latents).abs().max() > 0.05
    assert runner.states == {}


def test_broken_and_mismatched_files_are_refused_naming_lora_path(tiny_dir, adapters, runner, tmp_path):
    from safetensors.torch import save_file

    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    (tmp_path / "wrong").mkdir()
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 7),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(64, 4)},
              tmp_path / "wrong" / "pytorch_lora_weights.safetensors")
    (tmp_path / "unknown").mkdir()
    save_file({"transformer.no_such_layer.lora_A.weight": torch.zeros(4, 8),
               "transformer.no_such_layer.lora_B.weight": torch.zeros(8, 4)},
              tmp_path / "unknown" / "pytorch_lora_weights.safetensors")
    for path, says in ((tmp_path / "missing", "not a LoRA file"), (garbage, "not a LoRA file"),
                       (tmp_path / "wrong", "shapes"), (tmp_path / "unknown", "not a Linear layer")):
        with pytest.raises(RequestError, match=says) as info:
            read_lora(str(path), runner.lora_shapes)
        assert info.value.param == "lora_path"


def test_each_row_adds_its_own_update():
    """One adapted layer: a batch of rows with adapters A, B (another rank), none, and A at another scale gives each
    row what the row gives alone (float32 reordering aside: the matmuls block by the batch's rows); a row without an
    adapter gets the base layer's output."""
    from omni_ray.runners.lora import LoraLayer, LoraTable

    generator = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96))
    table = LoraTable(model, max_loras=2)
    for name, rank, scaling in (("A", 4, 2.0), ("B", 8, 1.0)):
        table.add((name, name), {"0": LoraLayer(torch.randn(rank, 64, generator=generator),
                                               torch.randn(96, rank, generator=generator), scaling)})
    x = torch.randn(4, 50, 64, generator=generator)
    choices = [LoraRef("A", "A"), LoraRef("B", "B", 0.8), None, LoraRef("A", "A", 0.4)]
    with torch.no_grad():
        with table.applied(table.rows([(c,) if c else () for c in choices])):
            together = model(x)
        for row, choice in enumerate(choices):
            with table.applied(table.rows([(choice,) if choice else ()])):
                assert_reordered(together[row], model(x[row : row + 1])[0], row)
        base = model[0].base(x)
    assert torch.equal(together[2], base[2]) and not torch.allclose(together[0], base[0])  # the same batch
    assert not torch.allclose(together[0], together[3])


def test_residency_keeps_at_most_max_loras_and_never_evicts_one_in_use():
    def reader(path, shapes):
        if path == "broken":
            raise RequestError("lora_path: broken", param="lora_path")
        return {}

    async def scenario():
        dit = AdapterRecordingDiT()
        residency = LoraResidency(dit, max_loras=2, files=SimpleNamespace(read=reader))
        ref = {name: LoraRef(name, name.lower()) for name in "ABCD"}
        async with residency.use((ref["A"],)):
            async with residency.use((ref["B"],)):
                pass
            async with residency.use((ref["A"],)):  # resident: no second load
                pass
            async with residency.use((ref["C"],)):  # B is the least recently used idle one
                assert dit.held == {ref["A"].key, ref["C"].key}
            # A (in use) and C (idle) are resident: C leaves for D, not A.
            async with residency.use((ref["D"],)):
                assert dit.held == {ref["A"].key, ref["D"].key}
        assert dit.log == [("add", "A"), ("add", "B"), ("remove", "B"), ("add", "C"), ("remove", "C"), ("add", "D")]

        # Both slots busy: a third adapter waits for a request to end.
        dit.log.clear()
        release = asyncio.Event()

        async def hold(name):
            async with residency.use((ref[name],)):
                await release.wait()

        holders = [asyncio.ensure_future(hold(name)) for name in "AB"]
        await asyncio.sleep(0.01)
        waiting = asyncio.ensure_future(hold("C"))
        await asyncio.sleep(0.01)
        assert not waiting.done() and len(dit.held) == 2
        release.set()
        await asyncio.gather(*holders, waiting)
        assert len(dit.held) == 2 and ref["C"].key in dit.held

        # A file that fails to load fails its request as an engine error and leaves no slot taken.
        with pytest.raises(EngineError, match="could not be loaded"):
            async with residency.use((LoraRef("X", "broken"),)):
                pass
        assert ("X", "broken") not in residency.resident and dit.held == set(residency.resident)

    asyncio.run(scenario())
