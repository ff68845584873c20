"""A request planned once: validated against the preset, sizes resolved, seeds assigned, true CFG decided.

``plan_request`` turns a body (and an edit's input images) into a ``GenerationPlan``, the one record the request
path runs, in numbered steps as diffusers' pipelines check their inputs; every refusal is a ``RequestError`` naming
its field. What each image then asks of the DiT (``GenerationPlan.denoise_params``) is read off the plan.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omni_ray.api.images import check_sides, load_control_images, load_control_masks
from omni_ray.api.schema import MAX_SEED, ImageGenerationRequest, parse_request
from omni_ray.config import CacheSettings, EditConfig, LoraEntry, PipelineConfig, SamplingRecipe
from omni_ray.errors import NotFoundError, RequestError
from omni_ray.families import family_of
from omni_ray.families.qwen_image.facts import (
    INPAINT_STRENGTH,
    VISION_TOKENS,
    dit_work_tokens,
    inpaint_start,
    template_for,
    uses_true_cfg,
)
from omni_ray.families.qwen_image_layered import facts as qwen_image_layered
from omni_ray.records import Control, DenoiseParams, Inpaint, InputImages, LoraRef, TokenCount

if TYPE_CHECKING:
    import numpy as np

CountTokens = Callable[[str, tuple[tuple[int, int], ...]], TokenCount]  # (text, image sizes) -> its tokens


@dataclass(frozen=True, slots=True)
class GenerationPlan:
    """A validated request with the preset's defaults filled in: what the coordinator runs."""

    request: ImageGenerationRequest
    height: int
    width: int
    num_inference_steps: int
    seed: int  # image i uses seed + i
    true_cfg: bool = False  # runs the unconditional pass too (diffusers' rule), decided here once for every stage
    cache: CacheSettings | None = None  # the request's, or the preset's default
    loras: tuple[LoraRef, ...] = ()  # the LoRA adapters `loras` names (or `model`'s one), each at its scale
    true_cfg_scale: float | None = None  # the request's, or its adapter's recipe's when the request does not set it;
    # None takes the request's
    scheduler: tuple[tuple[str, object], ...] = ()  # the adapters' recipe's scheduler settings, over the checkpoint's
    quality: str = "high"  # OpenAI's quality level the steps are nearest to: what responses name as used
    inputs: InputImages | None = None  # edits: the input images, for the VAE and for the encoder
    inpaint: Inpaint | None = None  # a masked edit: the mask (inputs.mask) and the strength
    input_tokens: TokenCount = TokenCount(0)  # what the encoder reads: the prompt, and the negative with true CFG
    timeout_s: float = 600.0  # the request's deadline: its own `timeout`, or the preset's requests.timeout_s
    tenant: str = ""  # who the DiT shares steps fairly between: the caller's API key's name, or `user`
    sigmas: tuple[float, ...] | None = None  # Qwen-Image 2.1 left at the checkpoint's steps: its sample_sigmas
    rgba: bool = False  # the images come with an alpha channel (Qwen-Image 2.1's VAE draws RGBA)
    controls: tuple[Control, ...] = ()  # the ControlNets the request applies (`control`), in its order
    control_images: tuple[np.ndarray, ...] = ()  # their control images, uint8 [height, width, 3] each (the output's
    # size), in the same order: the VAE samples each with an image's seed, the k-th after k others
    control_masks: tuple[np.ndarray | None, ...] = ()  # per control, an inpainting ControlNet's mask (uint8
    # [height, width], 1 repaints), None for the others
    layers: int = 0  # Qwen-Image-Layered: the layers each image is decomposed into (its result: that many RGBA
    # images); 0 for every other model
    cfg_normalize: bool = True  # true CFG's norm rescale (Qwen-Image's always; Layered's per request, off by default)
    caption: str | None = None  # Layered without a prompt: the language of the caption the encoder writes of the
    # image first, to stand for the prompt; None when the request has a prompt

    def __post_init__(self) -> None:
        if self.true_cfg_scale is None:
            object.__setattr__(self, "true_cfg_scale", self.request.true_cfg_scale)

    def denoise_params(self, index: int) -> DenoiseParams:
        """Image ``index``'s DiT parameters: its seed is the request's plus ``index``; a streamed request's
        ``partial_images`` previews come after steps spread evenly before the last (of those a masked edit runs)."""
        request = self.request
        params = DenoiseParams(
            self.height, self.width, self.num_inference_steps, self.seed + index, self.true_cfg_scale, self.cache,
            self.loras, true_cfg=self.true_cfg, priority=request.priority, tenant=self.tenant,
            scheduler=self.scheduler, inpaint=self.inpaint, sigmas=self.sigmas, controls=self.controls,
            layers=self.layers, cfg_normalize=self.cfg_normalize,
        )
        previews = preview_steps(request.partial_images if request.stream else 0, params.steps_run)
        return dataclasses.replace(params, previews=tuple(params.first_step + step for step in previews))

    @property
    def steps_run(self) -> int:
        """Denoising steps each image runs (``DenoiseParams.steps_run``: a masked edit's strength runs fewer)."""
        return self.denoise_params(0).steps_run

    @property
    def work_tokens(self) -> int:
        """Tokens each denoising step of one image pushes through the transformer (``qwen_image.dit_work_tokens``),
        the text's estimated from the tokens the encoder reads."""
        passes = 2 if self.true_cfg else 1
        drop = template_for(self.inputs is not None and self.inputs.conditions).drop  # Edit and Edit-Plus: as many
        text = max(1, self.input_tokens.total // passes - drop)
        image_sizes = self.inputs.condition_sizes if self.inputs is not None else ()
        return dit_work_tokens(self.height, self.width, text, self.true_cfg, image_sizes, self.layers)

    @property
    def images_per_result(self) -> int:
        """Image files each of the ``n`` results makes: its layers (Qwen-Image-Layered), else one."""
        return self.layers or 1

    @property
    def event_prefix(self) -> str:
        """What OpenAI's streamed events of this kind of request are called."""
        return "image_generation" if self.inputs is None else "image_edit"


def preview_steps(count: int, num_steps: int) -> tuple[int, ...]:
    """``count`` distinct steps in 1..num_steps-1, evenly spread (fewer when there are fewer steps than that)."""
    return tuple(sorted({max(1, round(num_steps * (i + 1) / (count + 1))) for i in range(count)} - {num_steps}))


def plan_request(
    body: object,
    config: PipelineConfig,
    count_tokens: CountTokens | None = None,
    image: np.ndarray | InputImages | None = None,
    adapters: Mapping[str, LoraEntry] | None = None,
    has_image: bool | None = None,
    control_images: Sequence[np.ndarray] | None = None,
    control_masks: Sequence[np.ndarray | None] | None = None,
) -> GenerationPlan:
    """Validates ``body`` against the API and the preset; raises RequestError naming the field.

    An edit brings its input images (``api.images.load_inputs``'); the last one's working size is the default output
    size, as diffusers has it. ``count_tokens`` gives a prompt's templated length, checked against the encoder's
    limit and counted in the response's ``usage``. ``adapters`` (name -> file and sampling recipe) are the LoRA
    adapters ``model`` or ``loras`` may name; a request naming one with a recipe gets the recipe's steps, true CFG
    scale and scheduler settings for the fields it does not set. ``has_image`` says the request brought an image that
    was not decoded (the preset takes none). ``control_images`` are the request's control images, decoded
    (``api.images.load_control_images``: the coordinator decodes them on a thread, from a multipart body's files or
    the JSON body); without them, a JSON body's are decoded here. ``control_masks`` are their masks, decoded
    likewise (``api.images.load_control_masks``: None for a control whose ControlNet does not inpaint).
    """
    # 1. The route, then the body: what OpenAI's schema and this server take.
    inputs = InputImages.of(image) if image is not None else None
    has_image = image is not None if has_image is None else has_image
    if asks_for_control(body):
        check_control_route(config, has_image)
    check_route(config, has_image=has_image, has_mask=inputs is not None and inputs.mask is not None)
    request = body if isinstance(body, ImageGenerationRequest) else parse_request(body)
    check_fields(request, config)
    layered = check_layered(request, config)
    if layered and inputs is not None:  # the encoder reads the prompt alone; the VAE the image as RGBA
        inputs = dataclasses.replace(inputs, vae=tuple(map(with_alpha, inputs.vae)), encoder=())
    controls = check_controls(request, config)
    # 2. The model: the base, or LoRA adapters and the sampling recipe of one of them.
    loras = resolve_loras(request, config, adapters or {})
    recipe = next((adapters[lora.name].recipe for lora in loras if adapters[lora.name].recipe is not None), None)
    true_cfg_scale = request.true_cfg_scale
    if recipe is not None and recipe.true_cfg_scale is not None and "true_cfg_scale" not in request.model_fields_set:
        true_cfg_scale = recipe.true_cfg_scale
    elif family_of(config).default_true_cfg_scale is not None and "true_cfg_scale" not in request.model_fields_set:
        true_cfg_scale = family_of(config).default_true_cfg_scale  # its pipeline's default (2.1: no guidance)
    # 3. The size, a masked edit's mask, and the steps.
    if layered and request.size not in (None, "auto"):
        raise RequestError("size: the layers take the input image's working size at its `resolution`; leave size "
                           "out (or auto)", param="size")
    height, width = resolve_size(request, config, inputs.sizes[-1] if inputs is not None and inputs.conditions
                                 else None)
    inpaint = check_mask(request, inputs, height, width)
    if controls and control_images is None:
        control_images = load_control_images(request, None, max_image_bytes(config))
        control_masks = load_control_masks(request, None, control_images, config.inpaint_controlnets,
                                           max_image_bytes(config))
    control_images = check_control_images(controls, control_images or (), height, width)
    control_masks = check_control_masks(controls, control_masks, height, width)
    if controls:  # the decoded images are the plan's: it keeps no base64 text
        request = request.model_copy(update={"control": [c.model_copy(update={"image": None, "mask": None})
                                                         for c in request.control]})
    steps = resolve_steps(request, config, recipe, inpaint)
    sigmas = checkpoint_sigmas(request, config, recipe)
    if sigmas is not None:
        steps = len(sigmas)
    # 4. True CFG, decided once; what the encoder reads, within its limit.
    true_cfg = uses_true_cfg(true_cfg_scale, request.negative_prompt is not None)
    caption = None
    if layered and qwen_image_layered.needs_caption(request.prompt):
        caption = request.caption_language or "en"
    input_tokens = count_input_tokens(request, config, count_tokens, inputs if not layered else None, true_cfg,
                                      caption is not None)
    # 5. The plan, seeds assigned.
    return GenerationPlan(
        request=request,
        height=height,
        width=width,
        num_inference_steps=steps,
        seed=request.seed if request.seed is not None else random.randint(0, MAX_SEED - request.n + 1),
        true_cfg=true_cfg,
        cache=request.cache if "cache" in request.model_fields_set else config.dit.cache,
        loras=loras,
        true_cfg_scale=true_cfg_scale,
        scheduler=tuple(sorted(recipe.scheduler.items())) if recipe is not None else (),
        quality=request.quality if request.quality != "auto" and request.num_inference_steps is None
        else quality_level(steps, config),
        inputs=inputs,
        inpaint=inpaint,
        input_tokens=input_tokens,
        timeout_s=request.timeout or config.requests.timeout_s,
        tenant=request.user or "",
        sigmas=sigmas,
        rgba=family_of(config).rgba,
        controls=controls,
        control_images=control_images,
        control_masks=control_masks,
        layers=(request.layers or qwen_image_layered.DEFAULT_LAYERS) if layered else 0,
        cfg_normalize=bool(request.cfg_normalize) if layered else True,
        caption=caption,
    )


def with_alpha(image: np.ndarray) -> np.ndarray:
    """An RGB image as RGBA, opaque (PIL's ``convert("RGBA")``); an RGBA one as it is."""
    import numpy as np

    if image.shape[-1] == 4:
        return image
    return np.concatenate([image, np.full(image.shape[:2] + (1,), 255, dtype=image.dtype)], axis=-1)


LAYERED_FIELDS = ("layers", "resolution", "cfg_normalize", "caption_language")


def check_layered(request: ImageGenerationRequest, config: PipelineConfig) -> bool:
    """Whether the request decomposes an image into layers (the preset is Qwen-Image-Layered's); RequestError naming
    a Layered field sent to another preset, or a ``resolution`` that is not one of the preset's buckets. The schema
    has bounded ``layers``."""
    if not family_of(config).layers:
        for field in LAYERED_FIELDS:
            if getattr(request, field) is not None:
                raise RequestError(f"{field}: Qwen-Image-Layered's; {config.name!r} does not decompose images into "
                                   "layers", param=field)
        return False
    buckets = config.edit.resolutions
    if request.resolution is not None and request.resolution not in buckets:
        raise RequestError(f"resolution: one of {', '.join(map(str, buckets))} here, got {request.resolution}",
                           param="resolution")
    return True


def layered_resolution(body: object, config: PipelineConfig) -> int | None:
    """The resolution bucket a Layered request's image is resized for (its ``resolution``, else the preset's first),
    read before the image is decoded; None for other presets. A body that does not validate is left to planning."""
    if not family_of(config).layers or config.edit is None or config.edit.resolutions is None:
        return None
    value = body.resolution if isinstance(body, ImageGenerationRequest) else \
        body.get("resolution") if isinstance(body, dict) else None
    if isinstance(value, str) and value.strip().isdigit():  # a multipart form's text
        value = int(value)
    return value if value in config.edit.resolutions else config.edit.resolutions[0]


def asks_for_control(body: object) -> bool:
    """Whether a body, parsed or not, sets ``control`` to a non-empty value."""
    if isinstance(body, ImageGenerationRequest):
        return bool(body.control)
    return isinstance(body, dict) and body.get("control") not in (None, [], "", "null", "[]")


def check_control_route(config: PipelineConfig, has_image: bool) -> None:
    """RequestError naming ``control`` where ControlNets do not run: on Qwen-Image 2.1, on an edit preset, and with
    an image or mask to edit (diffusers' ControlNet pipeline draws from text alone)."""
    family = family_of(config)
    if not family.controlnets:
        raise RequestError(f"control: ControlNets are Qwen-Image's; {family.title} presets take none", param="control")
    if config.edit is not None:
        raise RequestError(f"control: {config.name!r} edits images; ControlNets run on a text-to-image preset's "
                           "/v1/images/generations", param="control")
    if has_image:
        raise RequestError("control: not with an image or a mask; ControlNets run on /v1/images/generations",
                           param="control")


def check_controls(request: ImageGenerationRequest, config: PipelineConfig) -> tuple[Control, ...]:
    """The request's ControlNets as the DiT takes them (``Control``, ``mask`` set for the preset's
    ``inpaint_controlnets``); RequestError naming ``control`` where none run (``check_control_route``), when the
    preset holds none or the request sends more than ``requests.max_controls``, ``control[k].name`` for a name the
    preset does not hold (the known listed), and ``control[k].mask`` for a mask given to a ControlNet that does not
    inpaint. The schema has checked each one's scale (0 to 10) and its start below its end (both 0 to 1)."""
    if not request.control:
        return ()
    check_control_route(config, has_image=False)
    if not config.controlnets:
        raise RequestError(f"control: {config.name!r} holds no ControlNets (the preset's controlnets)",
                           param="control")
    limit = config.requests.max_controls
    if len(request.control) > limit:
        raise RequestError(f"control: at most {limit} per request here (requests.max_controls), got "
                           f"{len(request.control)}", param="control")
    for k, control in enumerate(request.control):
        if control.name not in config.controlnets:
            known = ", ".join(sorted(config.controlnets))
            raise RequestError(f"control[{k}].name: no ControlNet {control.name!r} here; the ControlNets are {known}",
                               param=f"control[{k}].name")
        if control.mask is not None and control.name not in config.inpaint_controlnets:
            raise RequestError(f"control[{k}].mask: ControlNet {control.name!r} is not an inpainting ControlNet and "
                               "takes no mask", param=f"control[{k}].mask")
    return tuple(Control(control.name, control.scale, control.start, control.end,
                         mask=control.name in config.inpaint_controlnets) for control in request.control)


def check_control_images(controls: tuple[Control, ...], images: Sequence[np.ndarray], height: int, width: int
                         ) -> tuple[np.ndarray, ...]:
    """The control images, one per control and each the output's size: diffusers' pipeline would resize one of
    another size to it, which this server refuses (RequestError naming ``control[k].image``) rather than stretch
    it."""
    if len(images) != len(controls):
        raise RequestError(f"control_image: {len(images)} control image(s) for {len(controls)} control(s)",
                           param="control_image")
    for k, image in enumerate(images):
        if image.shape[:2] != (height, width):
            raise RequestError(
                f"control[{k}].image: {image.shape[1]}x{image.shape[0]}, but the output is {width}x{height}; send "
                "the control image at the output's size (or set `size` to the image's): it is not resized",
                param=f"control[{k}].image")
    return tuple(images)


def check_control_masks(controls: tuple[Control, ...], masks: Sequence[np.ndarray | None] | None, height: int,
                        width: int) -> tuple[np.ndarray | None, ...]:
    """One mask per control, an inpainting ControlNet's of the output's size and the others' None (RequestError
    naming ``control[k].mask`` otherwise: ``load_control_masks`` has refused what a client can send wrong)."""
    masks = tuple(masks) if masks is not None else (None,) * len(controls)
    if len(masks) != len(controls):
        raise RequestError(f"control_mask: {len(masks)} control mask(s) for {len(controls)} control(s)",
                           param="control_mask")
    for k, (control, mask) in enumerate(zip(controls, masks)):
        if control.mask != (mask is not None) or (mask is not None and mask.shape != (height, width)):
            what = "a mask of the output's size" if control.mask else "no mask"
            raise RequestError(f"control[{k}].mask: ControlNet {control.name!r} takes {what}",
                               param=f"control[{k}].mask")
    return masks


def max_image_bytes(config: PipelineConfig) -> int:
    """The largest image file a request may send (an edit's upload, a mask, a control image)."""
    return (config.edit or EditConfig()).max_image_bytes


def checkpoint_sigmas(request: ImageGenerationRequest, config: PipelineConfig, recipe: SamplingRecipe | None
                      ) -> tuple[float, ...] | None:
    """A Qwen-Image 2.1 request that sets no steps (nor quality, nor an adapter's recipe steps): the checkpoint's
    ``sample_sigmas``, as its pipeline samples when called without ``sigmas``; None otherwise."""
    if config.sample_sigmas is None:  # a family's that samples a checkpoint's own sigmas (Qwen-Image 2.1)
        return None
    if request.num_inference_steps is not None or request.quality != "auto":
        return None
    if recipe is not None and recipe.num_inference_steps:
        return None
    return config.sample_sigmas


def check_fields(request: ImageGenerationRequest, config: PipelineConfig) -> None:
    """The fields OpenAI's schema takes but this server cannot honour, and its own bounds."""
    family = family_of(config)
    if not request.prompt.strip() and not family.captions:
        raise RequestError("prompt: must not be empty", param="prompt")
    if request.background == "transparent" and not family.rgba:
        raise RequestError("background: Qwen-Image draws opaque images; use auto or opaque (Qwen-Image 2.1 and "
                           "Qwen-Image-Layered draw RGBA)", param="background")
    if not family.dit_cache and "cache" in request.model_fields_set and request.cache is not None:
        raise RequestError("cache: DiT cache acceleration is Qwen-Image's; Qwen-Image 2.1 keeps its condition's keys "
                           "and values across steps instead", param="cache")
    if request.style is not None:
        raise RequestError("style: a dall-e-3 setting that Qwen-Image does not have; describe the style in the "
                           "prompt", param="style")
    if request.seed is not None and request.seed + request.n - 1 > MAX_SEED:
        raise RequestError(f"seed: seed + n - 1 must be at most {MAX_SEED}", param="seed")
    if request.timeout is not None and request.timeout > config.requests.timeout_s:
        raise RequestError(f"timeout: at most {config.requests.timeout_s:g} s here (requests.timeout_s)",
                           param="timeout")
    for field in ("prompt", "negative_prompt"):
        text = getattr(request, field) or ""
        if (config.edit is not None or family.vision_in_every_prompt) and any(token in text for token in VISION_TOKENS):
            raise RequestError(f"{field}: must not contain Qwen2.5-VL's vision tokens ({', '.join(VISION_TOKENS)})",
                               param=field)


def resolve_steps(request: ImageGenerationRequest, config: PipelineConfig, recipe: SamplingRecipe | None,
                  inpaint: Inpaint | None) -> int:
    """The request's steps, its quality's, or its adapter's recipe's (when it sets neither); RequestError naming
    ``strength`` when a masked edit's strength runs none of them."""
    steps = request.num_inference_steps or quality_steps(request.quality, config)
    if recipe is not None and recipe.num_inference_steps and request.num_inference_steps is None \
            and request.quality == "auto":  # the client may send quality "auto" itself, as SDKs do
        steps = recipe.num_inference_steps
    if inpaint is not None and inpaint_start(steps, inpaint.strength) >= steps:
        raise RequestError(f"strength: {inpaint.strength:g} of {steps} steps runs none; raise it or the steps",
                           param="strength")
    return steps


def count_input_tokens(request: ImageGenerationRequest, config: PipelineConfig, count_tokens: CountTokens | None,
                       inputs: InputImages | None, true_cfg: bool, caption: bool = False) -> TokenCount:
    """The tokens the encoder reads: the prompt's, and the negative prompt's with true CFG (without it the negative
    is never encoded); RequestError naming the text past the encoder's ``max_model_len``. A prompt the encoder
    writes as a caption (``caption``) counts at its bound, the encoder's ``max_sequence_length`` past the template:
    the estimate of the DiT's work is never short."""
    total = TokenCount(0)
    if count_tokens is None:
        return total
    if caption:
        request = request.model_copy(update={"prompt": ""})
        total = TokenCount(config.encoder.max_sequence_length)
    image_sizes = tuple(image.shape[:2] for image in inputs.encoder) if inputs is not None else ()
    for field in ("prompt", "negative_prompt"):
        text = getattr(request, field)
        if text is None:
            continue
        tokens = count_tokens(text, image_sizes)
        family_of(config).check_image_tokens(tokens.image, image_sizes)
        if tokens.total > config.encoder.max_model_len:
            raise RequestError(f"{field}: {tokens.total} tokens with the prompt template; the limit is "
                               f"{config.encoder.max_model_len}", param=field)
        if field == "prompt" or true_cfg:
            total += tokens
    return total


def quality_steps(quality: str, config: PipelineConfig) -> int:
    """The steps of an OpenAI quality level: the preset's mapping, or its default steps for ``auto``."""
    if quality == "auto":
        return config.requests.default_steps
    return getattr(config.requests.quality_steps, quality)


def quality_level(steps: int, config: PipelineConfig) -> str:
    """The OpenAI quality level whose steps (the preset's ``requests.quality_steps``) are nearest ``steps``, the
    higher on a tie: what a response names as the quality used, which OpenAI's schema requires be low, medium or
    high."""
    levels = config.requests.quality_steps
    return min(("high", "medium", "low"), key=lambda level: abs(getattr(levels, level) - steps))


def resolve_loras(request: ImageGenerationRequest, config: PipelineConfig, adapters: Mapping[str, LoraEntry]
                  ) -> tuple[LoraRef, ...]:
    """The LoRA adapters the request stacks (``loras``), or the one ``model`` names (none for the base model);
    NotFoundError (404, ``model_not_found``) for a ``model`` that is neither, as OpenAI answers, and RequestError naming
    ``loras`` or ``loras[k].name`` for a stack this preset cannot run."""
    if request.loras is None:
        return resolve_model(request, config, adapters)
    if request.model not in (None, config.name):
        raise RequestError(f"loras: with a stack, `model` names the base model {config.name!r} (or is left out); put "
                           f"{request.model!r} in `loras`", param="loras")
    if "lora_scale" in request.model_fields_set:
        raise RequestError("lora_scale: with `loras`, each adapter has its own scale (loras[k].scale)",
                           param="lora_scale")
    most = min(config.lora.max_per_request, config.dit.max_loras)
    if len(request.loras) > most:
        why = "lora.max_per_request" if most == config.lora.max_per_request else "the DiT's max_loras slots"
        raise RequestError(f"loras: {len(request.loras)} adapters; this server stacks at most {most} ({why})",
                           param="loras")
    for k, spec in enumerate(request.loras):
        if spec.name not in adapters:
            known = ", ".join(sorted(adapters)) or "none"
            raise RequestError(f"loras[{k}].name: {spec.name!r} is not an adapter here; the adapters are {known}",
                               param=f"loras[{k}].name")
        if spec.name in (other.name for other in request.loras[:k]):
            raise RequestError(f"loras[{k}].name: {spec.name!r} is named twice; give it one scale",
                               param=f"loras[{k}].name")
    recipes = [spec.name for spec in request.loras if adapters[spec.name].recipe is not None]
    if len(recipes) > 1:
        raise RequestError(f"loras: {recipes[0]!r} and {recipes[1]!r} both have a sampling recipe; a stack may hold "
                           "one", param="loras")
    return tuple(LoraRef(spec.name, adapters[spec.name].path, spec.scale) for spec in request.loras)


def resolve_model(request: ImageGenerationRequest, config: PipelineConfig, adapters: Mapping[str, LoraEntry]
                  ) -> tuple[LoraRef, ...]:
    """The LoRA adapter ``model`` names, a stack of one (none for the base model); NotFoundError (404,
    ``model_not_found``) for a name that is neither, as OpenAI answers."""
    if request.model in (None, config.name):
        if "lora_scale" in request.model_fields_set:
            raise RequestError(f"lora_scale: {config.name!r} is the base model; set `model` to an adapter",
                               param="lora_scale")
        return ()
    if request.model not in adapters:
        known = ", ".join([config.name, *sorted(adapters)])
        raise NotFoundError(f"model: {request.model!r} does not exist here; the models are {known}", param="model")
    return (LoraRef(request.model, adapters[request.model].path, request.lora_scale),)


def check_mask(request: ImageGenerationRequest, inputs: InputImages | None, height: int, width: int
               ) -> Inpaint | None:
    """A masked edit's ``Inpaint`` (None without a mask); RequestError naming ``strength`` given without a mask, or
    ``size`` when the output's size is not the size its image and mask were prepared at (``load_masked_input``)."""
    if inputs is None or inputs.mask is None:
        if request.strength is not None:
            raise RequestError("strength: only with a `mask` (a masked edit)", param="strength")
        return None
    start = inputs.vae[0].shape[:2]
    if (height, width) != start:
        raise RequestError(f"size: {width}x{height}, but the masked edit's image was prepared at "
                           f"{start[1]}x{start[0]}", param="size")
    return Inpaint(inputs.mask, INPAINT_STRENGTH if request.strength is None else request.strength)


def check_route(config: PipelineConfig, has_image: bool, has_mask: bool = False) -> None:
    """Raises RequestError (param ``image``, or ``mask``) when a request's modality is not the preset's, as its family
    says (``Family.check_route``)."""
    family_of(config).check_route(config, has_image, has_mask)


def requested_size(request: ImageGenerationRequest, config: PipelineConfig) -> tuple[int, int] | None:
    """(height, width) the request names, checked against the preset's limits; None for ``auto`` or none."""
    if request.size in (None, "auto"):
        return None
    try:
        width, height = (int(side) for side in request.size.lower().split("x"))
    except ValueError:
        raise RequestError(f"size: expected 'WIDTHxHEIGHT', got {request.size!r}", param="size") from None
    check_sides(width, height, config, "size")
    return height, width


def resolve_size(
    request: ImageGenerationRequest, config: PipelineConfig, default: tuple[int, int] | None = None
) -> tuple[int, int]:
    """(height, width) for the request: the size it names, else ``default`` (an edit's last image's working size),
    else the preset's default size."""
    limits = config.requests
    return requested_size(request, config) or default or (limits.default_height, limits.default_width)
