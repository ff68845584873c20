"""The coordinator's routes: which method of ``CrossEngineCoordinator`` answers each path, attached to a FastAPI app
when the app is built (after Ray Serve LLM's ``make_fastapi_ingress``), so the same routes run under Serve and under
starlette's ``TestClient``."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.exceptions import HTTPException

from deployments.http import bodies
from omni_ray.api.responses import error_body
from omni_ray.errors import OmniRayError, RequestError

# The routes, by method name: what build_api attaches.
ROUTES = {
    "generations": ("POST", "/v1/images/generations", {}),
    "edits": ("POST", "/v1/images/edits", {}),
    "page": ("GET", "/", {"response_class": HTMLResponse}),
    "web_file": ("GET", "/web/{name}", {}),
    "models": ("GET", "/v1/models", {}),
    "model": ("GET", "/v1/models/{model}", {}),
    "load_lora_adapter": ("POST", "/v1/load_lora_adapter", {}),
    "unload_lora_adapter": ("POST", "/v1/unload_lora_adapter", {}),
    "health": ("GET", "/health", {}),
}


def build_api(target) -> FastAPI:
    """The FastAPI app with every route of ``ROUTES`` attached to ``target``'s methods: the coordinator class, whose
    methods Serve's ingress binds to each replica's instance (``serve.ingress(build_api(cls))(cls)``), or an
    instance, served as it is (tests, with starlette's ``TestClient``)."""
    api = FastAPI(title="omni-ray", description="Qwen-Image behind OpenAI's images API.")
    api.add_exception_handler(OmniRayError, bodies.error_response)
    api.add_exception_handler(HTTPException, routing_error)
    for name, (method, path, options) in ROUTES.items():
        api.add_api_route(path, getattr(target, name), methods=[method], **options)
    return api


async def routing_error(request: Request, err: HTTPException) -> JSONResponse:
    """What the router itself refuses (a path no route has, a method the path does not take) in OpenAI's error
    body, as its API answers an unknown URL, with the ``Allow`` header of a 405."""
    what = f"{request.method} {request.url.path}"
    if err.status_code == 404:
        message = f"Invalid URL ({what}): the routes are under /v1/images/ and /v1/models"
    elif err.status_code == 405:
        message = f"Invalid method ({what}): this path takes {(err.headers or {}).get('Allow', 'another method')}"
    else:
        message = f"{what}: {err.detail}"
    return JSONResponse(error_body(RequestError(message)), err.status_code, headers=err.headers)
