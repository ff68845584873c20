"""Live previews (issue 17): a streamed request's partial_images, in process through the one request path."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import REPO

from omni_ray.api.planning import preview_steps
from omni_ray.config import load_config
from omni_ray.request_path import ImageDone, ImagePreview, Progress
from testing.numerics import assert_within_a_level


def test_preview_steps_are_spread_before_the_last():
    assert preview_steps(0, 8) == ()
    assert preview_steps(1, 8) == (4,)
    assert preview_steps(2, 9) == (3, 6)
    assert preview_steps(3, 8) == (2, 4, 6)
    assert preview_steps(3, 2) == (1,)  # fewer steps than previews: what fits
    assert preview_steps(2, 1) == ()


@pytest.mark.vllm  # the encoder is vLLM's, in this process
def test_partial_images_come_before_each_image_and_move_towards_it(tiny_dir):
    from omni_ray.pipeline import Pipeline

    pipeline = Pipeline(load_config(REPO / "stage_configs" / "qwen_image_tiny.yaml", model=str(tiny_dir)))

    async def events(body):
        return [event async for event in pipeline.events(body)]

    try:
        body = {"prompt": "a red cat", "negative_prompt": "blurry", "size": "64x64", "seed": 4, "n": 2,
                "num_inference_steps": 6}
        streamed = asyncio.run(events({**body, "stream": True, "partial_images": 2}))
        plain = asyncio.run(events(body))  # not streamed: no previews
    finally:
        pipeline.shutdown()
    assert not [e for e in plain if isinstance(e, ImagePreview)]
    for index in range(2):
        mine = [e for e in streamed if getattr(e, "index", None) == index]
        kinds = [type(e).__name__ for e in mine if not isinstance(e, Progress)]
        assert kinds == ["ImagePreview", "ImagePreview", "ImageDone"], kinds
        first, second, done = (e for e in mine if not isinstance(e, Progress))
        assert (first.partial_index, second.partial_index) == (0, 1)
        unstreamed = next(e for e in plain if isinstance(e, ImageDone) and e.index == index).result.pixels
        # Previews change nothing in the image (float32 reordering aside: the streamed run's final decode may share a
        # VAE batch with the other image's preview, and its steps another DiT batch).
        assert_within_a_level(done.result.pixels, unstreamed, index)
        final = done.result.pixels.astype(int)
        assert first.result.pixels.shape == final.shape
        # Each preview is the clean image the DiT predicts at its step: the later one is nearer the result.
        assert np.abs(second.result.pixels - final).mean() < np.abs(first.result.pixels - final).mean()
        # A preview follows the progress event of its step (steps 2 and 4 of 6).
        steps = [e.step for e in mine if isinstance(e, Progress)]
        assert steps == list(range(1, 7))
        progress_at = {e.step: i for i, e in enumerate(mine) if isinstance(e, Progress)}
        assert progress_at[2] < mine.index(first) and progress_at[4] < mine.index(second)
