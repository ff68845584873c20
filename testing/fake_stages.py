"""A fake stage protocol for tests of the request path and the ingress, where the engines are not the subject: it
records every call, and can lose, fail or hang the calls it is told to. Its images are flat: every pixel is the
image's seed (mod 256), at the requested size; a preview's are the seed plus its step. A Layered image's layers are
RGBA, layer k's pixels the seed plus k; a caption is "a caption of <the image handle's call>"."""

from __future__ import annotations

import asyncio

import numpy as np

from omni_ray.config import LoraEntry
from omni_ray.errors import StageCall, StageLostError
from omni_ray.records import Caption, Decoded, Finished, Follows, Preview, StepDone
from omni_ray.request_path import Stages


class Call:
    """A started call's handle: what the fake stage was asked, and whether it was cancelled."""

    def __init__(self, name, args):
        self.name, self.args, self.cancelled = name, args, False
        self.share: tuple[int, str] | None = None  # (priority, tenant) a VAE call was given

    def __repr__(self):
        return f"Call({self.name})"


class FakeStages(Stages[Call]):
    """Records every call. ``lose`` maps a call name to how many of its calls are lost with their replica (a lost
    encode_prompt or encode_image surfaces in the denoise that reads it, as across Ray); ``fail`` to an error every
    such call raises;
    ``hang`` names a call that never ends."""

    def __init__(self, lose=None, fail=None, hang=None):
        self.lose, self.fail, self.hang = dict(lose or {}), dict(fail or {}), hang
        self.calls: list[Call] = []
        self.lost: set[int] = set()  # ids of handles whose result was lost

    def _call(self, name, *args) -> Call:
        call = Call(name, args)
        self.calls.append(call)
        return call

    def _loses(self, name) -> bool:
        if self.lose.get(name, 0) > 0:
            self.lose[name] -= 1
            return True
        return False

    def calls_to(self, name):
        return [call for call in self.calls if call.name == name]

    def put_image(self, image):
        return self._call("put_image", image)

    def encode_prompt(self, request, images):
        call = self._call("encode_prompt", request, images)
        if self._loses("encode_prompt"):
            self.lost.add(id(call))
        return call

    def encode_image(self, request_id, image, seed=None, draw=0, mask=None, *, priority=0, tenant=""):
        call = self._call("encode_image", request_id, image, *([seed, draw] if seed is not None else []),
                          *([mask] if mask is not None else []))
        call.share = (priority, tenant)
        if self._loses("encode_image"):
            self.lost.add(id(call))
        return call

    async def caption(self, request, image):
        call = self._call("caption", request, image)
        await self._run(call)
        if self._loses("caption"):
            raise StageLostError("encoder", StageCall.CAPTION)
        return Caption(f"a caption of {image!r}", (1, 2, 3))

    async def _run(self, call: Call):
        if call.name in self.fail:
            raise self.fail[call.name]
        if self.hang == call.name:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                call.cancelled = True
                raise

    async def denoise(self, request_id, params, prompt, image_latents, start=None, controls=()):
        call = self._call("denoise", request_id, params, prompt, image_latents, start, controls)
        if id(prompt) in self.lost:
            raise StageLostError("encoder", StageCall.ENCODE_PROMPT)
        if any(id(handle) in self.lost for handle in (*image_latents, start, *controls)):
            raise StageLostError("vae", StageCall.ENCODE_IMAGE)
        await self._run(call)
        for step in range(1, params.steps_run + 1):
            await asyncio.sleep(0)
            if params.first_step + step in params.previews:
                yield StepDone(step, params.steps_run, Follows.PREVIEW)
                yield Preview(Call("preview", (step, params)))
            else:
                yield StepDone(step, params.steps_run)
        if self._loses("denoise"):
            raise StageLostError("dit", StageCall.DENOISE)
        yield Finished(call)

    async def decode(self, request_id, latents, output, preview=False, *, priority=0, tenant=""):
        call = self._call("decode", request_id, latents, output)
        call.share = (priority, tenant)
        await self._run(call)
        if self._loses("decode"):
            raise StageLostError("vae", StageCall.DECODE)
        if latents.name == "preview":
            step, params = latents.args
            return Decoded(pixels=np.full((params.height, params.width, 3), (params.seed + step) % 256, np.uint8),
                           latents=None)
        params = latents.args[1]
        if params.layers:
            layers = [np.full((params.height, params.width, 4), (params.seed + k) % 256, np.uint8)
                      for k in range(params.layers)]
            return Decoded(pixels=np.stack(layers) if output != "latents" else None, latents=None)
        pixels = np.full((params.height, params.width, 3), params.seed % 256, np.uint8)
        return Decoded(pixels=pixels if output != "latents" else None, latents=None)

    def cancel(self, handle):
        handle.cancelled = True

    async def check_lora(self, path):
        call = self._call("check_lora", path)
        await self._run(call)
        return LoraEntry(path=path)
