"""The one request path (run_request) over a fake Stages: what it sends to each stage, which handles it passes on,
fan-out, retries of lost calls, failures, the deadline and cancellation. The engines are not the subject here;
test_serve.py runs the same path over the real stage deployments."""

import asyncio
import dataclasses

import numpy as np
import pytest

from omni_ray.api.planning import GenerationPlan
from omni_ray.api.schema import parse_request
from omni_ray.config import RequestLimits
from omni_ray.errors import DeadlineExceededError, EngineError, OverloadedError, StageCall, StageLostError
from omni_ray.families.qwen_image.facts import uses_true_cfg
from omni_ray.records import Inpaint, InputImages
from omni_ray.request_path import Failed, ImageDone, Progress, collect, run_request
from testing.fake_stages import FakeStages

LIMITS = RequestLimits(default_width=64, default_height=64, min_side=32, max_side=512, timeout_s=5.0)


def plan(image=None, timeout_s=5.0, **body):
    inputs = InputImages.of(image) if image is not None else None
    request = parse_request({"prompt": "a cat", **body})
    true_cfg = uses_true_cfg(request.true_cfg_scale, request.negative_prompt is not None)
    return GenerationPlan(request, 64, 64, 2, seed=10, true_cfg=true_cfg, inputs=inputs, timeout_s=timeout_s)


def run(stages, request, limits=LIMITS, output="pixels"):
    async def main():
        return [event async for event in run_request(stages, request, "r", limits, output)]

    return asyncio.run(main())


def test_the_prompt_is_encoded_once_for_n_images_each_with_its_seed_and_cfg_rule():
    stages = FakeStages()
    events = run(stages, plan(n=3, negative_prompt="blurry", true_cfg_scale=4))
    (encode,) = stages.calls_to("encode_prompt")
    assert encode.args[0].negative_prompt == "blurry" and encode.args[1] == ()  # no image: text to image
    denoises = stages.calls_to("denoise")
    assert sorted(call.args[1].seed for call in denoises) == [10, 11, 12]
    assert all(call.args[2] is encode for call in denoises)  # the handle itself, passed on
    assert {call.args[1] for call in stages.calls_to("decode")} == set(denoises)
    done = sorted((e for e in events if isinstance(e, ImageDone)), key=lambda e: e.index)
    assert [int(e.result.pixels[0, 0, 0]) for e in done] == [10, 11, 12]
    progress = [(e.index, e.step) for e in events if isinstance(e, Progress)]
    assert sorted(progress) == [(i, s) for i in range(3) for s in (1, 2)]


def test_without_a_scale_above_one_the_negative_prompt_is_not_encoded():
    stages = FakeStages()
    run(stages, plan(negative_prompt="blurry", true_cfg_scale=1))
    assert stages.calls_to("encode_prompt")[0].args[0].negative_prompt is None


def test_an_edit_stores_its_image_once_and_both_encoders_read_that_handle():
    stages = FakeStages()
    pixels = np.zeros((32, 64, 3), dtype=np.uint8)
    run(stages, plan(image=pixels, n=2))
    (put,) = stages.calls_to("put_image")
    (encode,) = stages.calls_to("encode_prompt")
    (image_latents,) = stages.calls_to("encode_image")
    assert put.args[0] is pixels and encode.args[1] == (put,) and image_latents.args == ("r-input0", put)
    assert all(call.args[3] == (image_latents,) for call in stages.calls_to("denoise"))


def test_a_lost_image_encode_is_issued_again_once_for_every_image_of_the_request_under_new_ids():
    stages = FakeStages(lose={"encode_image": 1})
    images = (np.zeros((32, 64, 3), np.uint8), np.ones((64, 32, 3), np.uint8))
    events = run(stages, plan(image=InputImages(images, images), n=3))
    assert sorted(e.index for e in events if isinstance(e, ImageDone)) == [0, 1, 2]
    assert [call.args[0] for call in stages.calls_to("encode_image")] == ["r-input0", "r-input1", "r-input0-retry1",
                                                                          "r-input1-retry1"]


@pytest.mark.parametrize("conditions", [False, True], ids=["text-to-image inpainting", "masked edit"])
def test_a_masked_edit_samples_a_start_per_image_and_a_lost_one_is_encoded_again_under_a_new_id(conditions):
    stages = FakeStages(lose={"encode_image": 1})
    pixels = np.zeros((64, 64, 3), dtype=np.uint8)
    inputs = InputImages((pixels,), (pixels,) if conditions else (), np.ones((8, 8), np.uint8), conditions)
    masked = GenerationPlan(parse_request({"prompt": "a cat", "n": 2}), 64, 64, 4, seed=10, inputs=inputs,
                            inpaint=Inpaint(inputs.mask, 0.5), timeout_s=5.0)
    events = run(stages, masked)
    assert sorted(e.index for e in events if isinstance(e, ImageDone)) == [0, 1]
    encodes = stages.calls_to("encode_image")
    assert sorted(call.args[0] for call in encodes) == ["r-0-retry1-start", "r-0-start", "r-1-start"]
    assert {call.args[2] for call in encodes if call.args[0].startswith("r-1")} == {11}  # sampled with its seed
    for call in stages.calls_to("denoise"):
        start = call.args[4]
        assert start.name == "encode_image" and call.args[3] == ((start,) if conditions else ())
        assert call.args[1].first_step == 2 and call.args[1].steps_run == 2  # strength 0.5 of 4 steps
    assert [e.total for e in events if isinstance(e, Progress)] == [2] * 4


def test_every_stage_call_carries_the_request_s_priority_and_tenant():
    """The encoder's and the VAE's queues take work by them, as the DiT does (``DenoiseParams``)."""
    stages = FakeStages()
    pixels = np.zeros((64, 64, 3), dtype=np.uint8)
    urgent = dataclasses.replace(plan(image=pixels, n=2, priority=-1, stream=True, partial_images=1), tenant="acme")
    run(stages, urgent)
    (encode,) = stages.calls_to("encode_prompt")
    assert (encode.args[0].priority, encode.args[0].tenant) == (-1, "acme")
    assert {(call.args[1].priority, call.args[1].tenant) for call in stages.calls_to("denoise")} == {(-1, "acme")}
    vae = stages.calls_to("encode_image") + stages.calls_to("decode")
    assert len(vae) == 1 + 2 * 2 and {call.share for call in vae} == {(-1, "acme")}  # previews too


def test_output_mode_reaches_the_decode():
    stages = FakeStages()
    (result,) = asyncio.run(collect(run_request(stages, plan(), "r", LIMITS, "latents")))
    assert result.pixels is None and stages.calls_to("decode")[0].args[2] == "latents"


@pytest.mark.parametrize("lost", ["encode_prompt", "denoise", "decode"])
def test_a_lost_call_is_issued_again_and_gives_the_same_images(lost):
    reference = run(FakeStages(), plan(n=2))
    stages = FakeStages(lose={lost: 1})
    events = run(stages, plan(n=2))
    assert not any(isinstance(e, Failed) for e in events)
    def images(evs):
        return sorted((e.index, e.result.pixels.tolist()) for e in evs if isinstance(e, ImageDone))

    assert images(events) == images(reference)
    counts = {name: len(stages.calls_to(name)) for name in ("encode_prompt", "denoise", "decode")}
    # Only the lost call and what depends on it run again: a lost decode keeps its latents.
    expected = {
        "encode_prompt": {"encode_prompt": 2, "denoise": 3, "decode": 2},
        "denoise": {"encode_prompt": 1, "denoise": 3, "decode": 2},
        "decode": {"encode_prompt": 1, "denoise": 2, "decode": 3},
    }[lost]
    if lost == "encode_prompt":  # the second image may read the lost prompt too, before the first issued it again
        counts["denoise"] = min(counts["denoise"], 3)
        assert stages.calls_to("denoise")[-1].args[2] is stages.calls_to("encode_prompt")[1]
    assert counts == expected


def test_a_lost_shared_encode_is_issued_again_once_for_all_images():
    stages = FakeStages(lose={"encode_prompt": 1})
    events = run(stages, plan(n=3))
    assert sum(isinstance(e, ImageDone) for e in events) == 3
    assert len(stages.calls_to("encode_prompt")) == 2


def test_past_the_retry_budget_the_request_fails_with_a_503_naming_the_stage():
    stages = FakeStages(lose={"decode": 5})
    events = run(stages, plan(), RequestLimits(min_side=32, default_width=64, default_height=64, max_retries=2))
    assert isinstance(events[-1], Failed)
    error = events[-1].error
    assert isinstance(error, StageLostError) and error.status_code == 503 and error.stage == "vae"
    assert "decode" in str(error) and len(stages.calls_to("decode")) == 3


def test_a_failing_image_ends_the_request_and_cancels_every_other_call():
    stages = FakeStages(fail={"decode": EngineError("bad latents", "vae")})
    events = run(stages, plan(n=2))
    assert isinstance(events[-1], Failed) and str(events[-1].error) == "vae: bad latents"
    assert sum(isinstance(e, Failed) for e in events) == 1
    assert stages.calls_to("encode_prompt")[0].cancelled


def test_the_deadline_ends_the_request_and_cancels_its_calls():
    stages = FakeStages(hang="decode")
    events = run(stages, plan(n=2, timeout_s=0.2))
    assert isinstance(events[-1], Failed) and isinstance(events[-1].error, DeadlineExceededError)
    assert "0.2 s deadline" in str(events[-1].error) and events[-1].error.status_code == 504

    async def settle():  # the cancelled image tasks run their clean-up on the next turns of the loop
        await asyncio.sleep(0.05)

    asyncio.run(settle())
    assert all(call.cancelled for call in stages.calls_to("decode")) and len(stages.calls_to("decode")) == 2
    assert stages.calls_to("encode_prompt")[0].cancelled


def test_a_caller_that_leaves_cancels_every_call():
    stages = FakeStages(hang="decode")

    async def main():
        events = run_request(stages, plan(n=2), "r", LIMITS)
        first = await events.__anext__()  # some progress, then the caller goes away
        await events.aclose()
        await asyncio.sleep(0.05)
        return first

    assert isinstance(asyncio.run(main()), Progress)
    assert stages.calls_to("encode_prompt")[0].cancelled
    assert all(call.cancelled for call in stages.calls_to("decode"))


def test_a_caller_that_leaves_as_the_dit_s_estimate_arrives_is_not_admitted():
    """Found by tests/test_serve.py's mixed load on CI: a client that left as its admission's estimate came back was
    run in full (200 steps in 23 s) for no one, because Python 3.11's ``asyncio.wait_for`` returned the estimate and
    dropped the cancellation (python/cpython#86296). The estimate here arrives in the same turn of the loop as the
    cancellation, as it did there."""
    from deployments.stages import ServeStages

    class Handle:  # the DiT's handle: estimate.remote() is a call whose reply the test sends
        def __init__(self, reply):
            self.reply = reply
            self.estimate = self

        def options(self, **_):
            return self

        def remote(self, *args, **kwargs):
            return self.reply

    async def main():
        reply = asyncio.get_running_loop().create_future()
        stages = ServeStages(None, Handle(reply), None)
        admitting = asyncio.ensure_future(stages.estimate(plan(), "r", budget_s=60))
        await asyncio.sleep(0)  # it waits for the reply
        reply.set_result(3.0)
        admitting.cancel()  # the client leaves as it lands
        with pytest.raises(asyncio.CancelledError):
            await admitting

    asyncio.run(main())


def test_nothing_waits_with_asyncio_wait_for():
    """``asyncio.wait_for`` can swallow its caller's cancellation on Python 3.11 (the test above); the request path
    and the deployments wait with ``asyncio.timeout``."""
    from conftest import REPO

    found = [f"{path.relative_to(REPO)}:{n}" for folder in ("omni_ray", "deployments")
             for path in sorted((REPO / folder).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if "asyncio.wait_for(" in line]
    assert found == []


def test_collect_raises_the_error_and_orders_images_by_index():
    stages = FakeStages()
    results = asyncio.run(collect(run_request(stages, plan(n=3), "r", LIMITS)))
    assert [int(r.pixels[0, 0, 0]) for r in results] == [10, 11, 12]
    with pytest.raises(OverloadedError):
        asyncio.run(collect(run_request(FakeStages(fail={"decode": OverloadedError("full")}), plan(), "r", LIMITS)))


def test_stage_errors_from_ray_name_the_lost_call():
    from ray.exceptions import ActorDiedError
    from ray.serve.exceptions import BackPressureError, RayServeException

    from deployments.stages import stage_error

    died = ActorDiedError()
    upstream = RayServeException("Request to deployment 'DiT' failed because an upstream actor died")
    upstream.__cause__ = died
    for err in (died, upstream):
        mapped = stage_error(err, "dit", StageCall.DENOISE)
        assert isinstance(mapped, StageLostError) and mapped.call is StageCall.DENOISE and mapped.stage == "dit"
    full = stage_error(BackPressureError(num_queued_requests=8, max_queued_requests=8), "vae", StageCall.DECODE)
    assert isinstance(full, OverloadedError) and not isinstance(full, StageLostError) and full.stage == "vae"
    assert stage_error(EngineError("bad", "vae"), "dit", StageCall.DENOISE).stage == "vae"  # a stage's own error passes


class _Marker:
    """Stands for a result in the object store: alive while something refers to it."""


class _Ready:
    def __init__(self, value):
        self.value = value

    def __await__(self):
        return self.value
        yield


class _Handle:
    """A deployment handle whose calls keep their arguments, as Ray Serve's request router does (in a reference
    cycle of a routing task it cancelled, freed only by a full garbage collection)."""

    def __init__(self, answer=None, fail=False):
        self.kept, self.answer, self.fail = [], answer, fail

    def options(self, **_):
        return self

    def __getattr__(self, method):
        handle = self

        class Method:
            def remote(self, *args, **kwargs):
                handle.kept.append((args, kwargs))
                if handle.fail:
                    raise EngineError("broken", "vae")
                return _Ready(handle.answer)

        return Method()


@pytest.mark.parametrize("fail", [False, True])
def test_a_stage_call_that_ended_leaves_no_result_alive_in_the_arguments_serve_keeps(monkeypatch, fail):
    """The DiT's inputs and the VAE's latents reach the call inside ``Upstream``s that the coordinator empties once the
    call has ended, so what Serve's router keeps of the call's arguments holds no result in the object store."""
    import gc
    import weakref

    from deployments import stages as serve_stages
    from omni_ray.records import DenoiseParams, Finished, Follows, StepDone

    async def object_ref(response):
        return response.value

    async def object_ref_stream(response):
        async def items():
            yield _Ready(StepDone(1, 1, Follows.RESULT))
            yield _Marker()

        return items()

    monkeypatch.setattr(serve_stages, "object_ref", object_ref)
    monkeypatch.setattr(serve_stages, "object_ref_stream", object_ref_stream)
    dit, vae = _Handle(), _Handle(answer="decoded", fail=fail)
    stages = serve_stages.ServeStages(_Handle(), dit, vae)
    responses = [_Ready(_Marker()), _Ready(_Marker())]  # the prompt's encoding, the input image's latents
    alive = [weakref.ref(response.value) for response in responses]

    async def run(prompt, image):
        events = [event async for event in stages.denoise("r", DenoiseParams(64, 64, 1, 0), prompt, (image,))]
        assert isinstance(events[-1], Finished)
        alive.append(weakref.ref(events[-1].result))
        try:
            assert await stages.decode("r", events[-1].result, "pixels") == "decoded"
        except EngineError:
            assert fail

    gc.disable()  # what the arguments kept hold must go by reference counts alone
    try:
        asyncio.run(run(*responses))
        responses.clear()
        assert dit.kept and vae.kept  # the arguments are still kept
        assert [ref() for ref in alive] == [None, None, None]
    finally:
        gc.enable()


def test_a_503_carries_retry_after():
    import json

    from deployments.http.bodies import error_response

    response = asyncio.run(error_response(None, StageLostError("vae", StageCall.DECODE, retry_after_s=5.0)))
    assert response.status_code == 503 and response.headers["retry-after"] == "5"
    body = json.loads(response.body)["error"]
    assert body["type"] == "overloaded_error" and body["message"].startswith("vae: the replica running decode")


def test_an_image_sent_through_the_handle_to_a_text_to_image_app_is_refused(tiny_dir):
    from conftest import REPO

    from omni_ray.config import load_config
    from omni_ray.errors import RequestError
    from testing.coordinator import coordinator as coordinator_over

    config = load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir))
    coordinator = coordinator_over(config)
    with pytest.raises(RequestError, match="does not edit images") as info:
        asyncio.run(coordinator.plan({"prompt": "a cat"}, image=b"\x89PNG..."))
    assert info.value.param == "image"
    planned = asyncio.run(coordinator.plan({"prompt": "a cat"}))
    assert planned.inputs is None and planned.request.prompt == "a cat"


@pytest.mark.parametrize("error", [
    StageLostError("encoder", StageCall.ENCODE_PROMPT, "the actor died", 5.0),
    OverloadedError("out of memory", 5.0, "vae"),
    EngineError("RuntimeError: boom", "dit"),
    DeadlineExceededError("past its deadline"),
])
def test_errors_survive_pickling_as_they_cross_replicas(error):
    import pickle

    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error) and copy.__dict__ == error.__dict__
