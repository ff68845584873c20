"""The encoder's engine core: vLLM's ``EngineCore`` under our engine contract.

vLLM schedules and batches; this core turns an ``EncodeRequest`` into one vLLM sequence per text (the prompt, and
the negative prompt for true CFG; for an edit each with the input images), and returns the request once all its
texts are encoded, template dropped (for Qwen-Image 2.1 with the image slots its tokenizer marks,
``Qwen21Tokenizer.image_slots``). With the prompt cache on (``encoder.cache_bytes``), a text whose embeddings it
holds is not encoded again, and one identical to a text vLLM is encoding waits for that one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from omni_ray.engine.output import EngineCoreOutput, StepError
from omni_ray.engine.prompt_cache import PromptCache, copy_embeds
from omni_ray.engine.stats import EncoderStats, PromptCacheStats
from omni_ray.qwen_image import PromptTemplate
from omni_ray.records import EncodedPrompt, EncodeRequest, PromptEmbeds
from omni_ray.tokenizer import PromptTokenizer

if TYPE_CHECKING:
    import torch


class SequenceEncoder(Protocol):
    """What the core drives: vLLM's engine core (``runners.vllm_encoder.VllmEncoder``) or the simulated encoder."""

    def add(self, sequence_id: str, token_ids: list[int], images: tuple[np.ndarray, ...] = ()) -> None: ...
    def abort(self, sequence_ids: list[str]) -> None: ...
    def step(self) -> dict: ...  # sequence id -> [num_tokens, hidden], for the sequences that finished
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


class EncoderEngineCore:
    def __init__(self, tokenizer: PromptTokenizer, encoder: SequenceEncoder, max_sequence_length: int = 512,
                 cache: PromptCache | None = None):
        self.tokenizer = tokenizer
        self.encoder = encoder
        self.max_sequence_length = max_sequence_length
        self.cache = cache  # texts encoded before: their embeddings without running the encoder
        self.pending: dict[str, dict[Part, PromptEmbeds | None]] = {}  # request id -> part -> embeds once done
        self.sequences: dict[str, _Sequence] = {}  # sequence id -> the text vLLM runs, while it runs
        self.running: dict[bytes, str] = {}  # cache key -> the sequence id encoding it
        self.num_encoded = 0  # sequences the encoder ran

    def add_request(self, request: EncodeRequest) -> None:
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

    def abort_requests(self, request_ids: list[str]) -> None:
        aborted = set(request_ids)
        for request_id in request_ids:
            self.pending.pop(request_id, None)
        unread = []  # sequences no request waits for any more
        for sequence_id, sequence in self.sequences.items():
            sequence.readers = [reader for reader in sequence.readers if reader[0] not in aborted]
            if not sequence.readers:
                unread.append(sequence_id)
        for sequence_id in unread:
            self._forget(sequence_id)
        if unread:
            self.encoder.abort(unread)

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[EngineCoreOutput]:
        if not self.pending:
            return []
        finished = {}
        if self.sequences:
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
        outputs = []
        for request_id, parts in list(self.pending.items()):  # those the step finished, and cache hits
            if all(embeds is not None for embeds in parts.values()):
                del self.pending[request_id]
                result = EncodedPrompt(prompt=parts[Part.PROMPT], negative=parts.get(Part.NEGATIVE))
                outputs.append(EngineCoreOutput(request_id, result, "stop"))
        return outputs

    def _forget(self, sequence_id: str) -> _Sequence:
        sequence = self.sequences.pop(sequence_id)
        if sequence.key is not None:
            self.running.pop(sequence.key, None)
        return sequence

    def stats(self) -> EncoderStats:
        cache = self.cache
        if cache is None:
            return EncoderStats(self.num_encoded, None)
        return EncoderStats(self.num_encoded, PromptCacheStats(cache.num_hits, cache.num_misses, len(cache),
                                                               cache.nbytes))

    def shutdown(self) -> None:
        self.encoder.shutdown()


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
