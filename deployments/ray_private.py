"""The private Ray APIs omni-ray relies on, each behind one function (pinned with ray 2.60).

A ``DeploymentResponse`` passed to another deployment is resolved by Ray on the way; the request path needs the
reference itself, unresolved, to tell a lost input apart from a stage's own failure and to leave a streamed result
where it is. Serve exposes that only through these private methods.

The GCS's key-value store (where Serve keeps its own state) holds what every coordinator replica must share; Ray
exposes its asyncio client only privately. A namespace must not hold ':' (Ray 2.60 splits keys on it when listing).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import ray
from ray._private.worker import global_worker
from ray.serve.handle import DeploymentResponse, DeploymentResponseGenerator


async def object_ref(response: DeploymentResponse) -> ray.ObjectRef:
    """The reference to the call's result, once Serve has assigned the call to a replica (not its result)."""
    return await response._to_object_ref()


async def object_ref_stream(response: DeploymentResponseGenerator) -> AsyncIterator[ray.ObjectRef]:
    """The streamed call's items as references, each fetched only by whoever awaits it."""
    return await response._to_object_ref_gen()


KV_TIMEOUT_S = 10.0


async def kv_get(key: str, namespace: str) -> bytes | None:
    return await global_worker.gcs_client.async_internal_kv_get(key.encode(), namespace.encode(), timeout=KV_TIMEOUT_S)


async def kv_add(key: str, value: bytes, namespace: str) -> bool:
    """Stores ``value`` unless ``key`` has one; whether it was stored."""
    return await global_worker.gcs_client.async_internal_kv_put(key.encode(), value, False, namespace.encode(),
                                                                timeout=KV_TIMEOUT_S)


async def kv_delete(key: str, namespace: str) -> bool:
    """Whether ``key`` was there."""
    return await global_worker.gcs_client.async_internal_kv_del(key.encode(), False, namespace.encode(),
                                                                timeout=KV_TIMEOUT_S) > 0


async def kv_items(prefix: str, namespace: str) -> dict[str, bytes]:
    """Every key under ``prefix`` with its value."""
    client, space = global_worker.gcs_client, namespace.encode()
    keys = await client.async_internal_kv_keys(prefix.encode(), space, timeout=KV_TIMEOUT_S)
    values = await client.async_internal_kv_multi_get(keys, space, timeout=KV_TIMEOUT_S) if keys else {}
    return {key.decode(): value for key, value in values.items()}


def serve_tracing_enabled() -> bool:
    """Whether Ray Serve set up tracing in this process (its ``tracing_config``, or ``RAY_SERVE_TRACING_*``): a
    replica's is set up before its deployment's constructor runs."""
    from ray.serve._private.tracing_utils import is_tracing_enabled

    return is_tracing_enabled()
