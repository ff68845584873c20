"""The coordinator passes each stage's response to the next by reference and awaits only the last one.

Fake handles stand in for the stages (the engines are not the subject): they record what each `.remote` received
and whether anyone awaited a response.
"""

import asyncio
from functools import partial
from types import SimpleNamespace

import pytest

from deployments.chains import gather_or_cancel
from deployments.coordinator import Coordinator
from omni_ray.protocol import GenerationPlan, parse_request
from omni_ray.stages.decode import Decoded
from omni_ray.stages.denoise import Latents


class FakeResponse:
    def __init__(self, name, result):
        self.name, self.result = name, result
        self.awaited = self.cancelled = False

    def __await__(self):
        self.awaited = True
        yield from asyncio.sleep(3600 if self.result == "hang" else 0).__await__()
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result

    def cancel(self):
        self.cancelled = True


class FakeMethod:
    def __init__(self, name, result):
        self.name, self.result, self.calls = name, result, []

    def remote(self, *args):
        response = FakeResponse(self.name, self.result)
        self.calls.append((args, response))
        return response


class FakeHandle:
    def __init__(self, method, result):
        setattr(self, method, FakeMethod(method, result))


def stages(vae_result=None):
    decoded = vae_result if vae_result is not None else Decoded(pixels=None, latents=None)
    return (FakeHandle("encode", "embeds"), FakeHandle("denoise", "latents"), FakeHandle("decode", decoded))


def plan(image=None, **body):
    return GenerationPlan(parse_request({"prompt": "a cat", **body}), 64, 64, 2, seed=0, image=image)


def coordinator(encoder, dit, vae, timeout_s=600.0):
    fake = SimpleNamespace(encoder=encoder, dit=dit, vae=vae)
    fake.config = SimpleNamespace(requests=SimpleNamespace(timeout_s=timeout_s))
    for method in ("inputs", "chain", "params"):
        setattr(fake, method, partial(getattr(Coordinator, method), fake))
    return fake


def chains(fake, request, output="pixels"):
    inputs = fake.inputs("r", request)
    return [fake.chain(f"r-{i}", request, i, inputs, output) for i in range(request.request.n)]


def test_each_stage_receives_the_previous_response_itself():
    encoder, dit, vae = stages()
    request = plan(negative_prompt="blurry", true_cfg_scale=4)
    (chain,) = chains(coordinator(encoder, dit, vae), request)
    (encode_args, encoded), = encoder.encode.calls
    (denoise_args, denoised), = dit.denoise.calls
    (decode_args, decoded), = vae.decode.calls
    assert encode_args[0].negative_prompt == "blurry" and encode_args[1] is None  # no image: text to image
    assert denoise_args[1].true_cfg_scale == 4.0
    assert denoise_args[2] is encoded  # the DeploymentResponse object, not its value
    assert decode_args[1] is denoised
    assert chain == [encoded, denoised, decoded]
    assert not any(response.awaited for response in chain)


def test_the_prompt_is_encoded_once_for_n_images_each_with_its_seed():
    encoder, dit, vae = stages()
    request = plan(n=3)  # planned with seed 0
    image_chains = chains(coordinator(encoder, dit, vae), request)
    (_, encoded), = encoder.encode.calls
    assert [args[1].seed for args, _ in dit.denoise.calls] == [0, 1, 2]
    assert all(args[2] is encoded for args, _ in dit.denoise.calls)
    assert [chain[0] for chain in image_chains] == [encoded] * 3


def test_an_edit_puts_its_image_once_and_the_encoder_and_vae_read_it_by_reference(monkeypatch):
    import numpy as np

    put = []
    monkeypatch.setattr("deployments.coordinator.ray.put", lambda value: put.append(value) or "image-ref")
    encoder, dit, vae = stages()
    vae.encode = FakeMethod("encode", "image-latents")
    pixels = np.zeros((32, 64, 3), dtype=np.uint8)
    image_chains = chains(coordinator(encoder, dit, vae), plan(image=pixels, n=2))
    assert len(put) == 1 and put[0] is pixels
    (encode_args, encoded), = encoder.encode.calls
    (image_args, image_latents), = vae.encode.calls
    assert encode_args[1] == "image-ref" and image_args == ("r", "image-ref")
    for args, _ in dit.denoise.calls:
        assert args[2] is encoded and args[3] is image_latents
    assert all(chain[:2] == [encoded, image_latents] for chain in image_chains)


def test_only_the_last_response_is_awaited():
    encoder, dit, vae = stages()
    image_chains = chains(coordinator(encoder, dit, vae), plan(n=3))
    results = asyncio.run(gather_or_cancel(image_chains))
    assert len(results) == 3
    assert all(chain[-1].awaited and not chain[0].awaited and not chain[1].awaited for chain in image_chains)


def test_latents_mode_skips_the_vae():
    encoder, dit, vae = stages()
    latents = Latents(latents=None, height=64, width=64)
    dit.denoise.result = latents
    (chain,) = chains(coordinator(encoder, dit, vae), plan(), "latents")
    assert vae.decode.calls == [] and len(chain) == 2
    (result,) = asyncio.run(gather_or_cancel([chain]))
    assert result.latents is latents and result.pixels is None


def test_a_failing_chain_cancels_every_stage_call():
    from omni_ray.errors import EngineError

    encoder, dit, vae = stages()
    fake = coordinator(encoder, dit, vae)
    request = plan(n=2)
    inputs = fake.inputs("r", request)
    ok = fake.chain("r-0", request, 0, inputs, "pixels")
    vae.decode.result = EngineError("out of memory", "vae")
    bad = fake.chain("r-1", request, 1, inputs, "pixels")
    with pytest.raises(EngineError, match="vae: out of memory"):
        asyncio.run(gather_or_cancel([ok, bad]))
    assert all(response.cancelled for response in ok + bad)


def test_the_deadline_aborts_every_stage_call():
    from omni_ray.errors import DeadlineExceededError

    encoder, dit, vae = stages()
    vae.decode.result = "hang"
    fake = coordinator(encoder, dit, vae, timeout_s=0.2)
    with pytest.raises(DeadlineExceededError, match="0.2 s deadline"):
        asyncio.run(Coordinator.run(fake, plan(n=2), "slow"))
    responses = [response for method in (encoder.encode, dit.denoise, vae.decode) for _, response in method.calls]
    assert len(responses) == 5 and all(response.cancelled for response in responses)


def test_a_full_stage_queue_is_a_503_with_retry_after():
    import json

    from ray.serve.exceptions import BackPressureError

    from deployments.coordinator import _omni_ray_error
    from omni_ray.errors import OverloadedError

    encoder, dit, vae = stages()
    vae.decode.result = BackPressureError(num_queued_requests=8, max_queued_requests=8)
    (chain,) = chains(coordinator(encoder, dit, vae), plan())
    with pytest.raises(OverloadedError) as info:
        asyncio.run(gather_or_cancel([chain]))
    response = asyncio.run(_omni_ray_error(None, info.value))
    assert response.status_code == 503 and int(response.headers["retry-after"]) >= 1
    assert json.loads(response.body)["error"]["type"] == "overloaded_error"


def test_an_image_sent_through_the_handle_to_a_text_to_image_app_is_refused(tiny_dir):
    from omni_ray.config import load_config
    from omni_ray.errors import RequestError
    from omni_ray.stages.encode import PromptTokenizer

    from conftest import REPO

    config = load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir))
    fake = SimpleNamespace(config=config, tokenizer=PromptTokenizer(config.model))
    with pytest.raises(RequestError, match="does not edit images") as info:
        asyncio.run(Coordinator.plan(fake, {"prompt": "a cat"}, image=b"\x89PNG..."))
    assert info.value.param == "image"
    plan = asyncio.run(Coordinator.plan(fake, {"prompt": "a cat"}))
    assert plan.image is None and plan.request.prompt == "a cat"
