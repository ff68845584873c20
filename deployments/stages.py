"""The stage protocol on Serve deployment handles, and the DiT's step stream as it crosses Ray: each stage's result
goes to the next stage by reference.

A started call's handle is its ``DeploymentResponse``. The next stage receives it as an ``Upstream``: the object
reference inside a record, so that Ray does not resolve it on the way and the receiving stage resolves it itself.
That tells a stage's own failure apart from a lost input: a stage whose replica died is lost in its own call; one
whose input was lost with another replica raises ``StageLostError`` naming that call, and the request path issues
exactly the lost call again. The DiT's stream is read as references too: progress events are fetched (they are
small), the latents are not, so the coordinator never holds a tensor, and it owns every result it passes on (an
object ``ray.put`` in a replica and yielded by reference can be freed before the next stage reads it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
from ray.exceptions import ObjectLostError, RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from deployments.ray_private import object_ref, object_ref_stream, running_replicas
from omni_ray.api.planning import GenerationPlan
from omni_ray.config import LoraEntry
from omni_ray.engine.dit_load import size_key
from omni_ray.errors import EngineError, OmniRayError, OverloadedError, StageCall, StageLostError
from omni_ray.records import (
    Caption,
    CaptionRequest,
    Decoded,
    DenoiseParams,
    EncodeRequest,
    Finished,
    Follows,
    OutputMode,
    Preview,
    StepDone,
    stack_id,
)
from omni_ray.request_path import DenoiseEvent, Stages

logger = logging.getLogger("ray.serve")

# What losing a replica (or the node holding a result) looks like to a caller. Serve reports an input lost with
# another replica as a RayServeException whose cause is the ActorDiedError.
LOST = (RayActorError, ObjectLostError)


@dataclass(slots=True)
class Upstream:
    """A stage's result on its way to another stage, by reference, with the call that made it.

    The caller releases its ``Upstream``s once the call that took them has ended (``release``). Ray Serve's request
    router keeps the arguments of a call it routed in a reference cycle (a routing task it cancelled, whose
    ``CancelledError`` traceback holds the frame with the call's ``PendingRequest``), which only a full garbage
    collection frees: released, what the cycle holds is an empty wrapper, not the result in the object store."""

    stage: str
    call: StageCall
    ref: ray.ObjectRef | None

    def release(self) -> None:
        """Drops the reference (the copy the called replica received keeps its own)."""
        self.ref = None

    async def resolve(self):
        try:
            return await self.ref
        except Exception as err:
            raise stage_error(err, self.stage, self.call) from None


def stage_error(err: BaseException, stage: str, call: StageCall) -> OmniRayError:
    """What a failed stage call means to the request path, without Ray's traceback text."""
    if isinstance(err, RayTaskError):  # the stage raised: pass its own error on
        err = err.cause
    if isinstance(err, OmniRayError):
        return err
    if isinstance(err, RayServeException) and isinstance(err.__cause__, LOST):
        err = err.__cause__
    if isinstance(err, LOST):
        return StageLostError(stage, call, str(err).split("\n")[0])
    if isinstance(err, BackPressureError):
        return OverloadedError(f"at its queue limit ({err})", stage=stage)
    return EngineError(f"{type(err).__name__}: {err}", stage)


def cancel(response) -> None:
    """Cancels a stage call; a no-op on finished ones. Cancelling a response that already failed re-raises its
    error (Ray 2.60): it is done either way."""
    try:
        response.cancel()
    except Exception:
        pass


class ServeStages(Stages[ray.ObjectRef | DeploymentResponse]):
    """The stage protocol over the stage deployments' handles; every result stays a reference."""

    def __init__(self, encoder: DeploymentHandle, dit: DeploymentHandle, vae: DeploymentHandle):
        self.encoder, self.vae = encoder, vae
        self.dit_calls, self.dit = dit, dit.options(stream=True)

    async def estimate(self, plan: GenerationPlan, request_id: str | None = None, budget_s: float | None = None,
                       timeout_s: float = 1.0) -> float | None:
        """The estimate of the DiT replica Serve's router would send the request to (the one with the least work,
        ``deployments.routing``, among those holding its adapter first); admitted (within ``budget_s``), the
        request is reserved there under ``request_id`` and the router sends its denoise calls there. None when no
        replica answers within ``timeout_s`` (none is running, say): the request is then admitted and waits as any
        other."""
        dit = self.dit_calls.options(multiplexed_model_id=stack_id(plan.loras)) if plan.loras else self.dit_calls
        response = dit.estimate.remote(plan.request.priority, plan.work_tokens, plan.steps_run, plan.request.n,
                                       2 if plan.true_cfg else 1, plan.tenant, plan.timeout_s, budget_s,
                                       reservation=request_id, key=size_key(plan.height, plan.width, plan.true_cfg))
        try:
            async with asyncio.timeout(timeout_s):  # not wait_for: see omni_ray/request_path.py's run_request
                return await response
        except Exception as err:
            cancel(response)
            logger.warning("no estimate from the DiT (%s: %s): the request is admitted", type(err).__name__, err)
            return None

    def running_replicas(self) -> dict[str, int]:
        """Each stage deployment's replicas that this process's routers may send a call to (``/health``)."""
        return {"Encoder": running_replicas(self.encoder), "DiT": running_replicas(self.dit),
                "VAE": running_replicas(self.vae)}

    def release(self, request_id: str) -> None:
        """Sent, not awaited: the router takes it to the replica that reserved the request (``deployments.routing``);
        were it lost, the reservation would expire by itself."""
        self.dit_calls.release.remote(request_id)

    async def check_lora(self, path: str) -> LoraEntry:
        """A DiT replica's ``check_lora``: the resolved path and recipe, or RequestError naming ``lora_path``."""
        try:
            return await self.dit_calls.check_lora.remote(path)
        except Exception as err:
            raise stage_error(err, "dit", StageCall.CHECK_LORA) from None

    def put_image(self, image: np.ndarray) -> ray.ObjectRef:
        return ray.put(image)

    def encode_prompt(self, request: EncodeRequest, images: tuple[ray.ObjectRef, ...]) -> DeploymentResponse:
        return self.encoder.encode.remote(request, *images)

    async def caption(self, request: CaptionRequest, image: ray.ObjectRef) -> Caption:
        """The encoder's caption; the image travels by reference (the request path sends ``request.image`` None)."""
        return await _answer(self.encoder.caption.remote(request, image), "encoder", StageCall.CAPTION)

    def encode_image(self, request_id: str, image: ray.ObjectRef, seed: int | None = None, draw: int = 0,
                     mask: ray.ObjectRef | None = None, *, priority: int = 0, tenant: str = "") -> DeploymentResponse:
        return self.vae.encode.remote(request_id, image, seed, draw, mask, priority, tenant)

    async def denoise(
        self,
        request_id: str,
        params: DenoiseParams,
        prompt: DeploymentResponse,
        image_latents: tuple[DeploymentResponse, ...],
        start: DeploymentResponse | None = None,
        controls: tuple[DeploymentResponse, ...] = (),
    ) -> AsyncIterator[DenoiseEvent]:
        inputs = [await _upstream(prompt, "encoder", StageCall.ENCODE_PROMPT)]
        for latents in image_latents:
            inputs.append(await _upstream(latents, "vae", StageCall.ENCODE_IMAGE))
        extra = {"start": await _upstream(start, "vae", StageCall.ENCODE_IMAGE)} if start is not None else {}
        if controls:
            extra["controls"] = tuple([await _upstream(latents, "vae", StageCall.ENCODE_IMAGE) for latents in controls])
        dit = self.dit.options(multiplexed_model_id=stack_id(params.loras)) if params.loras else self.dit
        stream = dit.denoise.remote(request_id, params, *inputs, **extra)
        try:
            # Steps are fetched (they are small); previews and latents stay references, for the VAE to read.
            async for event in read_step_stream(await object_ref_stream(stream), _awaited):
                yield event
        except Exception as err:
            cancel(stream)
            raise stage_error(err, "dit", StageCall.DENOISE) from None
        except BaseException:  # cancelled, or the caller closed the stream
            cancel(stream)
            raise
        finally:  # the call has ended: nothing of ours stays behind in what Serve's router keeps of it
            for upstream in (*inputs, extra.get("start"), *extra.get("controls", ())):
                if upstream is not None:
                    upstream.release()

    async def decode(self, request_id: str, latents: ray.ObjectRef, output: OutputMode, preview: bool = False, *,
                     priority: int = 0, tenant: str = "") -> Decoded:
        upstream = Upstream("dit", StageCall.DENOISE, latents)
        try:
            response = self.vae.decode.remote(request_id, upstream, output, preview, priority, tenant)
            return await _answer(response, "vae", StageCall.DECODE)
        finally:  # as ``denoise``'s
            upstream.release()

    def cancel(self, handle: DeploymentResponse) -> None:
        cancel(handle)


async def _answer(response: DeploymentResponse, stage: str, call: StageCall):
    """A unary stage call's result; its failure as ``stage_error`` names it, and the call is cancelled when it fails
    or its caller goes away."""
    try:
        return await response
    except Exception as err:
        cancel(response)
        raise stage_error(err, stage, call) from None
    except BaseException:
        cancel(response)
        raise


async def _awaited(response: DeploymentResponse | ray.ObjectRef):
    """The value, as a coroutine (what ``read_step_stream`` takes to resolve each step's reference)."""
    return await response


async def _upstream(response: DeploymentResponse, stage: str, call: StageCall) -> Upstream:
    """The response as an ``Upstream`` (waits until Serve has assigned it to a replica, not for its result)."""
    try:
        return Upstream(stage, call, await object_ref(response))
    except Exception as err:
        raise stage_error(err, stage, call) from None


# --- the DiT's step stream over Ray --------------------------------------------------------------------------------


async def write_step_stream(items: AsyncIterator[DenoiseEvent]) -> AsyncIterator[Any]:
    """The DiT's typed stream as the deployment yields it: each ``StepDone``, then a preview's or the result's payload
    unwrapped, each its own object, so that the caller can pass the payload on by reference without fetching it."""
    async for item in items:
        yield item if isinstance(item, StepDone) else item.result


async def read_step_stream(
    items: AsyncIterator[Any], fetch: Callable[[Any], Awaitable[Any]]
) -> AsyncIterator[DenoiseEvent]:
    """``write_step_stream``'s items read back into typed ones. ``fetch`` reads a ``StepDone`` (an object
    reference's value); the payloads are never fetched, only wrapped, so a large result stays where it is."""
    async for item in items:
        step: StepDone = await fetch(item)
        yield step
        if step.follows is Follows.PREVIEW:
            yield Preview(await anext(items))
        elif step.follows is Follows.RESULT:
            yield Finished(await anext(items))
            return
    raise EngineError("the stream ended before its result")
