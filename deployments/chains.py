"""Awaiting a request's stage chains (only their last responses; one failure cancels every call) and turning
a failed stage call into the error the caller should see.

Its own module, imported by the coordinator: Serve pickles the ingress class when ``@serve.ingress`` runs, before
anything below the class in its module is defined (a helper there raised NameError in the replica).
"""

from __future__ import annotations

import asyncio

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentResponse

from omni_ray.errors import EngineError, OmniRayError, OverloadedError
from omni_ray.stages.decode import Decoded
from omni_ray.stages.denoise import Latents


async def gather_or_cancel(chains: list[list[DeploymentResponse]]) -> list[Decoded]:
    """Awaits the last response of every chain; if one fails or the caller goes away, cancels every stage call."""

    async def last(chain: list[DeploymentResponse]) -> Decoded:
        try:
            result = await chain[-1]
        except Exception as err:
            raise stage_error(err) from None
        if isinstance(result, Latents):  # latents only: the chain ended at the DiT
            return Decoded(pixels=None, latents=result, timings=result.timings)
        return result

    tasks = [asyncio.ensure_future(last(chain)) for chain in chains]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        for chain in chains:
            for response in chain:
                cancel(response)
        raise


def stage_error(err: Exception) -> OmniRayError:
    """What a failed stage call means to the caller, without Ray's traceback text."""
    if isinstance(err, RayTaskError):  # a stage raised: pass its own error on
        err = err.cause
    if isinstance(err, OmniRayError):
        return err
    if isinstance(err, BackPressureError):
        return OverloadedError(f"a stage is at its queue limit: {err}")
    if isinstance(err, RayActorError):  # Serve replaces the replica; a retry will land
        return OverloadedError(f"a stage replica failed while running this request: {err}", 5.0)
    return EngineError(f"{type(err).__name__}: {err}")  # a replica died, or Ray failed to deliver


def cancel(response) -> None:
    """Cancels a stage call (a response or a response stream); a no-op on finished ones.

    Cancelling a response that already failed re-raises its error (Ray 2.60): it is done either way.
    """
    try:
        response.cancel()
    except Exception:
        pass
