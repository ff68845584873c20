"""The encoder stage's deployment: Qwen2.5-VL under vLLM's engine core, prompts (and an edit's input images) to
prompt embeddings."""

from __future__ import annotations

import numpy as np

from deployments import metrics
from deployments.stage import StageDeployment
from omni_ray.config import PipelineConfig
from omni_ray.engine.builders import build_encoder_core
from omni_ray.records import EncodedPrompt, EncodeRequest


class Encoder(StageDeployment):
    """Qwen2.5-VL under vLLM's engine core: prompts (and an edit's input image) to prompt embeddings."""

    stage = "encoder"

    def __init__(self, config: PipelineConfig):
        self._cache_counted = (0, 0)  # prompt-cache hits and misses already exported
        super().__init__(lambda: build_encoder_core(config))

    def _record_step(self, seconds: float, batch: int, held: int) -> None:
        super()._record_step(seconds, batch, held)
        cache = self.engine.core.cache
        if cache is None:
            return
        hits, misses = cache.num_hits, cache.num_misses
        for outcome, count in (("hit", hits - self._cache_counted[0]), ("miss", misses - self._cache_counted[1])):
            if count:  # Ray's counters refuse 0
                metrics.prompt_cache.inc(count, tags={**self.tags, "outcome": outcome})
        self._cache_counted = (hits, misses)
        self._idle_gauges()

    def _idle_gauges(self) -> None:
        cache = self.engine.core.cache
        if cache is not None:
            metrics.prompt_cache_bytes.set(cache.nbytes, tags=self.tags)

    def stats(self) -> dict:
        """The engine's counters, the texts it encoded, and its prompt cache's hits, misses, entries and bytes."""
        core = self.engine.core
        cache = core.cache
        return {**super().stats(), "encoded": core.num_encoded,
                "prompt_cache": {"hits": cache.num_hits, "misses": cache.num_misses, "entries": len(cache),
                                 "bytes": cache.nbytes} if cache is not None else None}

    async def encode(self, request: EncodeRequest, *images: np.ndarray) -> EncodedPrompt:
        """``images`` come apart from the request so that Ray resolves the coordinator's references to them."""
        request.images = images
        return await self._run(request, "encoded", {})


