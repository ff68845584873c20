"""Encode stage: Qwen-Image's prompt template, tokens in, per-token prompt embeddings out.

The stage is split where the engine needs it: ``tokenize`` (template and tokenizer, on the host), a forward pass
from token ids to last hidden states (``TransformersTextEncoder`` here; vLLM's engine core in the encoder engine),
and ``to_prompt_embeds`` (drop the template's 34 tokens, keep at most ``max_sequence_length``), as diffusers'
``QwenImagePipeline.encode_prompt`` does.
"""

from __future__ import annotations

import os
import pathlib
import time
from dataclasses import dataclass, field

import torch
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

# diffusers' QwenImagePipeline.prompt_template_encode and prompt_template_encode_start_idx.
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
PROMPT_TEMPLATE_DROP = 34
TOKENIZER_MAX_LENGTH = 1024  # diffusers' tokenizer_max_length; the template's 34 tokens come on top


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


@dataclass(slots=True)
class EncodedPrompt:
    """The encoder's result for one request; travels to the DiT stage."""

    prompt: PromptEmbeds
    negative: PromptEmbeds | None
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds this request spent there


class PromptTokenizer:
    """Wraps a prompt in Qwen-Image's template and tokenises it."""

    def __init__(self, model: str):
        self.tokenizer = AutoTokenizer.from_pretrained(model, subfolder="tokenizer")
        self.pad_token_id = self.tokenizer.pad_token_id

    def num_tokens(self, prompt: str) -> int:
        """Tokens of the templated prompt, untruncated."""
        return len(self.tokenizer(PROMPT_TEMPLATE.format(prompt)).input_ids)

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of the templated prompt, truncated as diffusers truncates."""
        return self.tokenizer(
            PROMPT_TEMPLATE.format(prompt), max_length=TOKENIZER_MAX_LENGTH + PROMPT_TEMPLATE_DROP, truncation=True
        ).input_ids


def to_prompt_embeds(hidden: torch.Tensor, max_sequence_length: int) -> PromptEmbeds:
    """Drops the template's tokens from one sequence's last hidden state ``[num_tokens, hidden]``."""
    return PromptEmbeds(hidden[PROMPT_TEMPLATE_DROP:][:max_sequence_length].detach().cpu().contiguous())


class TransformersTextEncoder:
    """Token ids to last hidden states with transformers' Qwen2.5-VL (the reference forward pass).

    Sequences run as one right-padded batch with an attention mask, exactly as diffusers runs them.
    """

    def __init__(self, model: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        self.device = torch.device(device)
        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model, subfolder="text_encoder", dtype=dtype)
        self.model.to(self.device).eval()

    @torch.no_grad()
    def __call__(self, token_ids: list[list[int]], pad_token_id: int) -> list[torch.Tensor]:
        """Returns each sequence's last hidden state, ``[num_tokens_i, hidden]``."""
        max_len = max(len(ids) for ids in token_ids)
        input_ids = torch.full((len(token_ids), max_len), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(token_ids), max_len), dtype=torch.long)
        for row, ids in enumerate(token_ids):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
        out = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            output_hidden_states=True,
        )
        hidden = out.hidden_states[-1]
        return [hidden[row, : len(ids)] for row, ids in enumerate(token_ids)]


class PromptEncoder:
    """Prompts to ``PromptEmbeds`` with the transformers forward pass; the encoder engine swaps in vLLM's."""

    def __init__(
        self, model: str, dtype: torch.dtype = torch.float32, device: str = "cpu", max_sequence_length: int = 512
    ):
        self.tokenizer = PromptTokenizer(model)
        self.text_encoder = TransformersTextEncoder(model, dtype, device)
        self.max_sequence_length = max_sequence_length

    def encode(self, prompts: list[str]) -> list[PromptEmbeds]:
        token_ids = [self.tokenizer.tokenize(prompt) for prompt in prompts]
        hidden = self.text_encoder(token_ids, self.tokenizer.pad_token_id)
        return [to_prompt_embeds(h, self.max_sequence_length) for h in hidden]


def local_subfolder(model: str, subfolder: str) -> str:
    """A checkpoint component's local directory; a hub id is downloaded once into the Hugging Face cache."""
    path = pathlib.Path(model).expanduser()
    if path.is_dir():
        return str(path / subfolder)
    from huggingface_hub import snapshot_download

    return str(pathlib.Path(snapshot_download(model, allow_patterns=[f"{subfolder}/*"])) / subfolder)


class VllmTextEncoder:
    """Token ids to last hidden states with vLLM's V1 ``EngineCore``, in this process.

    The only code that touches vLLM's internal engine API, written against vllm 0.32 (pinned): the pooling runner
    with the ``token_embed`` task over all tokens and no activation gives each token's last hidden state, and vLLM's
    own scheduler batches concurrent sequences. Call it from one thread.
    """

    def __init__(
        self,
        model: str,
        dtype: str = "float32",
        max_num_seqs: int = 8,
        max_model_len: int = 1058,
        kv_cache_memory_bytes: int = 256 << 20,
    ):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # Left on, vLLM replaces the process's logging set-up on import, and a Serve replica loses its log file.
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        from vllm.config import PoolerConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.pooling_params import PoolingParams
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        self.config = EngineArgs(
            model=local_subfolder(model, "text_encoder"),
            tokenizer=local_subfolder(model, "tokenizer"),
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            enforce_eager=True,
            distributed_executor_backend="uni",
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            language_model_only=True,
            runner="pooling",
            convert="embed",
            pooler_config=PoolerConfig(task="token_embed", tok_pooling_type="ALL", use_activation=False),
        ).create_engine_config()
        self.core = EngineCore(self.config, UniProcExecutor, log_stats=False)
        self.pooling_params = PoolingParams(task="token_embed", use_activation=False)
        self.pooling_params.verify(self.config.model_config)

    def add(self, request_id: str, token_ids: list[int]) -> None:
        from vllm.v1.engine import EngineCoreRequest

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
