"""A Python client for a running omni-ray app: over HTTP from anywhere, or through Ray from inside the cluster.

    from omni_ray.client import Client

    images = Client.http("http://127.0.0.1:8000").generate("a red cat", size="256x256", seed=0)
    images = Client.ray(address="auto").generate("a red cat", n=4)   # after the app is deployed

Both return PIL images and raise ``RequestError`` (the request was invalid) or ``EngineError`` (a stage failed).
"""

from __future__ import annotations

import base64
import io
import json
import urllib.error
import urllib.request
from typing import Any

from omni_ray.errors import EngineError, RequestError

APP_NAME = "omni-ray"


class Client:
    """Sends OpenAI-style image requests to the app and decodes the images."""

    def __init__(self, send):
        self._send = send  # body dict -> response dict

    @classmethod
    def http(cls, base_url: str = "http://127.0.0.1:8000", timeout_s: float = 600.0) -> Client:
        """A client of the app's HTTP API."""
        url = base_url.rstrip("/") + "/v1/images/generations"

        def send(body: dict) -> dict:
            data = json.dumps(body).encode()
            request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as err:
                raise _error_from_body(err.code, err.read()) from None

        return cls(send)

    @classmethod
    def ray(cls, address: str | None = "auto", app_name: str = APP_NAME) -> Client:
        """A client that calls the app's ingress through its ``DeploymentHandle``: no HTTP on the way."""
        import ray
        from ray import serve

        from ray.exceptions import RayTaskError

        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)
        handle = serve.get_app_handle(app_name)

        def send(body: dict) -> dict:
            try:
                return handle.generate.remote(body).result()
            except RayTaskError as err:  # the coordinator's own error, without Ray's traceback text
                raise err.cause from None

        return cls(send)

    def generate(self, prompt: str, **options: Any) -> list:
        """PIL images for ``prompt``; ``options`` are the API's fields (``n``, ``size``, ``seed``, ``negative_prompt``,
        ``num_inference_steps``, ``true_cfg_scale``, ``output_format``, ...)."""
        from PIL import Image

        response = self._send({"prompt": prompt, **{k: v for k, v in options.items() if v is not None}})
        return [Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))) for item in response["data"]]


def _error_from_body(status: int, body: bytes) -> Exception:
    try:
        error = json.loads(body)["error"]
        message, param = error["message"], error.get("param")
    except (ValueError, KeyError, TypeError):
        message, param = body.decode(errors="replace"), None
    return RequestError(message, param=param) if 400 <= status < 500 else EngineError(f"HTTP {status}: {message}")
