"""The spans themselves (imported only while tracing is on): the coordinator's ``request`` span and a stage replica's
span per engine request. ``TracedStages`` (``stages.py``) makes the stage calls' spans between them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from opentelemetry import context as otel_context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context

from omni_ray.api.planning import GenerationPlan
from omni_ray.records import Finished, StepDone, stack_id
from omni_ray.request_path import Failed, RequestEvent

# The request's id and tenant, in the context the request's stage calls run in (its tasks copy it), so that each
# call's span names them too.
REQUEST_KEY = otel_context.create_key("omni_ray.request")

# A stage replica's span per engine request, by the request's ``timing`` (its stage's name in a result's timings).
ENGINE_SPANS = {"encoder": "encoder.encode", "caption": "encoder.caption", "dit": "dit.denoise",
                "vae": "vae.decode", "vae_encode": "vae.encode"}


def route(plan: GenerationPlan) -> str:
    return "/v1/images/edits" if plan.inputs is not None else "/v1/images/generations"


async def request_span(tracer: Tracer, events: AsyncIterator[RequestEvent], plan: GenerationPlan, request_id: str
                       ) -> AsyncIterator[RequestEvent]:
    """``events`` inside the request's span. The span is made current around each step of the stream, never across a
    ``yield`` (the consumer's code is not the request's): the request path starts its calls and its tasks (which copy
    the context) inside those steps."""
    request = plan.request
    span = tracer.start_span("request", kind=SpanKind.SERVER, attributes={
        "omni_ray.route": route(plan), "omni_ray.request_id": request_id, "omni_ray.tenant": plan.tenant,
        "omni_ray.model": request.model or "", "omni_ray.lora": stack_id(plan.loras),
        "omni_ray.n": request.n, "omni_ray.layers": plan.layers,
        "omni_ray.stream": bool(request.stream), "omni_ray.size": f"{plan.width}x{plan.height}",
        "omni_ray.steps": plan.steps_run})
    current = otel_context.set_value(REQUEST_KEY, (request_id, plan.tenant), set_span_in_context(span))
    status = "ok"
    try:
        async with contextlib.aclosing(events):
            while True:
                token = otel_context.attach(current)
                try:
                    event = await anext(events)
                except StopAsyncIteration:
                    break
                finally:
                    otel_context.detach(token)
                if isinstance(event, Failed):
                    status = type(event.error).__name__
                    fail(span, event.error)
                yield event
    except (GeneratorExit, asyncio.CancelledError):
        if status == "ok":  # the caller went away (after a failure, the caller stops reading: still the failure)
            status = "cancelled"
        raise
    except Exception as err:
        status = type(err).__name__
        fail(span, err)
        raise
    finally:
        span.set_attribute("omni_ray.status", status)
        span.end()


async def engine_span(tracer: Tracer, stage: str, request, items: AsyncIterator) -> AsyncIterator:
    """A stage engine's stream for one request inside the replica's span for it (a child of the current context: the
    caller's, which Ray Serve made current for the call), with an event per ``StepDone``."""
    attributes = {"omni_ray.stage": stage, "omni_ray.call_id": request.request_id}
    params = getattr(request, "params", None)  # the DiT's: who sent it
    if params is not None:
        attributes["omni_ray.tenant"] = params.tenant
    if getattr(request, "preview", False):
        attributes["omni_ray.preview"] = True
    span = tracer.start_span(ENGINE_SPANS.get(request.timing, f"{stage}.{request.timing}"), attributes=attributes)
    recording = span.is_recording()
    try:
        async with contextlib.aclosing(items):
            async for item in items:
                if recording and isinstance(item, StepDone):
                    span.add_event("step", {"step": item.step, "total": item.total})
                elif recording and isinstance(item, Finished):
                    span.set_attribute("omni_ray.engine_s", item.result.timings.get(request.timing, 0.0))
                yield item
    except (GeneratorExit, asyncio.CancelledError):
        span.set_attribute("omni_ray.status", "cancelled")
        raise
    except Exception as err:
        fail(span, err)
        raise
    finally:
        span.end()


def fail(span: Span, err: BaseException) -> None:
    span.record_exception(err)
    span.set_status(Status(StatusCode.ERROR, f"{type(err).__name__}: {err}"))
