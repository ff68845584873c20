"""One trace per request (OpenTelemetry), off unless Ray Serve's tracing is on.

The spans of one request (``docs/observability.md`` shows a trace):

- ``request``, the coordinator's, around the request's event stream: its route, request id, tenant, model, ``n``,
  layers, and how it ended (``omni_ray.status``);
- one per stage call the coordinator makes (``TracedStages``): ``encode_prompt`` and ``caption`` (the encoder),
  ``encode_image`` and ``decode`` (the VAE), and one ``denoise`` per image (``n=2`` makes two), with an event per
  denoising step as the coordinator reads it;
- in each stage replica, one per request its engine runs (``encoder.encode``, ``encoder.caption``, ``dit.denoise``
  with an event per step as the engine makes it, ``vae.decode``, ``vae.encode``): a child of the call's span.

Every span of a request has the same trace id, across the replicas: Ray Serve 2.60's own tracing carries the caller's
context on each handle call (its router puts it in the call's metadata; the replica makes it current while the
deployment's method runs), so a stage call's span is current when its ``.remote()`` is made and the replica's span
finds it. Nothing of ours rides in the records or the calls. Errors are recorded on the span they left.

Turning it on is Ray Serve's setting (``tracing_config`` in the Serve config, or ``RAY_SERVE_TRACING_*`` in the
cluster's environment), naming one of our exporters (``omni_ray.tracing.export``): each replica then calls
``enable`` (``deployments``) and makes spans with the tracer provider Ray set up. Off, nothing here imports
OpenTelemetry and the hooks hand back what they were given: ``traced``, ``traced_request`` and ``traced_stream``
return their argument.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer, TracerProvider

    from omni_ray.api.planning import GenerationPlan
    from omni_ray.request_path import RequestEvent, Stages

_tracer: Tracer | None = None  # set while tracing is on in this process


def enable(provider: TracerProvider | None = None) -> None:
    """Spans on in this process, made by ``provider`` (the global one, which Ray Serve sets up, by default; tests
    hand in one with an in-memory exporter)."""
    global _tracer
    from opentelemetry import trace

    _tracer = (provider or trace.get_tracer_provider()).get_tracer("omni_ray")


def disable() -> None:
    global _tracer
    _tracer = None


def enabled() -> bool:
    return _tracer is not None


def traced(stages: Stages) -> Stages:
    """``stages`` with a span around each call (``TracedStages``) while tracing is on; ``stages`` itself when off."""
    if _tracer is None:
        return stages
    from omni_ray.tracing.stages import TracedStages

    return TracedStages(stages, _tracer)


def traced_request(events: AsyncIterator[RequestEvent], plan: GenerationPlan, request_id: str
                   ) -> AsyncIterator[RequestEvent]:
    """The request's event stream inside its ``request`` span (the root of its spans here), the span current while
    the stream runs so that every stage call it starts is its child; ``events`` itself when off."""
    if _tracer is None:
        return events
    from omni_ray.tracing.spans import request_span

    return request_span(_tracer, events, plan, request_id)


def traced_stream(stage: str, request, items: AsyncIterator) -> AsyncIterator:
    """A stage engine's stream for one request (``AsyncEngine.stream``) inside the replica's span for it; ``items``
    itself when off."""
    if _tracer is None:
        return items
    from omni_ray.tracing.spans import engine_span

    return engine_span(_tracer, stage, request, items)
