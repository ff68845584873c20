"""The private Ray APIs omni-ray relies on, each behind one function (pinned with ray 2.60).

A ``DeploymentResponse`` passed to another deployment is resolved by Ray on the way; the request path needs the
reference itself, unresolved, to tell a lost input apart from a stage's own failure and to leave a streamed result
where it is. Serve exposes that only through these private methods.

The GCS's key-value store (where Serve keeps its own state) holds what every coordinator replica must share; Ray
exposes its asyncio client only privately. A namespace must not hold ':' (Ray 2.60 splits keys on it when listing).

A handle's router holds the running replicas of its deployment, which Serve's controller pushes to it: how many it
holds is this process's own knowledge, read without asking the controller or the GCS (``running_replicas``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import ray
from ray._private.worker import global_worker
from ray.serve.handle import DeploymentHandle, DeploymentResponse, DeploymentResponseGenerator


async def object_ref(response: DeploymentResponse) -> ray.ObjectRef:
    """The reference to the call's result, once Serve has assigned the call to a replica (not its result)."""
    return await response._to_object_ref()


async def object_ref_stream(response: DeploymentResponseGenerator) -> AsyncIterator[ray.ObjectRef]:
    """The streamed call's items as references, each fetched only by whoever awaits it."""
    return await response._to_object_ref_gen()


def running_replicas(handle: DeploymentHandle) -> int:
    """The replicas of the handle's deployment that its router may send a call to: those Serve's controller last
    said are running (a replica being reconfigured or stopped is not), less any the router saw die since; 0 before
    the controller's first word. Starts the router if the handle has none yet."""
    router = handle._init_router()._asyncio_router
    request_router = router._request_router  # the property would make one
    if request_router is not None:
        return len(request_router.curr_replicas)
    return len(router._running_replicas or ())


KV_TIMEOUT_S = 10.0


async def kv_get(key: str, namespace: str, timeout: float = KV_TIMEOUT_S) -> bytes | None:
    return await global_worker.gcs_client.async_internal_kv_get(key.encode(), namespace.encode(), timeout=timeout)


async def kv_add(key: str, value: bytes, namespace: str) -> bool:
    """Stores ``value`` unless ``key`` has one; whether it was stored."""
    return await global_worker.gcs_client.async_internal_kv_put(key.encode(), value, False, namespace.encode(),
                                                                timeout=KV_TIMEOUT_S)


async def kv_delete(key: str, namespace: str) -> bool:
    """Whether ``key`` was there."""
    return await global_worker.gcs_client.async_internal_kv_del(key.encode(), False, namespace.encode(),
                                                                timeout=KV_TIMEOUT_S) > 0


async def kv_items(prefix: str, namespace: str, timeout: float = KV_TIMEOUT_S) -> dict[str, bytes]:
    """Every key under ``prefix`` with its value."""
    client, space = global_worker.gcs_client, namespace.encode()
    keys = await client.async_internal_kv_keys(prefix.encode(), space, timeout=timeout)
    values = await client.async_internal_kv_multi_get(keys, space, timeout=timeout) if keys else {}
    return {key.decode(): value for key, value in values.items()}


def serve_tracing_enabled() -> bool:
    """Whether Ray Serve set up tracing in this process (its ``tracing_config``, or ``RAY_SERVE_TRACING_*``): a
    replica's is set up before its deployment's constructor runs."""
    from ray.serve._private.tracing_utils import is_tracing_enabled

    return is_tracing_enabled()
