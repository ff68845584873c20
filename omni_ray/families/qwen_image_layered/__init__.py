"""Qwen-Image-Layered: an RGBA image decomposed into layers, on the shared Qwen-Image runners (a layer axis in the
rotary embedding, the RGBA VAE, layered latents) and an encoder that captions the image when the prompt is empty.
Its facts are ``facts``."""

from __future__ import annotations

from omni_ray.errors import RequestError
from omni_ray.families.base import Family
from omni_ray.families.qwen_image_layered import facts


class QwenImageLayered(Family):
    name = facts.FAMILY
    title = "Qwen-Image-Layered"
    pipeline_class = facts.PIPELINE
    rgba = True
    layers = True
    captions = True
    # Captions read the input image at its working size: about the largest resolution bucket's area, at any aspect
    # ratio. Twice that area bounds Qwen2.5-VL's processor (``max_pixels``) without ever binding, so the caption reads
    # the image the pipeline's processor reads, and sizes vLLM's budget for one caption image.
    caption_image_pixels = 2 * max(facts.RESOLUTIONS) ** 2

    def check_preset(self, config) -> None:
        super().check_preset(config)
        if config.edit is None:
            raise ValueError("edit: Qwen-Image-Layered decomposes an input image (it serves /v1/images/edits); set "
                             "`edit`")
        if config.edit.plus or config.edit.max_images != 1:
            raise ValueError("edit.max_images: Qwen-Image-Layered takes one input image, without Edit-Plus (plus: "
                             "false, max_images: 1)")
        if config.edit.resolutions is None:
            raise ValueError("edit.resolutions: Qwen-Image-Layered sizes its input image by resolution bucket; set "
                             "them (the pipeline's: [640, 1024])")
        not_yet = {  # what the Qwen-Image runners have and the layered path does not (yet)
            "controlnets": bool(config.controlnets),
            "dit.compile": config.dit.compile,  # its warm-up steps plain requests, which a layered replica refuses
            "dit.quantization": config.dit.quantization != "none",
            "dit.parallel": config.dit.parallel.world_size > 1, "vae.parallel": config.vae.parallel.world_size > 1,
            "vae.tiling": config.vae.tiling,
            "runner": "simulated" in (config.encoder.runner, config.dit.runner, config.vae.runner),
        }
        for name, asked in not_yet.items():
            if asked:
                raise ValueError(f"{name}: not available for {self.name} yet")
        if config.build_if_missing == "dummy" and config.configs != self.name:
            raise ValueError("configs: a Qwen-Image-Layered dummy checkpoint is written from qwen-image-layered's "
                             "configs")

    def write_checkpoint(self, model_dir, config) -> None:
        """A tiny checkpoint has its own layout (``checkpoints.tiny``'s ``layered``); a dummy one is the base's."""
        if config.build_if_missing == "dummy":
            super().write_checkpoint(model_dir, config)
            return
        from omni_ray.checkpoints.tiny import write_checkpoint

        write_checkpoint(model_dir, seed=0, size=config.build_if_missing, layered=True)

    def check_route(self, config, has_image: bool, has_mask: bool) -> None:
        if has_mask:
            raise RequestError(f"mask: {config.name!r} decomposes the whole image into layers; it takes no mask",
                               param="mask")
        super().check_route(config, has_image, has_mask)

    def page_settings(self, config) -> dict:
        """The page's Layers fields: the preset's resolution buckets (the first the server's default), the layer
        bounds and default, the caption languages (the first the server's default)."""
        return {"layered": {"resolutions": list(config.edit.resolutions), "min_layers": facts.MIN_LAYERS,
                            "max_layers": facts.MAX_LAYERS, "default_layers": facts.DEFAULT_LAYERS,
                            "caption_languages": list(facts.CAPTION_LANGUAGES)}}
