"""docs/adding-a-family.md, done by a test: a family defined and registered here alone (its own preset, checkpoint
writer, rules and a trivial DiT runner), which the config, the checkpoint step, the API's planning and the DiT's
builder then serve without any other file knowing it."""

import json
import pathlib

import pytest
import torch
import yaml
from conftest import REPO

from omni_ray import families
from omni_ray.api.planning import plan_request
from omni_ray.checkpoints import ensure
from omni_ray.config import ConfigError, parse_config
from omni_ray.engine.builders import build_dit_core
from omni_ray.errors import RequestError
from omni_ray.families.base import Family
from omni_ray.records import DenoiseOutput, DenoiseParams, DenoiseRequest, Latents, PromptEmbeds
from testing.engines import run_to_completion


class ToyDenoiser:
    """The trivial DiT runner: each request's latents are its seed, after as many steps as it asks for."""

    lora_shapes: dict = {}

    def __init__(self):
        self.steps: dict[str, list[int]] = {}

    def execute_model(self, batch) -> DenoiseOutput:
        output = DenoiseOutput()
        for request in batch.new_requests:
            self.steps[request.request_id] = [0, request.params.num_inference_steps, request.params]
        for request_id in batch.request_ids:
            state = self.steps[request_id]
            state[0] += 1
            output.progress[request_id] = (state[0], state[1])
            if state[0] == state[1]:
                params = self.steps.pop(request_id)[2]
                tokens = (params.height // ToyImage.side_multiple) * (params.width // ToyImage.side_multiple)
                output.finished[request_id] = Latents(torch.full((tokens, 4), float(params.seed)), params.height,
                                                      params.width)
        return output


class ToyImage(Family):
    name = "toy-image"
    title = "Toy-Image"
    pipeline_class = "ToyImagePipeline"
    side_multiple = 64
    rgba = True

    def check_preset(self, config) -> None:
        super().check_preset(config)
        if config.edit is not None:
            raise ValueError("edit: Toy-Image draws from text alone")

    def write_checkpoint(self, model_dir: pathlib.Path, config) -> None:
        model_dir.mkdir(parents=True)
        (model_dir / "model_index.json").write_text(json.dumps({"_class_name": self.pipeline_class}))

    def check_route(self, config, has_image: bool, has_mask: bool) -> None:
        if has_image or has_mask:
            raise RequestError(f"image: {config.name!r} draws from text alone; use /v1/images/generations",
                               param="image")

    def build_dit_runner(self, config, mesh=None):
        return ToyDenoiser()


@pytest.fixture
def toy(tmp_path):
    """The toy family registered, and its preset: the tiny one's stages, sides multiples of 64."""
    families.register(ToyImage.name, ToyImage)
    preset = yaml.safe_load((REPO / "stage_configs" / "qwen_image_tiny.yaml").read_text())
    preset.update(name="toy", family="toy-image", model=str(tmp_path / "toy"))
    preset["requests"].update(default_width=128, default_height=128, min_side=64, max_side=256)
    yield preset
    families.unregister(ToyImage.name)


def test_a_family_registered_from_a_test_is_checked_planned_refused_and_built(toy, tmp_path):
    config = ensure(parse_config(toy))  # its writer wrote its checkpoint; the checkpoint step read it back
    assert config.pipeline == "ToyImagePipeline" and (tmp_path / "toy" / "model_index.json").is_file()

    # Its preset rules, asked by the config.
    with pytest.raises(ConfigError, match="requests.max_side 200 is not a multiple of 64"):
        parse_config({**toy, "requests": {**toy["requests"], "max_side": 200}})
    with pytest.raises(ConfigError, match="edit: Toy-Image draws from text alone"):
        parse_config({**toy, "edit": {}})
    with pytest.raises(ConfigError, match="dit.cache_memory_bytes: Toy-Image keeps no condition cache"):
        parse_config({**toy, "dit": {**toy["dit"], "cache_memory_bytes": 1 << 20}})
    with pytest.raises(ConfigError, match="family: one of .*toy-image, got 'toy-imag'"):
        parse_config({**toy, "family": "toy-imag"})

    # Its request rules, asked by the API's planning: sides of 64, RGBA, no ControlNets, no images.
    plan = plan_request({"prompt": "a red cat", "size": "192x128", "background": "transparent", "seed": 7}, config)
    assert (plan.width, plan.height, plan.rgba, plan.num_inference_steps) == (192, 128, True, 8)
    with pytest.raises(RequestError, match="width 96 is not a multiple of 64") as refused:
        plan_request({"prompt": "a red cat", "size": "96x128"}, config)
    assert refused.value.param == "size"
    with pytest.raises(RequestError, match="ControlNets are Qwen-Image's; Toy-Image presets take none") as refused:
        plan_request({"prompt": "a red cat", "control": [{"name": "canny"}]}, config)
    assert refused.value.param == "control"
    with pytest.raises(RequestError, match="'toy' draws from text alone") as refused:
        plan_request({"prompt": "a red cat"}, config, has_image=True)
    assert refused.value.param == "image"

    # Its runner, built by the DiT's builder and stepped by the shared engine.
    core = build_dit_core(config)
    params = DenoiseParams(plan.height, plan.width, plan.num_inference_steps, plan.seed)
    core.add_request(DenoiseRequest("toy-1", params, PromptEmbeds(torch.zeros(5, 8))))
    results, batches = run_to_completion(core)
    assert isinstance(core.runner, ToyDenoiser) and len(batches) == plan.num_inference_steps
    latents = results["toy-1"]
    assert latents.latents.shape == (3 * 2, 4) and torch.all(latents.latents == 7)
