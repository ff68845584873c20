"""Stacks of LoRA adapters in one request (issue 52): a stack equals diffusers' ``set_adapters`` with the same weights,
a recipe adapter stacked with a style one brings its recipe, a step mixing stacks, single adapters and none gives
each row what it gives alone, and residency takes a stack whole (the refusals: tests/test_ingress.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from conftest import REPO

from omni_ray.config import parse_config
from omni_ray.engine.lora_residency import LoraResidency
from omni_ray.pipeline import Pipeline
from omni_ray.records import DenoiseParams, DenoiseRequest, LoraRef
from omni_ray.runners.denoise import DenoiseRunner
from omni_ray.runners.lora import LoraLayer, LoraTable, read_lora
from testing.engines import AdapterRecordingDiT, run_batch
from testing.lora_files import make_adapter
from testing.numerics import assert_reordered
from testing.reference import PromptEncoder

ATTENTION = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
# Qwen-Image-Lightning's scheduler settings (as tests/test_lora.py): its recipe, with 4 steps and true CFG off.
LIGHTNING = {"base_image_seq_len": 256, "base_shift": 1.0986122886681098, "max_image_seq_len": 8192,
             "max_shift": 1.0986122886681098, "shift": 1.0, "shift_terminal": None, "time_shift_type": "exponential",
             "use_dynamic_shifting": True}


@pytest.fixture(scope="module")
def adapters(tiny_dir, tmp_path_factory) -> dict[str, str]:
    """A (rank 4, alpha 8, every target), T (rank 8, alpha 16, attention only), B (rank 2, three modules), and L: A's
    weights with Lightning's recipe beside them."""
    root = tmp_path_factory.mktemp("stacks")
    made = {"A": make_adapter(tiny_dir, root / "A", rank=4, alpha=8, seed=1),
            "T": make_adapter(tiny_dir, root / "T", rank=8, alpha=16, seed=4, targets=ATTENTION),
            "B": make_adapter(tiny_dir, root / "B", rank=2, seed=2, targets=("to_q", "img_mlp.net.2",
                                                                           "txt_mlp.net.0.proj"))}
    shutil.copytree(made["A"], root / "L")
    (root / "L" / "recipe.json").write_text(json.dumps({"num_inference_steps": 4, "true_cfg_scale": 1.0,
                                                         "scheduler": LIGHTNING}))
    return {**{name: str(path) for name, path in made.items()}, "L": str(root / "L")}


def diffusers_stack(tiny_dir, stack: list[tuple[str, str, float]], body: dict, true_cfg_scale: float = 4.0,
                    scheduler: dict | None = None) -> np.ndarray:
    """diffusers' image with the adapters loaded by name and weighted with ``set_adapters``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(tiny_dir)
    for name, path, _ in stack:
        pipe.load_lora_weights(path, adapter_name=name)
    pipe.set_adapters([name for name, _, _ in stack], adapter_weights=[weight for _, _, weight in stack])
    if scheduler is not None:
        pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config({**pipe.scheduler.config, **scheduler})
    width, height = (int(side) for side in body["size"].split("x"))
    image = pipe(body["prompt"], negative_prompt=body.get("negative_prompt"), true_cfg_scale=true_cfg_scale,
                 height=height, width=width, num_inference_steps=body["num_inference_steps"],
                 generator=torch.Generator("cpu").manual_seed(body["seed"]), output_type="np").images[0]
    return (image * 255).round().astype(np.uint8)


def preset(tiny_dir, adapters: dict[str, str], **dit) -> Pipeline:
    data = yaml.safe_load((REPO / "stage_configs" / "qwen_image_tiny.yaml").read_text())
    data.update(model=str(tiny_dir), loras=adapters)
    data["dit"].update(dit)
    return parse_config(data)


@pytest.mark.vllm
def test_a_stack_equals_diffusers_set_adapters_and_a_recipe_adapter_in_one_brings_its_recipe(tiny_dir, adapters):
    """Through the whole in-process request path: A at 1.0 with T (another rank, attention only) at 0.6 is diffusers'
    ``set_adapters(["A", "T"], adapter_weights=[1.0, 0.6])``; L (Lightning's recipe) with T at 0.6 is that with L's
    steps, true CFG off and its scheduler, though the request sends a negative prompt."""
    pipeline = Pipeline(preset(tiny_dir, adapters))
    body = {"prompt": "a red cat", "negative_prompt": "blurry", "size": "64x64", "num_inference_steps": 3, "seed": 5}
    stack = [{"name": "A", "scale": 1.0}, {"name": "T", "scale": 0.6}]
    try:
        (stacked,) = asyncio.run(pipeline.generate({**body, "loras": stack}))
        (alone,) = asyncio.run(pipeline.generate({**body, "model": "A"}))
        recipe_body = {k: v for k, v in body.items() if k != "num_inference_steps"}
        (fast,) = asyncio.run(pipeline.generate({**recipe_body, "loras": [{"name": "L"}, {"name": "T", "scale": 0.6}]}))
    finally:
        pipeline.shutdown()
    expected = diffusers_stack(tiny_dir, [("A", adapters["A"], 1.0), ("T", adapters["T"], 0.6)], body)
    assert np.abs(stacked.pixels.astype(int) - expected).max() <= 1
    assert np.abs(alone.pixels.astype(int) - expected).max() > 10  # T's share shows
    expected = diffusers_stack(tiny_dir, [("L", adapters["L"], 1.0), ("T", adapters["T"], 0.6)],
                               {**body, "num_inference_steps": 4}, true_cfg_scale=1.0, scheduler=LIGHTNING)
    assert np.abs(fast.pixels.astype(int) - expected).max() <= 1


def test_a_step_of_stacks_single_adapters_and_none_gives_each_row_what_it_gives_alone(tiny_dir, adapters):
    """One step batch (true CFG: each request's two passes use its stack): A+T, A alone at another scale, T+B, none,
    and B+A with a first-block cache; each row equals its request run alone."""
    from omni_ray.config import CacheSettings

    runner = DenoiseRunner.load(str(tiny_dir), max_loras=3)
    for name in "ATB":
        runner.add_lora((name, adapters[name]), read_lora(adapters[name], runner.lora_shapes))
    ref = {name: LoraRef(name, adapters[name]) for name in "ATB"}
    stacks = [(ref["A"], dataclasses.replace(ref["T"], scale=0.6)), (dataclasses.replace(ref["A"], scale=0.4),),
              (ref["T"], dataclasses.replace(ref["B"], scale=0.5)), (),
              (dataclasses.replace(ref["B"], scale=0.8), dataclasses.replace(ref["A"], scale=0.3))]
    caches = [None, None, None, None, CacheSettings(kind="first_block", threshold=0.2)]
    encoder = PromptEncoder(str(tiny_dir))
    prompts = encoder.encode(["a red cat", "a red cat", "a lighthouse", "a cup of tea", "a red cat"])
    negatives = encoder.encode(["blurry"] * 5)
    requests = [DenoiseRequest(f"r{i}", DenoiseParams(64, 64, 4, 7, 4.0, caches[i], loras=stacks[i], true_cfg=True),
                               prompts[i], negatives[i]) for i in range(5)]

    def run(batch):
        return run_batch(runner, batch)

    together, batches = run(requests)
    assert max(len(batch) for batch in batches) == 5  # one batch of five
    for request in requests:
        (alone,) = run([request])[0].values()
        assert_reordered(together[request.request_id].latents, alone.latents, request.request_id)
    assert (together["r0"].latents - together["r1"].latents).abs().max() > 0.05  # the stacks matter


def test_a_stacked_row_adds_each_adapter_s_update_at_its_scale():
    """One adapted layer: a row stacking A (rank 4) and B (rank 8, another scaling) gets the base output plus each
    adapter's update at its scale, what the row gets from each alone; rows with one adapter or none are unchanged by
    the stack beside them."""
    generator = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96))
    table = LoraTable(model, max_loras=2)
    for name, rank, scaling in (("A", 4, 2.0), ("B", 8, 1.0)):
        table.add((name, name), {"0": LoraLayer(torch.randn(rank, 64, generator=generator),
                                               torch.randn(96, rank, generator=generator), scaling)})
    a, b = LoraRef("A", "A", 0.7), LoraRef("B", "B", 0.3)
    x = torch.randn(4, 50, 64, generator=generator)
    stacks = [(a, b), (a,), (), (b, a)]
    with torch.no_grad():
        with table.applied(table.rows(stacks)):
            together = model(x)
        base = model[0].base(x)
        alone = {}
        for lora in (a, b):
            with table.applied(table.rows([(lora,)] * 4)):
                alone[lora.name] = model(x) - base
    expected = base + torch.stack([alone["A"][0] + alone["B"][0], alone["A"][1], 0 * base[2],
                                   alone["A"][3] + alone["B"][3]])
    assert torch.allclose(together, expected, atol=1e-4)
    assert torch.equal(together[2], base[2])


def test_residency_takes_a_stack_whole_and_two_stacks_needing_every_slot_never_wait_on_each_other():
    async def scenario():
        dit = AdapterRecordingDiT()
        residency = LoraResidency(dit, max_loras=2, files=SimpleNamespace(read=lambda path, shapes: {}))
        ref = {name: LoraRef(name, name.lower()) for name in "ABCD"}
        async with residency.use((ref["A"], ref["B"])):
            assert dit.held == {ref["A"].key, ref["B"].key}
        async with residency.use((ref["C"],)):  # A, the least recently used idle one, leaves
            assert dit.held == {ref["B"].key, ref["C"].key}
            async with residency.use((ref["C"], ref["B"])):  # both resident: nothing loads
                pass
        assert dit.log == [("add", "A"), ("add", "B"), ("remove", "A"), ("add", "C")]

        # Stacks that each need both slots, and a single adapter, all at once: a stack waits holding nothing while
        # another's adapters are in use, so every one runs (none waits on a slot a waiting request holds), each
        # with all its adapters resident.
        running, order = [], []

        async def hold(*names):
            async with residency.use(tuple(ref[name] for name in names)):
                running.append(names)
                assert {ref[name].key for held in running for name in held} <= dit.held and len(dit.held) <= 2
                order.append(names)
                await asyncio.sleep(0.01)
                running.remove(names)

        await asyncio.wait_for(asyncio.gather(hold("A", "B"), hold("C", "D"), hold("A"), hold("D", "C")), 5)
        assert sorted(order) == [("A",), ("A", "B"), ("C", "D"), ("D", "C")]
        assert len(dit.held) <= 2 and residency.resident.keys() == dit.held
        assert all(entry.users == 0 for entry in residency.resident.values())

    asyncio.run(scenario())


@pytest.mark.vllm
def test_sixteen_concurrent_requests_alternating_three_stacks_on_two_slots_all_finish(tiny_dir, adapters):
    """``max_loras: 2`` and stacks A+T, T+B and B alone, 16 requests at once: stacks that cannot all be resident
    wait and then run; none is lost, and each image equals the same request's alone."""
    pipeline = Pipeline(preset(tiny_dir, {name: adapters[name] for name in "ATB"}, max_loras=2, max_batch_size=4))
    stacks = [[{"name": "A"}, {"name": "T", "scale": 0.6}], [{"name": "T"}, {"name": "B", "scale": 0.5}],
              [{"name": "B", "scale": 0.8}]]
    bodies = [{"prompt": "a red cat", "size": "64x64", "num_inference_steps": 2, "seed": i % 3,
               "loras": stacks[i % 3]} for i in range(16)]

    async def all_at_once():
        return await asyncio.wait_for(asyncio.gather(*(pipeline.generate(body) for body in bodies)), 300)

    try:
        results = [images[0] for images in asyncio.run(all_at_once())]
        alone = [asyncio.run(pipeline.generate(body))[0] for body in bodies[:3]]
        loads = pipeline.stages.loras.num_loads
    finally:
        pipeline.shutdown()
    assert len(results) == 16
    for i, result in enumerate(results):
        assert np.abs(result.pixels.astype(int) - alone[i % 3].pixels.astype(int)).max() <= 1, i
    assert loads > 3  # adapters left and came back: the stacks did not all fit at once
