"""Qwen-Image-Layered's facts, each stated once: what diffusers' ``QwenImageLayeredPipeline`` fixes, not settings.

Qwen-Image-Layered decomposes an RGBA image into ``layers`` RGBA layers. Its transformer is Qwen-Image's with a
layer axis in its rotary embedding (``use_layer3d_rope``: the output's ``layers + 1`` frames at layer indices 0 to
``layers``, the composite first, the input image at -1) and a learned "RGB or RGBA" timestep term
(``use_additional_t_cond``, 0 for every request of the pipeline); its VAE reads and writes RGBA. The input image and
the output share one working size: the resolution bucket's area at the image's aspect ratio, sides multiples of 32.
The prompt is encoded as Qwen-Image's text-to-image prompt (text only); an empty prompt is first replaced by a caption
Qwen2.5-VL writes of the image (``generate``, up to ``CAPTION_MAX_TOKENS`` new tokens), from one of two templates.
Nothing here imports anything but the standard library.
"""

from __future__ import annotations

import math

FAMILY = "qwen-image-layered"
PIPELINE = "QwenImageLayeredPipeline"
RESOLUTIONS = (640, 1024)  # the pipeline's resolution buckets: the working size's area is the bucket's square
DEFAULT_RESOLUTION = 640  # the pipeline's default (and the model card's recommendation)
DEFAULT_LAYERS = 4  # the pipeline's default
MIN_LAYERS, MAX_LAYERS = 2, 8  # what a request may ask for (ours: the model was trained on 3 to 8, 2 works)
DEFAULT_STEPS = 50  # the pipeline's num_inference_steps
IMAGE_CHANNELS = 4  # the VAE reads and writes RGBA
MAX_SEQUENCE_LENGTH = 512  # the pipeline's max_sequence_length: prompt embeddings are cut to this many tokens
CAPTION_MAX_TOKENS = 512  # get_image_caption's max_new_tokens
CAPTION_LANGUAGES = ("en", "zh")  # use_en_prompt True / False (the pipeline's default is False: Chinese)
PROMPT_TEMPLATE_DROP = 34  # the text-to-image template's tokens dropped from the embeddings (Qwen-Image's)

CAPTION_TEMPLATES = {
    "en": (
        '<|im_start|>system\n'
        'You are a helpful assistant.<|im_end|>\n'
        '<|im_start|>user\n'
        '# Image Annotator\n'
        'You are a professional\n'
        'image annotator. Please write an image caption based on the input image:\n'
        '1. Write the caption using natural,\n'
        'descriptive language without structured formats or rich text.\n'
        '2. Enrich caption details by including: \n'
        ' - Object\n'
        'attributes, such as quantity, color, shape, size, material, state, position, actions, and so on\n'
        ' - Vision Relations\n'
        'between objects, such as spatial relations, functional relations, possessive rel'
        'ations, attachment relations, action\n'
        'relations, comparative relations, causal relations, and so on\n'
        ' - Environmental details, such as weather, lighting,\n'
        'colors, textures, atmosphere, and so on\n'
        ' - Identify the text clearly visible in the image, without translation or\n'
        'explanation, and highlight it in the caption with quotation marks\n'
        '3. Maintain authenticity and accuracy:\n'
        ' - Avoid\n'
        'generalizations\n'
        ' - Describe all visible information in the image, while do not add information n'
        'ot explicitly shown in\n'
        'the image\n'
        '<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n'
        '<|im_start|>assistant\n'
    ),
    "zh": (
        '<|im_start|>system\n'
        'You are a helpful assistant.<|im_end|>\n'
        '<|im_start|>user\n'
        '# 图像标注器\n'
        '你是一个专业的图像标注器。请基于输入图像，撰写图注:\n'
        '1.\n'
        '使用自然、描述性的语言撰写图注，不要使用结构化形式或富文本形式。\n'
        '2. 通过加入以下内容，丰富图注细节：\n'
        ' - 对象的属性：如数量、颜色、形状、大小、位置、材质、状态、动作等\n'
        ' -\n'
        '对象间的视觉关系：如空间关系、功能关系、动作关系、从属关系、比较关系、因果关系等\n'
        ' - 环境细节：例如天气、光照、颜色、纹理、气氛等\n'
        ' - 文字内容：识别图像中清晰可见的文字，不做翻译和解释，用引号在图注中强调\n'
        '3.\n'
        '保持真实性与准确性：\n'
        ' - 不要使用笼统的描述\n'
        ' -\n'
        '描述图像中所有可见的信息，但不要加入没有在图像中出现的内容\n'
        '<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n'
        '<|im_start|>assistant\n'
    ),
}


def working_size(height: int, width: int, resolution: int = DEFAULT_RESOLUTION) -> tuple[int, int]:
    """(height, width) of the input image as the pipeline resizes it, and of every output layer: the bucket's area
    ``resolution ** 2`` at the image's aspect ratio, sides rounded to multiples of 32 (``calculate_dimensions``)."""
    ratio = width / height
    side_w = math.sqrt(resolution * resolution * ratio)
    side_h = side_w / ratio
    return round(side_h / 32) * 32, round(side_w / 32) * 32


def needs_caption(prompt: str | None) -> bool:
    """The pipeline captions the image when the prompt is None, empty or one space."""
    return prompt is None or prompt in ("", " ")


def dit_frames(layers: int) -> int:
    """Frames the DiT denoises for ``layers`` layers: the composite first, then each layer."""
    return layers + 1


def decoded_frames(layers: int) -> int:
    """Images the VAE decodes of latents of ``layers`` layers: each layer (the composite, the first frame, is
    dropped), or the one image of latents that are not layered (``layers`` 0)."""
    return layers or 1


def schedule_mu(image_tokens: int) -> float:
    """The pipeline's dynamic-shift ``mu``: the square root of the input image's packed tokens over 256 (a 256x256
    image's), not Qwen-Image's linear rule."""
    return (image_tokens / 256) ** 0.5
