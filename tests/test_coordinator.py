"""The coordinator passes each stage's response to the next by reference and awaits only the last one.

Fake handles stand in for the stages (the engines are not the subject): they record what each `.remote` received
and whether anyone awaited a response.
"""

import asyncio

import pytest

from deployments.chains import gather_or_cancel
from deployments.coordinator import Coordinator
from omni_ray.protocol import GenerationPlan, parse_request
from omni_ray.stages.decode import Decoded
from omni_ray.stages.denoise import DenoiseParams, Latents


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


def plan(**body):
    return GenerationPlan(parse_request({"prompt": "a cat", **body}), 64, 64, 2, seed=0)


def coordinator(encoder, dit, vae):
    fake = type("Self", (), {})()
    fake.encoder, fake.dit, fake.vae = encoder, dit, vae
    fake.encode = lambda *args: Coordinator.encode(fake, *args)
    return fake


def test_each_stage_receives_the_previous_response_itself():
    encoder, dit, vae = stages()
    request = plan(negative_prompt="blurry", true_cfg_scale=4)
    chain = Coordinator.chain(coordinator(encoder, dit, vae), "r-0", request, DenoiseParams(64, 64, 2, 0, 4.0), "pixels")
    (encode_args, encoded), = encoder.encode.calls
    (denoise_args, denoised), = dit.denoise.calls
    (decode_args, decoded), = vae.decode.calls
    assert encode_args[0].negative_prompt == "blurry"
    assert denoise_args[2] is encoded  # the DeploymentResponse object, not its value
    assert decode_args[1] is denoised
    assert chain == [encoded, denoised, decoded]
    assert not any(response.awaited for response in chain)


def test_only_the_last_response_is_awaited():
    encoder, dit, vae = stages()
    request = plan(n=3)
    chains = [
        Coordinator.chain(coordinator(encoder, dit, vae), f"r-{i}", request, DenoiseParams(64, 64, 2, i), "pixels")
        for i in range(3)
    ]
    results = asyncio.run(gather_or_cancel(chains))
    assert len(results) == 3
    assert all(chain[-1].awaited and not chain[0].awaited and not chain[1].awaited for chain in chains)


def test_latents_mode_skips_the_vae():
    encoder, dit, vae = stages()
    latents = Latents(latents=None, height=64, width=64)
    dit.denoise.result = latents
    request = plan()
    chain = Coordinator.chain(coordinator(encoder, dit, vae), "r", request, DenoiseParams(64, 64, 2, 0), "latents")
    assert vae.decode.calls == [] and len(chain) == 2
    (result,) = asyncio.run(gather_or_cancel([chain]))
    assert result.latents is latents and result.pixels is None


def test_a_failing_chain_cancels_every_stage_call():
    from omni_ray.errors import EngineError

    encoder, dit, vae = stages()
    request = plan(n=2)
    ok = Coordinator.chain(coordinator(encoder, dit, vae), "ok", request, DenoiseParams(64, 64, 2, 0), "pixels")
    vae.decode.result = EngineError("out of memory", "vae")
    bad = Coordinator.chain(coordinator(encoder, dit, vae), "bad", request, DenoiseParams(64, 64, 2, 1), "pixels")
    with pytest.raises(EngineError, match="vae: out of memory"):
        asyncio.run(gather_or_cancel([ok, bad]))
    assert all(response.cancelled for response in ok + bad)


def test_the_deadline_aborts_every_stage_call():
    from types import SimpleNamespace

    from omni_ray.errors import DeadlineExceededError

    encoder, dit, vae = stages()
    vae.decode.result = "hang"
    fake = coordinator(encoder, dit, vae)
    fake.config = SimpleNamespace(requests=SimpleNamespace(timeout_s=0.2))
    fake.chain = lambda *args: Coordinator.chain(fake, *args)
    fake.params = lambda *args: Coordinator.params(fake, *args)
    with pytest.raises(DeadlineExceededError, match="0.2 s deadline"):
        asyncio.run(Coordinator.run(fake, plan(n=2), "slow"))
    responses = [response for method in (encoder.encode, dit.denoise, vae.decode) for _, response in method.calls]
    assert len(responses) == 6 and all(response.cancelled for response in responses)


def test_a_full_stage_queue_is_a_503_with_retry_after():
    import json

    from ray.serve.exceptions import BackPressureError

    from deployments.coordinator import _omni_ray_error
    from omni_ray.errors import OverloadedError

    encoder, dit, vae = stages()
    vae.decode.result = BackPressureError(num_queued_requests=8, max_queued_requests=8)
    chain = Coordinator.chain(coordinator(encoder, dit, vae), "busy", plan(), DenoiseParams(64, 64, 2, 0), "pixels")
    with pytest.raises(OverloadedError) as info:
        asyncio.run(gather_or_cancel([chain]))
    response = asyncio.run(_omni_ray_error(None, info.value))
    assert response.status_code == 503 and int(response.headers["retry-after"]) >= 1
    assert json.loads(response.body)["error"]["type"] == "overloaded_error"
