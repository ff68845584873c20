"""The encoder stage's forward pass: Qwen2.5-VL (Qwen-Image) or Qwen3-VL (Qwen-Image 2.1) under vLLM's V1
``EngineCore``, in this process.

Token ids (and for edits their images) in, each token's last hidden state out; ``tokenizer`` builds the ids and drops
the template's tokens from the result. For Qwen-Image 2.1 the state is the last decoder layer's output before the
language model's final norm, as ``QwenImage21Pipeline`` takes it (``_skip_final_norm``).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import time

import numpy as np
import torch

from omni_ray.families.qwen_image.facts import VISION_PATCH

MIN_IMAGE_PIXELS = VISION_PATCH**2  # one vision token


def local_subfolder(model: str, subfolder: str) -> str:
    """A checkpoint component's local directory; a hub id is downloaded once into the Hugging Face cache."""
    path = pathlib.Path(model).expanduser()
    if path.is_dir():
        return str(path / subfolder)
    from huggingface_hub import snapshot_download

    return str(pathlib.Path(snapshot_download(model, allow_patterns=[f"{subfolder}/*"])) / subfolder)


def vision_model_dir(model: str, text_encoder: str | None = None) -> str:
    """One directory holding ``text_encoder/`` (or the folder ``text_encoder`` names) and ``processor/`` side by side,
    as vLLM loads a multimodal model.

    diffusers keeps Qwen2.5-VL's weights and its processor in two folders; vLLM reads both from its model path. The
    directory, in the user's cache and named after the checkpoint's path, holds links to both folders' files; each
    link is checked and replaced atomically when it points elsewhere, so replicas starting together agree.
    """
    sources = [pathlib.Path(text_encoder or local_subfolder(model, "text_encoder")).resolve(),
               pathlib.Path(local_subfolder(model, "processor")).resolve()]
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
    """Token ids (and for edits images) to last hidden states with vLLM's V1 ``EngineCore``, in this process.

    The only code that touches vLLM's internal engine API, written against vllm 0.32 (pinned): the pooling runner
    with the ``token_embed`` task over all tokens and no activation gives each token's last hidden state, and vLLM's
    own scheduler batches concurrent sequences. With ``max_image_pixels`` the model runs with its vision tower, up to
    ``max_images`` images a sequence: vLLM's input processor runs Qwen2.5-VL's image processor, expands each image
    placeholder and places the vision embeddings (with their M-RoPE positions) in the sequence; without it, only the
    language model loads. Call it from one thread.

    ``model_kind`` ``qwen3-vl`` (Qwen-Image 2.1's encoder): Qwen3-VL from ``text_encoder/`` with its processor (and
    tokenizer) from ``processor/``; every sequence goes through vLLM's input processor (its M-RoPE positions, and
    Qwen3-VL's deepstack of vision features into the first layers when it has images), and the language model's final
    RMSNorm is replaced by its residual add alone, so the pooled states are the last decoder layer's, before the
    norm. RGBA images are
    read with alpha over white (``vision.to_pil``).

    ``captions`` (Qwen-Image-Layered): a second, generating engine writes greedy captions of images of up to
    ``caption_image_pixels`` (``self.captioner``, ``runners.vllm_captioner``) on this engine's weights, so this
    engine loads the vision tower even when its own sequences have no images (``max_image_pixels`` None: it is then
    sized for the smallest image, which it never gets).
    """

    def __init__(
        self,
        model: str,
        dtype: str = "float32",
        max_num_seqs: int = 8,
        max_model_len: int = 1058,
        kv_cache_memory_bytes: int = 256 << 20,
        max_image_pixels: int | None = None,
        max_images: int = 1,
        dummy: bool = False,
        gpu_memory_utilization: float = 0.9,
        model_kind: str = "qwen2.5-vl",
        captions: bool = False,
        caption_max_tokens: int = 512,
        caption_image_pixels: int = 2 << 20,
        quantization: str = "none",
        weights_dir: str | None = None,
    ):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # Left on, vLLM replaces the process's logging set-up on import, and a Serve replica loses its log file.
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        # On CPUs with AMX, vLLM would run a 4-bit (AWQ, GPTQ) encoder's bfloat16 Linears with int8 activations; off,
        # they keep the activation dtype, as the GPU kernels do, and the embeddings stay the checkpoint's.
        os.environ.setdefault("VLLM_CPU_INT4_W4A8", "0")
        from vllm.config import PoolerConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.pooling_params import PoolingParams
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.engine.input_processor import InputProcessor
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        vision = max_image_pixels is not None or captions
        text_encoder = str(pathlib.Path(weights_dir).expanduser()) if weights_dir else local_subfolder(model,
                                                                                                      "text_encoder")
        check_quantized(text_encoder, dtype, weights_read=not dummy, declared=quantization)
        self.qwen3 = model_kind == "qwen3-vl"
        tokenizer = local_subfolder(model, "processor" if self.qwen3 else "tokenizer")
        if vision:
            # Images reach the encoder already resized to about the preset's area, so the processor's own bound
            # never binds; it sizes vLLM's encoder budget (its default, 16k tokens per image, would be profiled).
            modality = {
                "model": vision_model_dir(model, text_encoder),
                "limit_mm_per_prompt": {"image": max_images, "video": 0},
                "mm_processor_kwargs": {"max_pixels": max_image_pixels or MIN_IMAGE_PIXELS},
                "mm_processor_cache_gb": 0,
            }
        else:
            modality = {"model": text_encoder, "language_model_only": True}
        args = EngineArgs(
            tokenizer=tokenizer,
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
        )
        self.config = args.create_engine_config()
        executor = _loopback_executor(UniProcExecutor)
        if self.qwen3:
            executor = _skip_final_norm(executor)
        self.core = EngineCore(self.config, executor, log_stats=False)
        self.pooling_params = PoolingParams(task="token_embed", use_activation=False)
        self.pooling_params.verify(self.config.model_config)
        self.input_processor = InputProcessor(self.config) if vision or self.qwen3 else None
        self.captioner = None
        if captions:
            from omni_ray.runners.vllm_captioner import VllmCaptioner
            from omni_ray.tokenizer import CaptionTokenizer

            template_tokens = CaptionTokenizer(model).max_template_tokens
            self.captioner = VllmCaptioner(args, self.core, _loopback_executor(UniProcExecutor), caption_max_tokens,
                                           caption_image_pixels, template_tokens)

    def device_modules(self) -> list[torch.nn.Module]:
        """The models vLLM holds on its device: the pooling engine's, and the captioner's (which shares its
        submodules). Eager (``enforce_eager``), so their weights may move between forwards (``offload.ParkedWeights``);
        on a CPU, vLLM's linear layers compute from the oneDNN-packed copies it made at load, which stay."""
        models = [self.core.model_executor.driver_worker.worker.model_runner.model]
        if self.captioner is not None:
            models.append(self.captioner.model)
        return models

    def add(self, request_id: str, token_ids: list[int], images: tuple[np.ndarray, ...] = ()) -> None:
        """Queues one sequence; with ``images``, its i-th ``<|image_pad|>`` token stands for the i-th image."""
        from vllm.v1.engine import EngineCoreRequest

        if images or self.qwen3:
            from omni_ray.runners.vision import to_pil

            prompt = {"prompt_token_ids": token_ids}
            if images:
                prompt["multi_modal_data"] = {"image": [to_pil(image) for image in images]}
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
        if self.captioner is not None:
            self.captioner.shutdown()
        self.core.shutdown()


def check_quantized(folder: str, dtype: str, weights_read: bool = True, declared: str = "none") -> None:
    """Refuses at start, naming the setting or the tensor, a quantized text encoder (its config.json's
    ``quantization_config``: AWQ such as ``Qwen/Qwen2.5-VL-7B-Instruct-AWQ``, GPTQ) that vLLM would refuse less
    clearly: activations in a dtype its kernels do not take (vLLM's AWQ and GPTQ take bfloat16 and float16, on the CPU
    too), or, when the weights are read, an AWQ folder whose tensors disagree with its ``quantization_config`` (a cut
    file, another group size: ``checkpoints.awq.check_layout``); and one that is not what ``encoder.quantization``
    (``declared``) says, which the placement check counted. vLLM detects the quantization itself."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from omni_ray.checkpoints import awq

    quantization = awq.read_quantization(folder)
    method = quantization.get("quant_method") if quantization else None
    if declared != "none" and method != declared:
        raise ValueError(f"encoder.quantization: {declared}, but the text encoder in {folder} is "
                         f"{method or 'not quantized'} (its config.json's quantization_config)")
    if quantization is None or quantization.get("quant_method") not in QUANTIZATION_METHODS:
        return
    method = quantization["quant_method"]
    supported = get_quantization_config(method).get_supported_act_dtypes()
    if getattr(torch, dtype) not in supported:
        names = " or ".join(str(d).removeprefix("torch.") for d in supported)
        raise ValueError(f"encoder.dtype: {dtype}, but the text encoder in {folder} is {method}-quantized "
                         f"(its config.json's quantization_config), whose kernels take {names} activations")
    if method == "awq" and weights_read:
        awq.check_layout(folder, quantization)


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


def _skip_final_norm(uniproc_executor: type) -> type:
    """vLLM's in-process executor whose loaded model's language model ends without its final RMSNorm.

    vLLM's decoder layers hand on (hidden, residual) unsummed and the final ``RMSNorm(hidden, residual)`` fuses the
    residual add into the norm; Qwen-Image 2.1 reads the last layer's output before the norm (the pipeline hooks the
    norm to return its input). The norm's ``forward`` on the loaded module becomes the add alone, before the engine's
    first (profiling) forward, so every pass of this engine sees it. Eager only (``enforce_eager``): a compiled graph
    would have traced the module's own forward.
    """

    class PreNormUniProcExecutor(uniproc_executor):
        def _init_executor(self) -> None:
            super()._init_executor()
            final_norm(self.driver_worker.worker.model_runner.model).forward = _residual_add

    return PreNormUniProcExecutor


def final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The language model's final norm in vLLM's model (``language_model.model.norm`` for Qwen3-VL, wrapped or not
    by the pooling adapter; ``model.norm`` for a text-only model)."""
    modules = dict(model.named_modules())
    for name in ("language_model.model.norm", "model.language_model.model.norm", "model.norm"):
        if name in modules:
            return modules[name]
    raise RuntimeError(f"no final norm in {type(model).__name__}'s modules")


def _residual_add(hidden: torch.Tensor, residual: torch.Tensor | None = None):
    """``RMSNorm.forward``'s contract without the norm: the sum, in both places of the fused (out, residual) pair."""
    if residual is None:
        return hidden
    hidden = hidden + residual
    return hidden, hidden
