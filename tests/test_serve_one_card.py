"""The one-card layout served (issue 50): the tiny checkpoint with the one-card presets' settings, on a local cluster:
the DiT from a Q4_0 GGUF file with one of its two blocks streamed through the device, the VAE decoding in bands, the
encoder on the transformers runner, and the three stages sharing one device and taking turns on it (``card``), the
encoder's weights off it between its turns, as `qwen_image_24gb_card.yaml` and its kin run them on a card. An image
within one level of diffusers' QwenImagePipeline on the same file through diffusers' own GGUF loader; 48 requests of
the soak's mix, 16 at a time (a tenth invalid, a quarter streamed, n 1 to 3, clients that leave): none lost, the
streamed blocks on the device never past the kept one plus two, and the card's ledger (one Ray actor) showing no two
turns at once and the encoder holding nothing between its turns."""

import concurrent.futures
import json

import numpy as np
import pytest
import torch
import yaml
from conftest import REPO
from diffusers import GGUFQuantizationConfig, QwenImagePipeline, QwenImageTransformer2DModel

from benchmarks.soak import Client, one_request
from omni_ray.checkpoints import gguf as gguf_file
from testing.local_serve import LocalServe
from testing.serving import png, post, stage_stats

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def weights(tiny_dir, tmp_path_factory):
    return gguf_file.write(tiny_dir, tmp_path_factory.mktemp("one-card") / "tiny-Q4_0.gguf", "Q4_0")


@pytest.fixture(scope="module")
def served(tiny_dir, weights):
    preset = yaml.safe_load((REPO / "stage_configs" / "qwen_image_tiny.yaml").read_text())
    preset["encoder"]["runner"] = "transformers"
    preset["dit"].update(weights_file=str(weights), offload={"blocks_on_gpu": 1})
    preset["vae"]["tiling"] = True
    preset["card"] = {"stages": ["encoder", "dit", "vae"]}  # one device, taking turns
    with LocalServe(REPO / "config.yaml", model=str(tiny_dir), preset=preset) as local:
        yield {"base": local.base_url, "address": local.address}


def test_an_image_is_diffusers_on_the_same_gguf_file(served, tiny_dir, weights):
    body = {"prompt": "a red cat", "negative_prompt": "blurry", "size": "96x64", "num_inference_steps": 4,
            "seed": 7, "true_cfg_scale": 4.0, "response_format": "b64_json"}
    status, reply = post(served["base"] + "/v1/images/generations", body)
    assert status == 200, reply
    transformer = QwenImageTransformer2DModel.from_single_file(
        str(weights), config=str(tiny_dir), subfolder="transformer", torch_dtype=torch.float32,
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32))
    pipe = QwenImagePipeline.from_pretrained(tiny_dir, transformer=transformer)
    expected = pipe(prompt="a red cat", negative_prompt="blurry", width=96, height=64, num_inference_steps=4,
                    true_cfg_scale=4.0, generator=torch.Generator("cpu").manual_seed(7), output_type="np").images[0]
    expected = (expected * 255).round().astype(np.uint8)
    got = png(reply["data"][0]["b64_json"])
    assert got.shape == expected.shape and expected.std() > 10
    assert np.abs(got.astype(int) - expected.astype(int)).max() <= 1


def test_sixteen_at_a_time_of_a_mixed_load_lose_none(served):
    client = Client(served["base"])
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(lambda i: one_request(client, i, "", 300, sizes=("64x64", "96x64", "64x96")),
                                 range(48)))
    problems = [(kind, problem) for kind, problem, _ in outcomes if problem is not None]
    kinds = {kind for kind, _, _ in outcomes}
    assert not problems, problems[:5]
    assert {"invalid", "json", "streamed", "cancelled"} <= kinds, kinds
    stats = stage_stats({"address": served["address"]})
    dit = stats["DiT"]
    assert dit["offload"]["kept"] == 1 and dit["offload"]["peak"] == 2 and dit["offload"]["fetches"] > 48, \
        json.dumps(dit["offload"])
    assert max(int(size) for size in dit["batch_sizes"]) > 1  # the streamed DiT batched its steps
    # the three stages took turns on the one device, never two at once; the encoder's weights came for each of its
    # turns and left after it; every stage's holdings counted by the card's ledger
    card = dit["card"]["card"]
    assert card["overlaps"] == 0, card
    assert {stage: stats[name]["card"]["turns"] for stage, name in STAGES.items()} == card["turns"], card
    assert card["turns"]["dit"] >= 20 and card["turns"]["vae"] >= 10 and card["turns"]["encoder"] >= 5, card
    assert card["held_bytes"]["encoder"] == 0 and card["turn_peak_bytes"]["encoder"] > 0, card
    assert card["held_bytes"]["dit"] > 0 and card["held_bytes"]["vae"] > 0, card
    others = card["held_bytes"]["dit"] + card["held_bytes"]["vae"]
    assert others <= card["peak_bytes"] <= others + max(card["turn_peak_bytes"].values()), card


STAGES = {"encoder": "Encoder", "dit": "DiT", "vae": "VAE"}
