"""Qwen-Image, its Edit releases (Edit, Edit-2509 and 2511's Edit-Plus) and Qwen-Image-2512: the family the shared
runners were built for. Its facts are ``facts``; what it adds to ``Family``'s defaults is below."""

from __future__ import annotations

from omni_ray.families.base import Family


class QwenImage(Family):
    name = "qwen-image"
    title = "Qwen-Image"
    pipeline_class = "QwenImagePipeline"
    pipelines = ("QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline")
    controlnets = True

    def pipeline(self, config) -> str:
        """QwenImagePipeline, or the preset's edit pipeline (Edit, or Edit-Plus with ``edit.plus``)."""
        return config.edit.pipeline if config.edit is not None else self.pipeline_class

    def check_preset(self, config) -> None:
        super().check_preset(config)
        if config.edit is not None and config.edit.max_images > 1 and not config.edit.plus:
            raise ValueError("edit.max_images: Qwen-Image-Edit takes one image; several need an Edit-Plus checkpoint "
                             "(plus: true) or family qwen-image-2.1")
