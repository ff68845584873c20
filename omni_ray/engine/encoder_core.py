"""The encoder's engine core: vLLM's ``EngineCore`` under our engine contract.

vLLM schedules and batches; this core turns an ``EncodeRequest`` into one vLLM sequence per text (the prompt, and
the negative prompt for true CFG; for an edit each with the input images), and returns the request once all its
texts are encoded, template dropped (for Qwen-Image 2.1 with the image slots its tokenizer marks,
``Qwen21Tokenizer.image_slots``). With the prompt cache on (``encoder.cache_bytes``), a text whose embeddings it
holds is not encoded again, and one identical to a text vLLM is encoding waits for that one.

Qwen-Image-Layered's ``CaptionRequest`` (a request without a prompt) runs on the encoder's captioner, a generating
engine beside the pooling one (``VllmCaptioner``): its caption template's ids with the image, greedy, to a
``Caption``. Captions are cached by image in the same way (``CaptionCache``), and one identical to a caption being
written waits for it. Both engines step in each step of this core.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from omni_ray.engine.caption_cache import CaptionCache
from omni_ray.engine.output import EngineCoreOutput, StepError
from omni_ray.engine.prompt_cache import PromptCache, copy_embeds
from omni_ray.engine.stats import EncoderStats, PromptCacheStats
from omni_ray.errors import EngineError
from omni_ray.qwen_image import PromptTemplate
from omni_ray.records import Caption, CaptionRequest, EncodedPrompt, EncodeRequest, PromptEmbeds
from omni_ray.tokenizer import CaptionTokenizer, PromptTokenizer

if TYPE_CHECKING:
    import torch


class SequenceEncoder(Protocol):
    """What the core drives: vLLM's engine core (``runners.vllm_encoder.VllmEncoder``) or the simulated encoder."""

    def add(self, sequence_id: str, token_ids: list[int], images: tuple[np.ndarray, ...] = ()) -> None: ...
    def abort(self, sequence_ids: list[str]) -> None: ...
    def step(self) -> dict: ...  # sequence id -> [num_tokens, hidden], for the sequences that finished
    def shutdown(self) -> None: ...


class Captioner(Protocol):
    """What writes captions: vLLM's generating engine (``runners.vllm_captioner.VllmCaptioner``), transformers'
    ``generate`` or the simulated captioner."""

    def add(self, sequence_id: str, token_ids: list[int], image: np.ndarray) -> None: ...
    def abort(self, sequence_ids: list[str]) -> None: ...
    def step(self) -> dict[str, list[int]]: ...  # sequence id -> its new token ids, for the captions that finished
    def shutdown(self) -> None: ...


class Part(enum.Enum):
    """Which text of a request a sequence encodes."""

    PROMPT = "prompt"
    NEGATIVE = "negative"


@dataclass(slots=True)
class _Sequence:
    """One text in vLLM, and the request parts waiting for its embeddings (several when identical texts arrived
    while it ran)."""

    key: bytes | None  # its prompt-cache key
    readers: list[tuple[str, Part]]  # (request id, part)
    image_slots: np.ndarray | None = None  # Qwen-Image 2.1: its tokens that are image slots, after the drop


@dataclass(slots=True)
class _Captioning:
    """One caption the captioner writes, and the requests waiting for it (several when the same image arrived while
    it ran)."""

    key: bytes | None  # its caption-cache key
    readers: list[str]  # request ids


class EncoderEngineCore:
    def __init__(self, tokenizer: PromptTokenizer, encoder: SequenceEncoder, max_sequence_length: int = 512,
                 cache: PromptCache | None = None, captioner: Captioner | None = None,
                 caption_tokenizer: CaptionTokenizer | None = None, caption_cache: CaptionCache | None = None):
        self.tokenizer = tokenizer
        self.encoder = encoder
        self.max_sequence_length = max_sequence_length
        self.cache = cache  # texts encoded before: their embeddings without running the encoder
        self.pending: dict[str, dict[Part, PromptEmbeds | None]] = {}  # request id -> part -> embeds once done
        self.sequences: dict[str, _Sequence] = {}  # sequence id -> the text vLLM runs, while it runs
        self.running: dict[bytes, str] = {}  # cache key -> the sequence id encoding it
        self.num_encoded = 0  # sequences the encoder ran
        self.captioner = captioner  # Qwen-Image-Layered's; None where the preset writes no captions
        self.caption_tokenizer = caption_tokenizer
        self.caption_cache = caption_cache
        self.pending_captions: dict[str, Caption | None] = {}  # request id -> its caption once written
        self.captioning: dict[str, _Captioning] = {}  # sequence id -> the caption the captioner writes
        self.running_captions: dict[bytes, str] = {}  # caption-cache key -> the sequence id writing it
        self.num_captioned = 0  # captions the captioner wrote

    def add_request(self, request: EncodeRequest | CaptionRequest) -> None:
        if isinstance(request, CaptionRequest):
            self._add_caption(request)
            return
        texts = {Part.PROMPT: request.prompt}
        if request.negative_prompt is not None:
            texts[Part.NEGATIVE] = request.negative_prompt
        token_ids = {part: self.tokenizer.tokenize(text, len(request.images)) for part, text in texts.items()}
        self.pending[request.request_id] = dict.fromkeys(texts)
        image_digest = None
        if self.cache is not None and request.images:
            image_digest = self.cache.image_digest(request.images)
        try:
            for part, ids in token_ids.items():
                self._add_text(request, part, ids, image_digest)
        except Exception:  # vLLM refused a text (its images, say): nothing of the request stays behind
            self.abort_requests([request.request_id])
            raise

    def _add_text(self, request: EncodeRequest, part: Part, token_ids: list[int], image_digest: bytes | None
                  ) -> None:
        """The text's embeddings from the cache; else it joins the identical text vLLM is encoding; else it goes to
        vLLM."""
        key = self.cache.key(token_ids, image_digest) if self.cache is not None else None
        reader = (request.request_id, part)
        self.pending[request.request_id][part] = self.cache.get(key) if key is not None else None
        if self.pending[request.request_id][part] is not None:
            return
        if key in self.running:
            self.sequences[self.running[key]].readers.append(reader)
            return
        sequence_id = f"{request.request_id}/{part.value}"  # unique: vLLM's own request id
        slots = self.tokenizer.image_slots(token_ids, tuple(image.shape[:2] for image in request.images))
        self.encoder.add(sequence_id, token_ids, request.images)
        self.sequences[sequence_id] = _Sequence(key, [reader], slots)
        if key is not None:
            self.running[key] = sequence_id

    def _add_caption(self, request: CaptionRequest) -> None:
        """The image's caption from the cache; else it joins the same caption being written; else the captioner
        writes it."""
        if self.captioner is None:
            raise EngineError("this encoder writes no captions (only a qwen-image-layered preset's does)")
        key = self.caption_cache.key(request.image, request.language) if self.caption_cache is not None else None
        self.pending_captions[request.request_id] = self.caption_cache.get(key) if key is not None else None
        if self.pending_captions[request.request_id] is not None:
            return
        if key in self.running_captions:
            self.captioning[self.running_captions[key]].readers.append(request.request_id)
            return
        sequence_id = f"{request.request_id}/caption"
        try:
            self.captioner.add(sequence_id, self.caption_tokenizer.tokenize(request.language), request.image)
        except Exception:  # vLLM refused it (its image, say)
            del self.pending_captions[request.request_id]
            raise
        self.captioning[sequence_id] = _Captioning(key, [request.request_id])
        if key is not None:
            self.running_captions[key] = sequence_id

    def abort_requests(self, request_ids: list[str]) -> None:
        aborted = set(request_ids)
        for request_id in request_ids:
            self.pending.pop(request_id, None)
            self.pending_captions.pop(request_id, None)
        unread = []  # sequences no request waits for any more
        for sequence_id, sequence in self.sequences.items():
            sequence.readers = [reader for reader in sequence.readers if reader[0] not in aborted]
            if not sequence.readers:
                unread.append(sequence_id)
        for sequence_id in unread:
            self._forget(sequence_id)
        if unread:
            self.encoder.abort(unread)
        unread = []
        for sequence_id, caption in self.captioning.items():
            caption.readers = [reader for reader in caption.readers if reader not in aborted]
            if not caption.readers:
                unread.append(sequence_id)
        for sequence_id in unread:
            self._forget_caption(sequence_id)
        if unread:
            self.captioner.abort(unread)

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending or self.pending_captions)

    def step(self) -> list[EngineCoreOutput]:
        """One step of each engine that has work: the pooling engine's texts, the captioner's captions."""
        if self.sequences:
            self._step_encoder()
        if self.captioning:
            self._step_captioner()
        return self._finished_prompts() + self._finished_captions()

    def _step_encoder(self) -> None:
        try:
            finished = self.encoder.step()
        except Exception as err:  # vLLM may have run any of its texts; requests served from the cache wait
            raise StepError(sorted({rid for seq in self.sequences.values() for rid, _ in seq.readers})) from err
        for sequence_id, hidden in finished.items():
            if sequence_id not in self.sequences:  # aborted while vLLM ran it
                continue
            sequence = self._forget(sequence_id)
            embeds = to_prompt_embeds(hidden, self.tokenizer.template, self.max_sequence_length, sequence.image_slots)
            self.num_encoded += 1
            if sequence.key is not None:
                self.cache.put(sequence.key, embeds)
            for i, (request_id, part) in enumerate(sequence.readers):  # each reader its own tensor
                self.pending[request_id][part] = embeds if i == 0 else copy_embeds(embeds)

    def _step_captioner(self) -> None:
        try:
            finished = self.captioner.step()
        except Exception as err:
            raise StepError(sorted({rid for caption in self.captioning.values() for rid in caption.readers})) from err
        for sequence_id, token_ids in finished.items():
            if sequence_id not in self.captioning:  # aborted while it ran
                continue
            captioning = self._forget_caption(sequence_id)
            caption = Caption(self.caption_tokenizer.decode(token_ids), tuple(token_ids))
            self.num_captioned += 1
            if captioning.key is not None:
                self.caption_cache.put(captioning.key, caption)
            for i, request_id in enumerate(captioning.readers):  # each reader its own record (its timings)
                self.pending_captions[request_id] = caption if i == 0 else Caption(caption.text, caption.token_ids)

    def _finished_prompts(self) -> list[EngineCoreOutput]:
        """The encode requests whose texts are all done: by this step, or from the cache."""
        outputs = []
        for request_id, parts in list(self.pending.items()):
            if all(embeds is not None for embeds in parts.values()):
                del self.pending[request_id]
                result = EncodedPrompt(prompt=parts[Part.PROMPT], negative=parts.get(Part.NEGATIVE))
                outputs.append(EngineCoreOutput(request_id, result, "stop"))
        return outputs

    def _finished_captions(self) -> list[EngineCoreOutput]:
        done = [request_id for request_id, caption in self.pending_captions.items() if caption is not None]
        return [EngineCoreOutput(request_id, self.pending_captions.pop(request_id), "stop") for request_id in done]

    def _forget(self, sequence_id: str) -> _Sequence:
        sequence = self.sequences.pop(sequence_id)
        if sequence.key is not None:
            self.running.pop(sequence.key, None)
        return sequence

    def _forget_caption(self, sequence_id: str) -> _Captioning:
        captioning = self.captioning.pop(sequence_id)
        if captioning.key is not None:
            self.running_captions.pop(captioning.key, None)
        return captioning

    def stats(self) -> EncoderStats:
        cache = self.cache
        prompt_cache = None
        if cache is not None:
            prompt_cache = PromptCacheStats(cache.num_hits, cache.num_misses, len(cache), cache.nbytes)
        caption_hits = self.caption_cache.num_hits if self.caption_cache is not None else 0
        return EncoderStats(self.num_encoded, prompt_cache, self.num_captioned, caption_hits)

    def shutdown(self) -> None:
        self.encoder.shutdown()
        if self.captioner is not None and self.captioner is not getattr(self.encoder, "captioner", None):
            self.captioner.shutdown()  # a captioner of its own (the encoder shuts its own down)


def to_prompt_embeds(hidden: torch.Tensor, template: PromptTemplate, max_sequence_length: int,
                     image_slots: np.ndarray | None = None) -> PromptEmbeds:
    """Drops the template's system tokens from one sequence's last hidden state ``[num_tokens, hidden]``, as
    diffusers' ``encode_prompt`` does (text to image also cuts at ``max_sequence_length``). Qwen-Image 2.1's
    ``image_slots`` (after the drop, from the token ids) ride along as a bool tensor, the pipeline's
    ``image_pad_mask``."""
    import torch

    hidden = hidden[template.drop :]
    if template.truncates:
        hidden = hidden[:max_sequence_length]
    if image_slots is None:
        return PromptEmbeds(hidden.detach().cpu().contiguous())
    if len(image_slots) != hidden.shape[0]:
        raise RuntimeError(f"the encoder returned {hidden.shape[0]} tokens after the template's, but the token ids "
                           f"with their images' vision tokens are {len(image_slots)}")
    return PromptEmbeds(hidden.detach().cpu().contiguous(), torch.from_numpy(np.array(image_slots, dtype=bool)))
