"""Awaiting a request's stage chains: only their last responses, and cancelling every call if one fails.

Its own module, not the coordinator's: Serve pickles the ingress class by value, and a helper defined beside it
does not come along (the replica raised NameError); an imported one is pickled by reference.
"""

from __future__ import annotations

import asyncio

from ray.exceptions import RayTaskError
from ray.serve.handle import DeploymentResponse

from omni_ray.errors import EngineError, OmniRayError
from omni_ray.stages.decode import Decoded
from omni_ray.stages.denoise import Latents


async def gather_or_cancel(chains: list[list[DeploymentResponse]]) -> list[Decoded]:
    """Awaits the last response of every chain; if one fails or the caller goes away, cancels every stage call."""

    async def last(chain: list[DeploymentResponse]) -> Decoded:
        try:
            result = await chain[-1]
        except RayTaskError as err:  # a stage raised: pass its own error on, without Ray's traceback text
            cause = err.cause
            if isinstance(cause, OmniRayError):
                raise cause from None
            raise EngineError(f"{type(cause).__name__}: {cause}") from None
        except OmniRayError:
            raise
        except Exception as err:  # a replica died, or Ray failed to deliver: the stages' fault, not the caller's
            raise EngineError(f"{type(err).__name__}: {err}") from err
        return Decoded(pixels=None, latents=result) if isinstance(result, Latents) else result

    tasks = [asyncio.ensure_future(last(chain)) for chain in chains]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        for chain in chains:
            for response in chain:
                response.cancel()
        raise
