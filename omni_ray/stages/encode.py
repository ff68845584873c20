"""Encode stage: Qwen-Image's prompt template, tokens (and for edits the input image) in, per-token embeddings out.

The stage is split where the engine needs it: ``tokenize`` (template and tokenizer, on the host), a forward pass
from token ids (and image) to last hidden states (``TransformersTextEncoder`` here; vLLM's engine core in the
encoder engine), and ``to_prompt_embeds`` (drop the template's system tokens), as diffusers' ``QwenImagePipeline``
and ``QwenImageEditPipeline`` do in ``encode_prompt``.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from omni_ray.config import PipelineConfig

USER_TURN = "<|im_start|>user\n"
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
TOKENIZER_MAX_LENGTH = 1024  # diffusers' tokenizer_max_length for text to image; the template's tokens come on top


@dataclass(frozen=True, slots=True)
class PromptTemplate:
    """One diffusers pipeline's prompt template: the chat around the prompt, and the leading tokens it drops."""

    text: str  # "{}" marks the prompt
    drop: int  # diffusers' prompt_template_encode_start_idx: the system turn and the user turn's opening
    truncates: bool  # text to image cuts tokens at 1024 + drop and embeddings at max_sequence_length; edit neither

    @property
    def dropped_text(self) -> str:
        """The text of the dropped tokens."""
        return self.text[: self.text.index(USER_TURN) + len(USER_TURN)]

    @property
    def has_image(self) -> bool:
        return IMAGE_PLACEHOLDER in self.text


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


def template_for(config: PipelineConfig) -> PromptTemplate:
    """The preset's prompt template: the edit one for Qwen-Image-Edit checkpoints."""
    return EDIT if config.edit is not None else TEXT_TO_IMAGE


@dataclass(slots=True)
class PromptEmbeds:
    """One prompt's embeddings, as they travel to the DiT stage (CPU, contiguous)."""

    embeds: torch.Tensor  # [num_tokens, hidden]

    @property
    def num_tokens(self) -> int:
        return self.embeds.shape[0]


@dataclass(slots=True)
class EncodeRequest:
    """A request as the encoder engine receives it."""

    request_id: str
    prompt: str
    negative_prompt: str | None = None  # encoded only when given (true CFG)
    image: np.ndarray | None = None  # edits: the input image, uint8 [H, W, 3], already at its working size


@dataclass(slots=True)
class EncodedPrompt:
    """The encoder's result for one request; travels to the DiT stage."""

    prompt: PromptEmbeds
    negative: PromptEmbeds | None
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds this request spent there


class PromptTokenizer:
    """Wraps a prompt in the pipeline's template and tokenises it.

    The edit template's image placeholder stays one ``<|image_pad|>`` token here; the vision path expands it to the
    image's token count (``image_tokens``), as Qwen2.5-VL's processor does.
    """

    def __init__(self, model: str, template: PromptTemplate = TEXT_TO_IMAGE):
        self.template = template
        self.tokenizer = AutoTokenizer.from_pretrained(model, subfolder="tokenizer")
        self.pad_token_id = self.tokenizer.pad_token_id
        self.image_token_id = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.image_processor = (
            AutoImageProcessor.from_pretrained(model, subfolder="processor") if template.has_image else None
        )

    def image_tokens(self, height: int, width: int) -> int:
        """Tokens an image of this size becomes: the processor's patches, merged ``merge_size`` x ``merge_size``."""
        patches = self.image_processor.get_number_of_image_patches(height, width)
        return patches // self.image_processor.merge_size**2

    def num_tokens(self, prompt: str, image_size: tuple[int, int] | None = None) -> int:
        """Tokens of the templated prompt, untruncated; ``image_size`` (height, width) counts the image's too."""
        count = len(self.tokenizer(self.template.text.format(prompt)).input_ids)
        if self.template.has_image:
            count += self.image_tokens(*image_size) - 1
        return count

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of the templated prompt, truncated as diffusers truncates."""
        text = self.template.text.format(prompt)
        if not self.template.truncates:
            return self.tokenizer(text).input_ids
        return self.tokenizer(text, max_length=TOKENIZER_MAX_LENGTH + self.template.drop, truncation=True).input_ids

    def vision_inputs(self, image: np.ndarray) -> dict[str, torch.Tensor]:
        """The image as Qwen2.5-VL's vision tower takes it: ``pixel_values`` and ``image_grid_thw``."""
        from PIL import Image

        return dict(self.image_processor(images=[Image.fromarray(image)], return_tensors="pt"))

    def expand_image(self, token_ids: list[int], num_image_tokens: int) -> list[int]:
        """Repeats the one ``<|image_pad|>`` token ``num_image_tokens`` times."""
        at = token_ids.index(self.image_token_id)
        return token_ids[:at] + [self.image_token_id] * num_image_tokens + token_ids[at + 1 :]


def to_prompt_embeds(hidden: torch.Tensor, template: PromptTemplate, max_sequence_length: int) -> PromptEmbeds:
    """Drops the template's system tokens from one sequence's last hidden state ``[num_tokens, hidden]``."""
    hidden = hidden[template.drop :]
    if template.truncates:
        hidden = hidden[:max_sequence_length]
    return PromptEmbeds(hidden.detach().cpu().contiguous())


class TransformersTextEncoder:
    """Token ids (and for edits an image) to last hidden states with transformers' Qwen2.5-VL: the reference.

    Text sequences run as one right-padded batch with an attention mask, exactly as diffusers runs them; a sequence
    with an image runs alone, as diffusers' edit pipeline runs each prompt with its image.
    """

    def __init__(self, model: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        self.device = torch.device(device)
        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model, subfolder="text_encoder", dtype=dtype)
        self.model.to(self.device).eval()

    @torch.no_grad()
    def __call__(
        self, token_ids: list[list[int]], pad_token_id: int, vision: dict[str, torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """Returns each sequence's last hidden state, ``[num_tokens_i, hidden]``.

        With ``vision`` (one image's ``pixel_values`` and ``image_grid_thw``), the one sequence holds that image's
        tokens already expanded.
        """
        assert vision is None or len(token_ids) == 1, "one sequence per image"
        max_len = max(len(ids) for ids in token_ids)
        input_ids = torch.full((len(token_ids), max_len), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(token_ids), max_len), dtype=torch.long)
        for row, ids in enumerate(token_ids):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
        vision = {name: value.to(self.device) for name, value in (vision or {}).items()}
        if vision:
            vision["pixel_values"] = vision["pixel_values"].to(self.model.dtype)
            # Which tokens are the image's: transformers 5 places M-RoPE's 2D positions by these (without them it
            # falls back to 1D positions, which is what diffusers 0.42's edit pipeline gets).
            vision["mm_token_type_ids"] = (input_ids == self.model.config.image_token_id).long().to(self.device)
        out = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            output_hidden_states=True,
            **vision,
        )
        hidden = out.hidden_states[-1]
        return [hidden[row, : len(ids)] for row, ids in enumerate(token_ids)]


class PromptEncoder:
    """Prompts to ``PromptEmbeds`` with the transformers forward pass; the encoder engine swaps in vLLM's."""

    def __init__(
        self,
        model: str,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        max_sequence_length: int = 512,
        template: PromptTemplate = TEXT_TO_IMAGE,
    ):
        self.tokenizer = PromptTokenizer(model, template)
        self.text_encoder = TransformersTextEncoder(model, dtype, device)
        self.max_sequence_length = max_sequence_length

    def encode(self, prompts: list[str], image: np.ndarray | None = None) -> list[PromptEmbeds]:
        """Every prompt's embeddings; for edits each prompt is encoded with ``image``."""
        token_ids = [self.tokenizer.tokenize(prompt) for prompt in prompts]
        if image is None:
            hidden = self.text_encoder(token_ids, self.tokenizer.pad_token_id)
        else:
            vision = self.tokenizer.vision_inputs(image)
            count = self.tokenizer.image_tokens(*image.shape[:2])
            hidden = [
                self.text_encoder([self.tokenizer.expand_image(ids, count)], self.tokenizer.pad_token_id, vision)[0]
                for ids in token_ids
            ]
        return [to_prompt_embeds(h, self.tokenizer.template, self.max_sequence_length) for h in hidden]


def local_subfolder(model: str, subfolder: str) -> str:
    """A checkpoint component's local directory; a hub id is downloaded once into the Hugging Face cache."""
    path = pathlib.Path(model).expanduser()
    if path.is_dir():
        return str(path / subfolder)
    from huggingface_hub import snapshot_download

    return str(pathlib.Path(snapshot_download(model, allow_patterns=[f"{subfolder}/*"])) / subfolder)


def vision_model_dir(model: str) -> str:
    """One directory holding ``text_encoder/`` and ``processor/`` side by side, as vLLM loads a multimodal model.

    diffusers keeps Qwen2.5-VL's weights and its processor in two folders; vLLM reads both from its model path. The
    directory, in the user's cache and named after the checkpoint's path, holds links to both folders' files; each
    link is checked and replaced atomically when it points elsewhere, so replicas starting together agree.
    """
    sources = [pathlib.Path(local_subfolder(model, sub)).resolve() for sub in ("text_encoder", "processor")]
    digest = hashlib.sha256("\0".join(map(str, sources)).encode()).hexdigest()[:16]
    merged = pathlib.Path("~/.cache/omni-ray/vision").expanduser() / digest
    merged.mkdir(parents=True, exist_ok=True)
    wanted = {file.name: file for source in sources for file in source.iterdir()}
    for entry in merged.iterdir():
        if entry.name not in wanted and not entry.name.startswith("."):  # left from an older layout
            entry.unlink(missing_ok=True)
    for name, target in wanted.items():
        link = merged / name
        if link.is_symlink() and os.readlink(link) == str(target):
            continue
        staged = merged / f".{name}.{os.getpid()}"
        staged.unlink(missing_ok=True)
        staged.symlink_to(target)
        os.replace(staged, link)
    return str(merged)


class VllmEncoder:
    """Token ids (and for edits an image) to last hidden states with vLLM's V1 ``EngineCore``, in this process.

    The only code that touches vLLM's internal engine API, written against vllm 0.32 (pinned): the pooling runner
    with the ``token_embed`` task over all tokens and no activation gives each token's last hidden state, and vLLM's
    own scheduler batches concurrent sequences. With ``max_image_pixels`` the model runs with its vision tower:
    vLLM's input processor runs Qwen2.5-VL's image processor, expands the image placeholder and places the vision
    embeddings (with their M-RoPE positions) in the sequence; without it, only the language model loads. Call it
    from one thread.
    """

    def __init__(
        self,
        model: str,
        dtype: str = "float32",
        max_num_seqs: int = 8,
        max_model_len: int = 1058,
        kv_cache_memory_bytes: int = 256 << 20,
        max_image_pixels: int | None = None,
        dummy: bool = False,
        gpu_memory_utilization: float = 0.9,
    ):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # Left on, vLLM replaces the process's logging set-up on import, and a Serve replica loses its log file.
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        from vllm.config import PoolerConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.pooling_params import PoolingParams
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.engine.input_processor import InputProcessor
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        vision = max_image_pixels is not None
        if vision:
            # Images reach the encoder already resized to about the preset's area, so the processor's own bound
            # never binds; it sizes vLLM's encoder budget (its default, 16k tokens per image, would be profiled).
            modality = {
                "model": vision_model_dir(model),
                "limit_mm_per_prompt": {"image": 1, "video": 0},
                "mm_processor_kwargs": {"max_pixels": max_image_pixels},
                "mm_processor_cache_gb": 0,
            }
        else:
            modality = {"model": local_subfolder(model, "text_encoder"), "language_model_only": True}
        self.config = EngineArgs(
            tokenizer=local_subfolder(model, "tokenizer"),
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            enforce_eager=True,
            distributed_executor_backend="uni",
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            runner="pooling",
            convert="embed",
            pooler_config=PoolerConfig(task="token_embed", tok_pooling_type="ALL", use_activation=False),
            load_format="dummy" if dummy else "auto",  # dummy: vLLM's random weights, from the config alone
            **modality,
        ).create_engine_config()
        self.core = EngineCore(self.config, _loopback_executor(UniProcExecutor), log_stats=False)
        self.pooling_params = PoolingParams(task="token_embed", use_activation=False)
        self.pooling_params.verify(self.config.model_config)
        self.input_processor = InputProcessor(self.config) if vision else None

    def add(self, request_id: str, token_ids: list[int], image: np.ndarray | None = None) -> None:
        """Queues one sequence; with ``image``, its one ``<|image_pad|>`` token stands for the image."""
        from vllm.v1.engine import EngineCoreRequest

        if image is not None:
            from PIL import Image

            prompt = {"prompt_token_ids": token_ids, "multi_modal_data": {"image": Image.fromarray(image)}}
            request = self.input_processor.process_inputs(
                request_id, prompt, self.pooling_params, supported_tasks=("token_embed",)
            )
        else:
            request = EngineCoreRequest(
                request_id=request_id,
                prompt_token_ids=token_ids,
                mm_features=None,
                sampling_params=None,
                pooling_params=self.pooling_params,
                arrival_time=time.time(),
                lora_request=None,
                cache_salt=None,
                data_parallel_rank=None,
            )
        self.core.add_request(*self.core.preprocess_add_request(request))

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def step(self) -> dict[str, torch.Tensor]:
        """Runs one vLLM step; returns the sequences that finished: id -> ``[num_tokens, hidden]``."""
        outputs, _ = self.core.step()
        return {
            output.request_id: output.pooling_output
            for batch in outputs.values()
            for output in batch.outputs
            if output.finished
        }

    def shutdown(self) -> None:
        self.core.shutdown()


def _loopback_executor(uniproc_executor: type) -> type:
    """vLLM's in-process executor, rendezvousing over a loopback TCP port instead of a file.

    On a CPU, vLLM 0.32 sets up its one-process torch.distributed group through a ``/tmp/vllm_dist_*`` file, which
    only a clean engine shutdown removes: a replica that is killed (SIGKILL, a node stopped, ``serve run`` stopped
    with SIGTERM) leaves it behind. A TCP store leaves nothing.
    """
    from vllm.utils.network_utils import get_distributed_init_method, get_loopback_ip, get_open_port

    class LoopbackUniProcExecutor(uniproc_executor):
        def _distributed_args(self) -> tuple[str, int, int]:
            _, rank, local_rank = super()._distributed_args()
            return get_distributed_init_method(get_loopback_ip(), get_open_port()), rank, local_rank

    return LoopbackUniProcExecutor
