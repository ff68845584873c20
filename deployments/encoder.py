"""The encoder stage's deployment: Qwen2.5-VL under vLLM's engine core, prompts (and an edit's input images) to
prompt embeddings."""

from __future__ import annotations

import dataclasses

import numpy as np

from deployments import metrics
from deployments.stage import StageDeployment
from omni_ray.config import PipelineConfig
from omni_ray.engine.builders import build_encoder_core
from omni_ray.engine.stats import EngineStats
from omni_ray.live_settings import EncoderLive
from omni_ray.records import Caption, CaptionRequest, EncodedPrompt, EncodeRequest


class Encoder(StageDeployment):
    """Qwen2.5-VL under vLLM's engine core: prompts (and an edit's input image) to prompt embeddings."""

    stage = "encoder"
    live_settings = EncoderLive

    def __init__(self, config: PipelineConfig):
        self._cache_counted = (0, 0)  # prompt-cache hits and misses already exported
        super().__init__(lambda: build_encoder_core(config, self.card), config)

    def _apply(self, live: EncoderLive) -> None:
        max_num_seqs = live.max_num_seqs or self.preset.max_num_seqs
        self.engine.submit(lambda core: core.set_limits(max_num_seqs=max_num_seqs))

    def _record_step(self, seconds: float, batch: int) -> None:
        super()._record_step(seconds, batch)
        cache = self.engine.stats.core.prompt_cache
        if cache is None:
            return
        for outcome, count in (("hit", cache.hits - self._cache_counted[0]),
                               ("miss", cache.misses - self._cache_counted[1])):
            if count:  # Ray's counters refuse 0
                metrics.prompt_cache.inc(count, tags={**self.tags, "outcome": outcome})
        self._cache_counted = (cache.hits, cache.misses)

    def _set_gauges(self, stats: EngineStats) -> None:
        super()._set_gauges(stats)
        if stats.core is not None and stats.core.prompt_cache is not None:
            metrics.prompt_cache_bytes.set(stats.core.prompt_cache.bytes, tags=self.tags)

    def stats(self) -> dict:
        """The engine's counters, the texts it encoded, its prompt cache's hits, misses, entries and bytes, and the
        captions it wrote and had from its caption cache (Qwen-Image-Layered)."""
        core = self.engine.stats.core
        cache = core.prompt_cache
        return {**super().stats(), "encoded": core.encoded,
                "prompt_cache": dataclasses.asdict(cache) if cache is not None else None,
                "captioned": core.captioned, "caption_hits": core.caption_hits}

    async def encode(self, request: EncodeRequest, *images: np.ndarray) -> EncodedPrompt:
        """``images`` come apart from the request so that Ray resolves the coordinator's references to them."""
        request.images = images
        return await self._run(request, "encoded")

    async def caption(self, request: CaptionRequest, image: np.ndarray) -> Caption:
        """Qwen-Image-Layered's caption of ``image``, which comes apart from the request (by reference) as
        ``encode``'s images do."""
        request.image = image
        return await self._run(request, "captioned")
