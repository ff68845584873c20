"""A Python client for a running omni-ray app: over HTTP from anywhere, or through Ray from inside the cluster (or
from outside it, through the head's Ray Client server).

    from omni_ray.api.client import Client

    images = Client.http("http://127.0.0.1:8000").generate("a red cat", size="256x256", seed=0)
    images = Client.http(api_key="...").generate("a red cat")    # a server with OMNI_RAY_API_KEY set
    images = Client.ray(address="auto").generate("a red cat", n=4)   # after the app is deployed
    images = Client.ray(address="ray://head:10001").generate("a red cat", progress=True)  # from outside: Ray Client
    images = Client.http().edit("cat.png", "make the cat blue")      # an app serving an edit preset
    images = Client.http().edit(["a.png", "b.png"], "put the cat on the sofa")   # an Edit-Plus preset
    images = Client.http().edit("cat.png", "a dog", mask="mask.png")  # repaint where the PNG mask is transparent

Both return PIL images and raise ``RequestError`` (the request was invalid) or ``EngineError`` (a stage failed).
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import pathlib
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

from omni_ray import env
from omni_ray.errors import EngineError, RequestError

APP_NAME = "omni-ray"


def connect_ray(address: str | None = "auto", **options: Any) -> None:
    """``ray.init`` for a driver that calls a Serve app, safe to repeat against another cluster in one process.

    Ray Serve caches its controller's handle per driver job id, and job ids repeat from cluster to cluster (the
    second driver of any cluster is job 2), so a process that talked to one cluster would reuse a dead handle on
    the next ("Can't find actor ..."). Forgetting the cache after connecting makes Serve look the controller up.

    A Ray Client address (``ray://``) is tried up to three times: the head starts a server process for each
    connection, and under load that start at times fails at once, leaving no log ("Starting Ray client server
    failed"; once in a CI run of the suite), while the next connection's, on a fresh port, succeeds.

    A connection still open is closed first: after ``ray.shutdown`` Serve's handle threads live on, and a Ray call
    one of them makes connects this process again by itself (``ray.init()`` with no address: a benchmark's next
    connection was refused as "ray.init twice").
    """
    import ray
    from ray.serve import context

    if ray.is_initialized():
        ray.shutdown()
    attempts = 3 if str(address).startswith("ray://") else 1
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address=address, log_to_driver=False, **options)
            break
        except ConnectionAbortedError:  # Ray Client's "Initialization failure from server" (it disconnected)
            if attempt == attempts:
                raise
            time.sleep(attempt)
    context._set_global_client(None)


Uploads = tuple[list[bytes], "bytes | None"]  # an edit's image files, and its mask file


class Client:
    """Sends OpenAI-style image requests to the app and decodes the images."""

    def __init__(self, send, stream):
        self._send = send  # (body dict, an edit's Uploads or None) -> response dict
        self._stream = stream  # (body dict, Uploads or None) -> iterator of event dicts

    @classmethod
    def http(cls, base_url: str = "http://127.0.0.1:8000", timeout_s: float = 600.0, api_key: str | None = None
             ) -> Client:
        """A client of the app's HTTP API; ``api_key`` (by default ``OMNI_RAY_API_KEY``'s first key, if set) for a
        server that needs one."""
        base_url = base_url.rstrip("/")
        api_key = api_key or next(iter(env.api_keys()), None)
        auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}

        def post(body: dict, uploads: Uploads | None):
            if uploads is None:
                url, data = base_url + "/v1/images/generations", json.dumps(body).encode()
                content_type = "application/json"
            else:
                url = base_url + "/v1/images/edits"
                data, content_type = _multipart(body, *uploads)
            request = urllib.request.Request(url, data=data, headers={"Content-Type": content_type, **auth})
            try:
                return urllib.request.urlopen(request, timeout=timeout_s)
            except urllib.error.HTTPError as err:
                raise _error_from_body(err.code, err.read()) from None

        def send(body: dict, uploads: Uploads | None) -> dict:
            with post(body, uploads) as response:
                return json.loads(response.read())

        def stream(body: dict, uploads: Uploads | None) -> Iterator[dict]:
            with post({**body, "stream": True, "progress": True}, uploads) as response:
                for line in response:
                    if line.startswith(b"data: "):
                        yield json.loads(line[len(b"data: "):])

        return cls(send, stream)

    @classmethod
    def ray(cls, address: str | None = "auto", app_name: str = APP_NAME) -> Client:
        """A client that calls the app's ingress through its ``DeploymentHandle``: no HTTP on the way. ``address``
        may be a Ray Client one (``ray://head:10001``), from outside the cluster: Ray Client streams no handle call,
        so a streamed request's events come through a queue actor the coordinator puts them into as they happen."""
        import ray
        from ray import serve
        from ray.exceptions import RayTaskError

        if not ray.is_initialized():
            connect_ray(address)
        handle = serve.get_app_handle(app_name)
        through_ray_client = ray.util.client.ray.is_connected()

        def send(body: dict, uploads: Uploads | None) -> dict:
            images, mask = uploads or (None, None)
            try:
                return handle.generate.remote(body, image=images, mask=mask).result()
            except RayTaskError as err:  # the coordinator's own error, without Ray's traceback text
                raise err.cause from None

        def stream(body: dict, uploads: Uploads | None) -> Iterator[dict]:
            images, mask = uploads or (None, None)
            body = {**body, "progress": True}
            try:
                if through_ray_client:
                    yield from _queued_events(handle, body, images, mask)
                else:
                    yield from handle.options(stream=True).generate_stream.remote(body, image=images, mask=mask)
            except RayTaskError as err:
                raise err.cause from None

        return cls(send, stream)

    def generate(self, prompt: str, progress: bool = False, **options: Any) -> list:
        """PIL images for ``prompt``; ``options`` are the API's fields (``n``, ``size``, ``seed``, ``negative_prompt``,
        ``num_inference_steps``, ``true_cfg_scale``, ``output_format``, ...). ``progress`` streams the request and
        shows a progress bar of its denoising steps."""
        return self._images(prompt, None, progress, options)

    def edit(self, image, prompt: str, progress: bool = False, mask=None, **options: Any) -> list:
        """PIL images of ``image`` (a path, the file's bytes, or a PIL image; a list of them for an Edit-Plus preset)
        edited as ``prompt`` says, from an app serving an edit preset; with ``mask`` (OpenAI's: a PNG of the image's
        size, fully transparent where to change), only there, on an edit or text-to-image preset. ``options`` and
        ``progress`` as for ``generate``."""
        images = list(image) if isinstance(image, (list, tuple)) else [image]
        uploads = ([_file_bytes(item) for item in images], _file_bytes(mask) if mask is not None else None)
        return self._images(prompt, uploads, progress, options)

    def _images(self, prompt: str, image: Uploads | None, progress: bool, options: dict) -> list:
        body = {"prompt": prompt, **{k: v for k, v in options.items() if v is not None}}
        if not progress:
            return [_image(item["b64_json"]) for item in self._send(body, image)["data"]]
        from tqdm import tqdm

        images = {}
        # Closed however the loop ends, so the request stops at once when this caller stops reading.
        with tqdm(desc="denoising", unit="step") as bar, contextlib.closing(self._stream(body, image)) as events:
            for event in events:
                kind = event["type"].rsplit(".", 1)[-1]  # image_generation.* or image_edit.*
                if kind == "progress":
                    bar.total = event["total_steps"] * body.get("n", 1)
                    bar.update(1)
                elif kind == "completed":
                    images[event["index"]] = _image(event["b64_json"])
                elif kind == "error":
                    raise _error_from_body(500, json.dumps(event).encode())
        return [images[index] for index in sorted(images)]


def _queued_events(handle, body: dict, images: list[bytes] | None, mask: bytes | None) -> Iterator[dict]:
    """A streamed call's events over Ray Client, which streams no handle call: the coordinator puts them into a
    queue actor in the cluster as they happen (``generate_into``), then None. A caller that stops reading cancels
    the call; the queue is killed however the call ends, and, owned by this Ray Client session, dies with it too,
    which the coordinator takes as its caller gone."""
    from ray.util.queue import Empty, Queue

    queue = Queue(actor_options={"num_cpus": 0})
    response = handle.generate_into.remote(queue, body, image=images, mask=mask)
    returned = ended = False  # returned: the call is over, so everything it put is in the queue
    try:
        while True:
            try:
                event = queue.get(block=not returned, timeout=1.0)
            except Empty:
                if returned:  # it ended without its None (its replica lost): its error
                    ended = True
                    response.result()
                    return
                returned = _returned(response)  # raises the call's own error
                continue
            if event is None:
                ended = True
                response.result()  # the coordinator's refusal, if it refused
                return
            yield event
    finally:
        if not ended:
            response.cancel()
        queue.shutdown(force=True)


def _returned(response) -> bool:
    """Whether a handle call is over (raising its error if it failed), without waiting."""
    try:
        response.result(timeout_s=0)
    except TimeoutError:
        return False
    return True


def _file_bytes(image) -> bytes:
    """An image file's bytes from a path, the bytes themselves, or a PIL image (written as PNG)."""
    if isinstance(image, (str, pathlib.Path)):
        return pathlib.Path(image).read_bytes()
    if isinstance(image, bytes):
        return image
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _multipart(fields: dict, images: list[bytes], mask: bytes | None = None) -> tuple[bytes, str]:
    """``fields``, the ``images`` files and the ``mask`` file as a multipart/form-data body, as OpenAI's images API
    takes edits (one file as ``image``, several as ``image[]``, as OpenAI's client sends them)."""
    boundary = uuid.uuid4().hex
    parts = []
    for name, value in fields.items():
        text = json.dumps(value) if isinstance(value, (bool, dict)) else str(value)  # cache: a JSON object
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{text}\r\n'.encode())
    name = "image" if len(images) == 1 else "image[]"
    for field, data in [(name, image) for image in images] + ([("mask", mask)] if mask is not None else []):
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"; filename="{field}"\r\n'
            f"Content-Type: application/octet-stream\r\n\r\n".encode() + data + b"\r\n"
        )
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def _image(b64: str):
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(b64)))


def _error_from_body(status: int, body: bytes) -> Exception:
    try:
        error = json.loads(body)["error"]
        message, param = error["message"], error.get("param")
    except (ValueError, KeyError, TypeError):
        message, param = body.decode(errors="replace"), None
    return RequestError(message, param=param) if 400 <= status < 500 else EngineError(f"HTTP {status}: {message}")
