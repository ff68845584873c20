"""The response encoding that runs on the coordinator's threads: chunked base64 and JSON with the images spliced
in give exactly what base64 and json.dumps give."""

from __future__ import annotations

import base64
import json
import os

import pytest

from omni_ray.protocol import B64_CHUNK, b64encode, json_bytes


@pytest.mark.parametrize("size", [0, 1, 2, 3, B64_CHUNK - 1, B64_CHUNK, B64_CHUNK + 1, 5 * B64_CHUNK + 2])
def test_chunked_base64_equals_base64(size):
    data = os.urandom(size)
    assert b64encode(data) == base64.b64encode(data).decode()


def test_json_with_spliced_images_equals_json_dumps():
    images = [b64encode(os.urandom(n)) for n in (10, 3 * B64_CHUNK + 5)]
    response = {"created": 1, "data": [{"b64_json": images[0], "timings_ms": {"dit": 1.5}},
                                       {"b64_json": images[1], "note": 'quotes " and \\ and \u00e9'}],
                "output_format": "png", "size": "64x64"}
    event = {"type": "image_generation.completed", "index": 1, "b64_json": images[1], "size": "64x64"}
    for body in (response, event, {"type": "image_generation.progress", "step": 3}, {"data": []}):
        assert json_bytes(body) == json.dumps(body).encode()
