"""The private Ray Serve APIs omni-ray relies on, each behind one function (pinned with ray 2.60).

A ``DeploymentResponse`` passed to another deployment is resolved by Ray on the way; the request path needs the
reference itself, unresolved, to tell a lost input apart from a stage's own failure and to leave a streamed result
where it is. Serve exposes that only through these private methods.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import ray
from ray.serve.handle import DeploymentResponse, DeploymentResponseGenerator


async def object_ref(response: DeploymentResponse) -> ray.ObjectRef:
    """The reference to the call's result, once Serve has assigned the call to a replica (not its result)."""
    return await response._to_object_ref()


async def object_ref_stream(response: DeploymentResponseGenerator) -> AsyncIterator[ray.ObjectRef]:
    """The streamed call's items as references, each fetched only by whoever awaits it."""
    return await response._to_object_ref_gen()
