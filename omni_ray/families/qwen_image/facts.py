"""Qwen-Image's facts, each stated once: what the architecture and diffusers' pipelines fix, not settings.

Every layer imports these from here; nothing here imports anything. A checkpoint that disagrees (a VAE with another
compression, say) is refused where it is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

# Image sides are multiples of this: the VAE's 8x spatial compression times the transformer's 2x2 patches. One image
# token covers SIZE_MULTIPLE x SIZE_MULTIPLE pixels.
SIZE_MULTIPLE = 16
VAE_COMPRESSION = 8
LATENT_CHANNELS = 64  # packed latent channels: the VAE's 16 channels x 2x2 patches
TEXT_HIDDEN = 3584  # Qwen2.5-VL-7B's hidden size: the prompt embeddings' width
VISION_PATCH = 28  # Qwen2.5-VL's vision tokens: 14-pixel patches merged 2x2
EDIT_SIDE_MULTIPLE = 2 * SIZE_MULTIPLE  # an edit's input image sides, as diffusers' calculate_dimensions rounds them
CONDITION_AREA = 384 * 384  # Edit-Plus: the pixels each input image has when Qwen2.5-VL reads it (diffusers'
# CONDITION_IMAGE_SIZE); the VAE takes it at the edit's working area
TOKENIZER_MAX_LENGTH = 1024  # diffusers' tokenizer_max_length for text to image; the template's tokens come on top


def image_tokens(height: int, width: int) -> int:
    """The transformer's tokens for an image of ``height`` x ``width`` pixels."""
    return (height // SIZE_MULTIPLE) * (width // SIZE_MULTIPLE)


def dit_work_tokens(height: int, width: int, text_tokens: int, true_cfg: bool,
                    image_sizes: tuple[tuple[int, int], ...] = (), layers: int = 0) -> int:
    """Tokens one denoising step of an image pushes through the transformer: its image tokens (Qwen-Image-Layered's
    ``layers + 1`` frames of them), an edit's input images' tokens and its text tokens in every pass, two passes with
    true CFG. The DiT's unit of work (``max_batch_tokens``)."""
    frames = layers + 1 if layers else 1  # qwen_image_layered.dit_frames
    tokens = frames * image_tokens(height, width) + text_tokens + sum(image_tokens(*size) for size in image_sizes)
    return tokens * (2 if true_cfg else 1)


def latent_grid(height: int, width: int) -> tuple[int, int]:
    """(rows, cols) of the VAE's latents for an image of ``height`` x ``width`` pixels, before 2x2 packing."""
    return 2 * (height // SIZE_MULTIPLE), 2 * (width // SIZE_MULTIPLE)


def check_side(name: str, side: int) -> None:
    """Raises ValueError naming ``name`` unless ``side`` (pixels) is a multiple of ``SIZE_MULTIPLE``."""
    if side % SIZE_MULTIPLE:
        raise ValueError(f"{name} {side} is not a multiple of {SIZE_MULTIPLE}")


def uses_true_cfg(true_cfg_scale: float, has_negative: bool) -> bool:
    """diffusers' rule: true CFG runs when the scale is above 1 and a negative prompt is given. Decided once, when a
    request is planned; every later layer reads the decision."""
    return true_cfg_scale > 1 and has_negative


INPAINT_STRENGTH = 0.6  # diffusers' inpaint pipelines' default strength


def inpaint_start(num_steps: int, strength: float) -> int:
    """The step a masked edit starts at, as diffusers' inpaint pipelines truncate the schedule (``get_timesteps``):
    ``strength`` 1 runs every step from pure noise, less starts later from the image noised to that step's level."""
    return int(max(num_steps - min(num_steps * strength, num_steps), 0))


USER_TURN = "<|im_start|>user\n"
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")  # the processor places
# images by them: in a prompt they would stand for images that are not there


@dataclass(frozen=True, slots=True)
class PromptTemplate:
    """One diffusers pipeline's prompt template: the chat around the prompt, and the leading tokens it drops."""

    text: str  # "{}" marks the prompt
    drop: int  # diffusers' prompt_template_encode_start_idx: the system turn and the user turn's opening
    truncates: bool  # text to image cuts tokens at 1024 + drop and embeddings at max_sequence_length; edit neither
    picture: str = ""  # Edit-Plus: what stands for each input image before the prompt ("{}" marks its number)

    def format(self, prompt: str, num_images: int = 0) -> str:
        """The templated text of ``prompt`` (Edit-Plus: with ``num_images`` pictures before it); one
        ``<|image_pad|>`` token stands for each image."""
        return self.text.format("".join(self.picture.format(i + 1) for i in range(num_images)) + prompt)

    @property
    def dropped_text(self) -> str:
        """The text of the dropped tokens."""
        return self.text[: self.text.index(USER_TURN) + len(USER_TURN)]

    @property
    def has_image(self) -> bool:
        return IMAGE_PLACEHOLDER in self.text or bool(self.picture)

    @property
    def key(self) -> str:
        """What tells templates apart (the prompt cache's key): its text, and Edit-Plus's picture label."""
        return self.text + self.picture


# diffusers' QwenImagePipeline.prompt_template_encode and prompt_template_encode_start_idx.
TEXT_TO_IMAGE = PromptTemplate(
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n",
    drop=34,
    truncates=True,
)
# diffusers' QwenImageEditPipeline's: the input image's placeholder opens the user turn, after the dropped tokens.
EDIT = PromptTemplate(
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n" + IMAGE_PLACEHOLDER + "{}<|im_end|>\n<|im_start|>assistant\n",
    drop=64,
    truncates=False,
)
# diffusers' QwenImageEditPlusPipeline's (Qwen-Image-Edit-2509 and 2511): Edit's system turn, and each input image
# as "Picture i: " and its placeholder before the prompt, in the user turn.
EDIT_PLUS = PromptTemplate(
    EDIT.text.replace(IMAGE_PLACEHOLDER, ""), drop=64, truncates=False, picture="Picture {}: " + IMAGE_PLACEHOLDER
)
TEMPLATES = (TEXT_TO_IMAGE, EDIT, EDIT_PLUS)


def template_for(edit: bool, plus: bool = False) -> PromptTemplate:
    """The prompt template of a Qwen-Image (``edit`` False), Qwen-Image-Edit or (``plus``) Qwen-Image-Edit-2509/2511
    checkpoint."""
    return (EDIT_PLUS if plus else EDIT) if edit else TEXT_TO_IMAGE


# TeaCache's rescaling polynomial for Qwen-Image (highest power first), as vLLM-Omni ships it
# (vllm_omni/diffusion/cache/teacache, "from ComfyUI-TeaCache"): it maps the relative change of the first block's
# modulated input to the expected relative change of the transformer's output.
QWEN_IMAGE_TEACACHE = (-4.5e2, 2.8e2, -4.5e1, 3.2, -2e-2)

# Parameters of the published checkpoints: Qwen/Qwen-Image's transformer and VAE, and Qwen2.5-VL-7B-Instruct (its
# text encoder, vision tower included).
PUBLISHED_PARAMS = {"transformer": 20_430_401_088, "vae": 126_892_531, "text_encoder": 8_292_166_656}
VISION_PARAMS = 676_550_144  # Qwen2.5-VL-7B's vision tower, inside PUBLISHED_PARAMS["text_encoder"]
# Of the text encoder's: the weights of its language model's decoder-layer Linears, which AWQ and GPTQ quantize (the
# embeddings, lm_head, norms and vision tower stay whole). tests/test_awq_encoder.py counts them.
QUANTIZABLE_PARAMS = 6_525_288_448
# The weights of every Linear in the transformer's blocks (all but 46 M of its parameters): what dit.quantization: int8
# stores at a byte each. tests/test_int8.py counts them from the published config.
BLOCK_LINEAR_PARAMS = 20_384_317_440
NUM_BLOCKS = 60  # the transformer's
# The published GGUF files of the transformer, bytes by quant type (QuantStack's Qwen-Image, Qwen-Image-2512 and Edit
# files; the same for each release): what the placement check counts for a dit.weights_file named so.
GGUF_BYTES = {"Q8_0": 21.8e9, "Q6_K": 16.8e9, "Q5_K_M": 14.9e9, "Q4_K_M": 13.1e9, "Q4_K_S": 12.1e9, "Q3_K_M": 9.7e9}
# Of the transformer's: the weights of the Linears diffusers' _tp_plan shards (attention and MLPs; the modulation
# Linears, 6.8 B, stay whole on every tensor rank), and those dit.quantization fp8 stores in float8 (all of them
# sharded Linears: the blocks' less the image MLP's output and the modulation). tests/test_full_size.py counts both.
TENSOR_SHARDED_PARAMS = 13_592_862_720
FP8_PARAMS = 11_324_620_800
