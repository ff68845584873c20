"""Qwen-Image-Layered's captions under vLLM: a generating V1 ``EngineCore`` beside ``VllmEncoder``'s pooling one, in
this process, on the same weights.

A pooling engine cannot generate (vLLM 0.32 gives a model runner one runner type), so captions need a second engine.
It is built with vLLM's dummy weights, and before its first forward (the KV cache's profiling) every submodule the
pooling model also has (the vision tower, the decoder) is replaced by the pooling model's own module: one copy of
the weights serves both, with whatever vLLM derived from them at load (on a CPU, the oneDNN-packed linear weights).
Attention keeps working per engine: a layer's forward finds its KV cache and metadata by its name in the running
engine's forward context, not through the module. The language-model head, which the pooling model drops, is the
one module of its own; it is read from the checkpoint (one tensor). The dummy weights are freed before the KV cache
is sized; while the engine starts they take as much memory as the weights once more.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import torch

from omni_ray.families.qwen_image.facts import VISION_PATCH


class VllmCaptioner:
    """Greedy captions of images with vLLM's generating ``EngineCore`` (``SamplingParams(temperature=0)``, at most
    ``max_tokens`` new tokens, the checkpoint's repetition penalty as transformers' ``generate`` applies it), its
    weights shared with ``pooling_core``'s model. The image goes through vLLM's input processor as an edit's does.
    A sequence holds the template (``template_tokens`` at most), the image (up to ``max_image_pixels``) and the
    caption.
    ``executor`` is the pooling engine's executor class. Call it from the thread that drives the pooling engine."""

    def __init__(self, engine_args, pooling_core, executor: type, max_tokens: int, max_image_pixels: int,
                 template_tokens: int):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.engine.input_processor import InputProcessor
        source = pooling_core.model_executor.driver_worker.worker.model_runner.model
        self.config = dataclasses.replace(
            engine_args,
            runner="generate",
            convert="auto",
            pooler_config=None,
            load_format="dummy",  # replaced by the pooling model's modules (``share_modules``) before any forward
            max_model_len=template_tokens + max_image_pixels // VISION_PATCH**2 + max_tokens,
            mm_processor_kwargs={"max_pixels": max_image_pixels},
            gpu_memory_utilization=_memory_left(engine_args.gpu_memory_utilization),
        ).create_engine_config()
        self.core = EngineCore(self.config, _sharing_executor(executor, source, engine_args.model), log_stats=False)
        generation = _generation_config(engine_args.model)
        self.sampling_params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False,
                                              repetition_penalty=generation.get("repetition_penalty", 1.0))
        self.input_processor = InputProcessor(self.config)
        self.generated: dict[str, list[int]] = {}  # sequence id -> new tokens so far

    @property
    def model(self) -> torch.nn.Module:
        return self.core.model_executor.driver_worker.worker.model_runner.model

    def add(self, sequence_id: str, token_ids: list[int], image: np.ndarray) -> None:
        """Queues one caption: ``token_ids`` hold one ``<|image_pad|>``, which stands for ``image``."""
        prompt = {"prompt_token_ids": token_ids, "multi_modal_data": {"image": [caption_view(image)]}}
        request = self.input_processor.process_inputs(sequence_id, prompt, self.sampling_params,
                                                      supported_tasks=("generate",))
        self.core.add_request(*self.core.preprocess_add_request(request))
        self.generated[sequence_id] = []

    def abort(self, sequence_ids: list[str]) -> None:
        for sequence_id in sequence_ids:
            self.generated.pop(sequence_id, None)
        self.core.abort_requests(sequence_ids)

    def has_unfinished(self) -> bool:
        return bool(self.generated)

    def step(self) -> dict[str, list[int]]:
        """Runs one vLLM step (one new token for each running caption); returns the captions that finished: id ->
        their new token ids (the end-of-text token included when generation stopped on it)."""
        outputs, _ = self.core.step()
        finished = {}
        for batch in outputs.values():
            for output in batch.outputs:
                tokens = self.generated.get(output.request_id)
                if tokens is None:  # aborted
                    continue
                tokens.extend(output.new_token_ids)
                if output.finished:
                    finished[output.request_id] = self.generated.pop(output.request_id)
        return finished

    def shutdown(self) -> None:
        self.core.shutdown()


def caption_view(image: np.ndarray):
    """The image as Qwen2.5-VL's processor reads the pipeline's RGBA picture: its RGB channels, alpha dropped
    (the processor's ``convert("RGB")``; not composited over white, unlike Qwen-Image 2.1's encoder)."""
    from PIL import Image

    return Image.fromarray(np.ascontiguousarray(image[..., :3]))


def _sharing_executor(uniproc_executor: type, source: torch.nn.Module, checkpoint: str) -> type:
    """vLLM's in-process executor whose freshly loaded (dummy) model takes ``source``'s modules, and its own
    language-model head from ``checkpoint``, before the engine's first forward."""

    class SharedWeightsUniProcExecutor(uniproc_executor):
        def _init_executor(self) -> None:
            super()._init_executor()
            model = self.driver_worker.worker.model_runner.model
            language_model = model.language_model
            tied = language_model.lm_head is language_model.model.embed_tokens  # vLLM ties them at construction
            own = share_modules(model, source)
            if tied:
                language_model.lm_head = language_model.model.embed_tokens  # the shared embeddings
            elif own == ["language_model.lm_head"]:
                load_lm_head(model, checkpoint)
            if own and not (tied or own == ["language_model.lm_head"]):
                raise RuntimeError(f"the generating model's {own} have no counterpart in the pooling model")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the dummy modules' memory, before vLLM measures what is free

    return SharedWeightsUniProcExecutor


def share_modules(target: torch.nn.Module, source: torch.nn.Module) -> list[str]:
    """Replaces each outermost submodule of ``target`` that ``source`` has under the same name, of the same class
    and with the same parameter names, by ``source``'s own; returns the names of the modules with parameters that
    stayed ``target``'s."""
    sources = dict(source.named_modules())
    own = []

    def visit(module: torch.nn.Module, prefix: str) -> None:
        for name, child in list(module.named_children()):
            path = prefix + name
            names = {n for n, _ in child.named_parameters()}
            if not names:
                continue  # nothing to share (a logits processor, rotary tables)
            match = sources.get(path)
            if (match is not None and type(match) is type(child)
                    and {n for n, _ in match.named_parameters()} == names):
                setattr(module, name, match)
            elif any(True for _ in child.children()):
                visit(child, path + ".")
            else:
                own.append(path)

    visit(target, "")
    return own


def load_lm_head(model: torch.nn.Module, checkpoint: str) -> None:
    """The language-model head's weights (``lm_head.weight``) from ``checkpoint``'s safetensors, through vLLM's own
    loader, then the head's post-load processing again."""
    model.load_weights([("lm_head.weight", checkpoint_tensor(checkpoint, "lm_head.weight"))])
    head = model.language_model.lm_head
    head.quant_method.process_weights_after_loading(head)  # a CPU's packed copy of the weight, made anew


def checkpoint_tensor(directory: str, name: str) -> torch.Tensor:
    """One tensor of a safetensors checkpoint (one file, or shards with an index)."""
    from safetensors import safe_open

    path = pathlib.Path(directory)
    index = path / "model.safetensors.index.json"
    file = path / (json.loads(index.read_text())["weight_map"][name] if index.is_file() else "model.safetensors")
    with safe_open(str(file), "pt") as tensors:
        return tensors.get_tensor(name)


def _generation_config(directory: str) -> dict:
    path = pathlib.Path(directory) / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _memory_left(utilization: float) -> float:
    """The share of the GPU the second engine may ask for: vLLM refuses to start when its share is more than the
    memory free, and the pooling engine holds part of it already. Unchanged without a GPU."""
    if not torch.cuda.is_available():
        return utilization
    free, total = torch.cuda.mem_get_info()
    return min(utilization, 0.98 * free / total)
