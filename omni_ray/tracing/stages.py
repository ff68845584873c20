"""The stage protocol with a span around each call the coordinator makes (imported only while tracing is on)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from opentelemetry import context as otel_context
from opentelemetry.trace import Span, SpanKind, Tracer, use_span

from omni_ray.records import StepDone
from omni_ray.request_path import DenoiseEvent, Stages
from omni_ray.tracing.spans import REQUEST_KEY


class TracedStages(Stages):
    """Any ``Stages`` with a client span per stage call, named after the call, with the stage, the call's id, and the
    request's id and tenant. The span is current while the call starts, so that Ray Serve carries it to the replica
    (whose own span is then its child). ``encode_prompt`` and ``encode_image`` only start their call (their result
    goes to the next stage by reference): their spans are short, and the replica's span is the call's work.
    ``denoise`` gets an event per step as the coordinator reads it (the DiT replica's span has the engine's)."""

    def __init__(self, stages: Stages, tracer: Tracer):
        self.stages, self.tracer = stages, tracer

    def __getattr__(self, name: str):  # what the wrapped stages offer beyond the protocol (``shutdown``, say)
        if name == "stages":  # not set yet
            raise AttributeError(name)
        return getattr(self.stages, name)

    def _span(self, name: str, stage: str, call_id: str, **attributes) -> Span:
        attributes = {"omni_ray.stage": stage, "omni_ray.call_id": call_id,
                      **{f"omni_ray.{key}": value for key, value in attributes.items()}}
        request = otel_context.get_value(REQUEST_KEY)
        if request is not None:
            attributes["omni_ray.request_id"], attributes["omni_ray.tenant"] = request
        return self.tracer.start_span(name, kind=SpanKind.CLIENT, attributes=attributes)

    def put_image(self, *args, **kwargs):
        return self.stages.put_image(*args, **kwargs)

    def encode_prompt(self, request, images):
        with use_span(self._span("encode_prompt", "encoder", request.request_id), end_on_exit=True):
            return self.stages.encode_prompt(request, images)

    async def caption(self, request, image):
        with use_span(self._span("caption", "encoder", request.request_id), end_on_exit=True):
            return await self.stages.caption(request, image)

    def encode_image(self, request_id, image, *args, **kwargs):
        with use_span(self._span("encode_image", "vae", request_id), end_on_exit=True):
            return self.stages.encode_image(request_id, image, *args, **kwargs)

    async def denoise(self, request_id, params, *args, **kwargs) -> AsyncIterator[DenoiseEvent]:
        span = self._span("denoise", "dit", request_id, steps=params.steps_run)
        events = self.stages.denoise(request_id, params, *args, **kwargs)
        try:
            async with contextlib.aclosing(events):
                while True:
                    with use_span(span):  # current while the call starts (its first step), never across a yield
                        try:
                            event = await anext(events)
                        except StopAsyncIteration:
                            break
                    if isinstance(event, StepDone):
                        span.add_event("step", {"step": event.step, "total": event.total})
                    yield event
        finally:
            span.end()

    async def decode(self, request_id, latents, output, preview=False, **kwargs):
        with use_span(self._span("decode", "vae", request_id, preview=preview), end_on_exit=True):
            return await self.stages.decode(request_id, latents, output, preview, **kwargs)

    def cancel(self, handle) -> None:
        self.stages.cancel(handle)

    async def estimate(self, *args, **kwargs):
        return await self.stages.estimate(*args, **kwargs)

    def release(self, request_id: str) -> None:
        self.stages.release(request_id)

    async def check_lora(self, path):
        return await self.stages.check_lora(path)
