"""Awaiting a request's stage chains: only their last responses, and cancelling every call if one fails.

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
        except RayTaskError as err:  # a stage raised: pass its own error on, without Ray's traceback text
            cause = err.cause
            if isinstance(cause, OmniRayError):
                raise cause from None
            if isinstance(cause, BackPressureError):
                raise OverloadedError(f"a stage is at its queue limit: {cause}") from None
            raise EngineError(f"{type(cause).__name__}: {cause}") from None
        except BackPressureError as err:
            raise OverloadedError(f"a stage is at its queue limit: {err}") from None
        except RayActorError as err:  # Serve replaces the replica; a retry will land
            raise OverloadedError(f"a stage replica failed while running this request: {err}", 5.0) from None
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
                _cancel(response)
        raise


def _cancel(response: DeploymentResponse) -> None:
    # Cancelling a response that already failed re-raises its error (Ray 2.60): it is done either way.
    try:
        response.cancel()
    except Exception:
        pass
