"""The encoder's engine core: vLLM's ``EngineCore`` under our engine contract.

vLLM batches; this core turns an ``EncodeRequest`` into one vLLM sequence per text (the prompt, and the negative
prompt for true CFG; for an edit each with the input images), and returns the request once all its texts are
encoded, template dropped (for Qwen-Image 2.1 with the image slots its tokenizer marks,
``Qwen21Tokenizer.image_slots``). With the prompt cache on (``encoder.cache_bytes``), a text whose embeddings it
holds is not encoded again, and one identical to a text waiting or being encoded waits for that one.

The core keeps the waiting texts itself and hands vLLM at most what vLLM runs at once: ``max_num_seqs`` sequences in
flight (captions counted in their own engine). At each step it fills the free seats in the order every stage takes
work (``FairShare``, omni_ray/engine/fair_share.py): by the request's priority, then each turn to the tenant that
used the encoder least lately (its texts' tokens), then by arrival. So an urgent request never waits behind more
than the sequences already in flight, and a light tenant's texts go in the next free seats behind a flood. vLLM's
own V1 scheduler would serve its waiting queue first come first served, or by (priority, arrival) with
``policy="priority"``, but it knows no tenants and the other encoders (transformers', the simulated one) no
priorities: one order, here, serves them all. A text vLLM refuses as it is handed over (its images, say) fails its
requests alone.

Qwen-Image-Layered's ``CaptionRequest`` (a request without a prompt) runs on the encoder's captioner, a generating
engine beside the pooling one (``VllmCaptioner``): its caption template's ids with the image, greedy, to a
``Caption``. Captions are cached by image in the same way (``CaptionCache``), and one identical to a caption being
written waits for it. Both engines step in each step of this core.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np

from omni_ray.engine.caption_cache import CaptionCache
from omni_ray.engine.fair_share import FairShare
from omni_ray.engine.output import EngineCoreOutput, StepError
from omni_ray.engine.prompt_cache import PromptCache, copy_embeds
from omni_ray.engine.stats import EncoderStats, PromptCacheStats
from omni_ray.errors import EngineError, request_failure
from omni_ray.families.qwen_image.facts import PromptTemplate
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
    """One text, waiting in the core or in vLLM, and the request parts waiting for its embeddings (several when
    identical texts arrived before it was done)."""

    sequence_id: str  # vLLM's request id
    key: bytes | None  # its prompt-cache key
    readers: list[tuple[str, Part]]  # (request id, part)
    token_ids: list[int]
    images: tuple[np.ndarray, ...]
    priority: int  # its most urgent reader's
    tenant: str  # that reader's
    image_slots: np.ndarray | None = None  # Qwen-Image 2.1: its tokens that are image slots, after the drop
    in_flight: bool = False  # handed to the encoder

    @property
    def request_ids(self) -> list[str]:
        return [request_id for request_id, _ in self.readers]


@dataclass(slots=True)
class _Captioning:
    """One caption, waiting in the core or being written, and the requests waiting for it (several when the same
    image arrived before it was done)."""

    sequence_id: str  # the captioner's request id
    key: bytes | None  # its caption-cache key
    readers: list[str]  # request ids
    token_ids: list[int]
    image: np.ndarray
    priority: int  # its most urgent reader's
    tenant: str  # that reader's
    in_flight: bool = False  # handed to the captioner

    @property
    def request_ids(self) -> list[str]:
        return self.readers


Work = TypeVar("Work", _Sequence, _Captioning)


class EncoderEngineCore:
    def __init__(self, tokenizer: PromptTokenizer, encoder: SequenceEncoder, max_sequence_length: int = 512,
                 cache: PromptCache | None = None, captioner: Captioner | None = None,
                 caption_tokenizer: CaptionTokenizer | None = None, caption_cache: CaptionCache | None = None,
                 max_num_seqs: int = 8):
        """``max_num_seqs``: the sequences the encoder (and, apart, the captioner) runs at once, vLLM's own
        bound: the most this core hands it."""
        assert max_num_seqs > 0
        self.tokenizer = tokenizer
        self.encoder = encoder
        self.max_sequence_length = max_sequence_length
        self.max_num_seqs = max_num_seqs
        self.cache = cache  # texts encoded before: their embeddings without running the encoder
        self.pending: dict[str, dict[Part, PromptEmbeds | None]] = {}  # request id -> part -> embeds once done
        self.sequences: dict[str, _Sequence] = {}  # sequence id -> a text waiting or in vLLM, in arrival order
        self.running: dict[bytes, str] = {}  # cache key -> the sequence id encoding it (waiting or in vLLM)
        self.shares = FairShare()  # tenants' recent use of the encoder: their texts' tokens
        self.num_encoded = 0  # sequences the encoder ran
        self.captioner = captioner  # Qwen-Image-Layered's; None where the preset writes no captions
        self.caption_tokenizer = caption_tokenizer
        self.caption_cache = caption_cache
        self.pending_captions: dict[str, Caption | None] = {}  # request id -> its caption once written
        self.captioning: dict[str, _Captioning] = {}  # sequence id -> a caption waiting or being written
        self.running_captions: dict[bytes, str] = {}  # caption-cache key -> the sequence id writing it
        self.caption_shares = FairShare()  # tenants' recent use of the captioner
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
        except Exception:  # the tokenizer refused a text (its images, say): nothing of the request stays behind
            self.abort_requests([request.request_id])
            raise

    def _add_text(self, request: EncodeRequest, part: Part, token_ids: list[int], image_digest: bytes | None
                  ) -> None:
        """The text's embeddings from the cache; else it joins the identical text waiting or being encoded (lifting
        it to the request's priority); else it waits for a seat in vLLM."""
        key = self.cache.key(token_ids, image_digest) if self.cache is not None else None
        reader = (request.request_id, part)
        self.pending[request.request_id][part] = self.cache.get(key) if key is not None else None
        if self.pending[request.request_id][part] is not None:
            return
        if key in self.running:
            sequence = self.sequences[self.running[key]]
            sequence.readers.append(reader)
            _lift(sequence, request)
            return
        sequence_id = f"{request.request_id}/{part.value}"  # unique: vLLM's own request id
        slots = self.tokenizer.image_slots(token_ids, tuple(image.shape[:2] for image in request.images))
        self.sequences[sequence_id] = _Sequence(sequence_id, key, [reader], token_ids, request.images,
                                                request.priority, request.tenant, slots)
        if key is not None:
            self.running[key] = sequence_id

    def _add_caption(self, request: CaptionRequest) -> None:
        """The image's caption from the cache; else it joins the same caption waiting or being written (lifting it
        to the request's priority); else it waits for a seat in the captioner."""
        if self.captioner is None:
            raise EngineError("this encoder writes no captions (only a qwen-image-layered preset's does)")
        key = self.caption_cache.key(request.image, request.language) if self.caption_cache is not None else None
        self.pending_captions[request.request_id] = self.caption_cache.get(key) if key is not None else None
        if self.pending_captions[request.request_id] is not None:
            return
        if key in self.running_captions:
            captioning = self.captioning[self.running_captions[key]]
            captioning.readers.append(request.request_id)
            _lift(captioning, request)
            return
        sequence_id = f"{request.request_id}/caption"
        token_ids = self.caption_tokenizer.tokenize(request.language)
        self.captioning[sequence_id] = _Captioning(sequence_id, key, [request.request_id], token_ids, request.image,
                                                   request.priority, request.tenant)
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
        in_vllm = [sequence_id for sequence_id in unread if self._forget(sequence_id).in_flight]
        if in_vllm:
            self.encoder.abort(in_vllm)
        unread = []
        for sequence_id, caption in self.captioning.items():
            caption.readers = [reader for reader in caption.readers if reader not in aborted]
            if not caption.readers:
                unread.append(sequence_id)
        in_vllm = [sequence_id for sequence_id in unread if self._forget_caption(sequence_id).in_flight]
        if in_vllm:
            self.captioner.abort(in_vllm)

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending or self.pending_captions)

    def needs_device(self) -> bool:
        """Whether the next step runs the model: texts or captions to encode (not only cache hits to answer)."""
        return bool(self.sequences or self.captioning)

    def step(self) -> list[EngineCoreOutput]:
        """Hands each engine the waiting work its free seats take, then one step of each engine that has work: the
        pooling engine's texts, the captioner's captions."""
        refused = self._hand_over(self.sequences, self.shares, self._to_encoder)
        refused += self._hand_over(self.captioning, self.caption_shares, self._to_captioner)
        if any(sequence.in_flight for sequence in self.sequences.values()):
            self._step_encoder()
        if any(caption.in_flight for caption in self.captioning.values()):
            self._step_captioner()
        return refused + self._finished_prompts() + self._finished_captions()

    def _hand_over(self, queue: dict[str, Work], shares: FairShare, add: Callable[[Work], None]
                   ) -> list[EngineCoreOutput]:
        """Fills the engine's free seats (``max_num_seqs`` in flight) from ``queue`` in turn order; a text the
        engine refuses fails its requests alone."""
        seats = self.max_num_seqs - sum(work.in_flight for work in queue.values())
        handed, refused = [], {}
        for work in shares.in_turn([work for work in queue.values() if not work.in_flight], _tokens):
            if len(handed) == seats:
                break
            try:
                add(work)
            except Exception as err:  # vLLM's input processing refused it (its images, say)
                refused.update(dict.fromkeys(work.request_ids, request_failure(err)))
                continue
            work.in_flight = True
            handed.append(work)
        if handed:
            shares.charge(handed, _tokens)
        if refused:
            self.abort_requests(list(refused))
        return [EngineCoreOutput.failed(request_id, error) for request_id, error in refused.items()]

    def _to_encoder(self, sequence: _Sequence) -> None:
        self.encoder.add(sequence.sequence_id, sequence.token_ids, sequence.images)

    def _to_captioner(self, captioning: _Captioning) -> None:
        self.captioner.add(captioning.sequence_id, captioning.token_ids, captioning.image)

    def _step_encoder(self) -> None:
        try:
            finished = self.encoder.step()
        except Exception as err:  # vLLM may have run any of its texts; waiting ones and cache hits wait on
            raise StepError(sorted({rid for seq in self.sequences.values() if seq.in_flight
                                    for rid in seq.request_ids})) from err
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
            raise StepError(sorted({rid for caption in self.captioning.values() if caption.in_flight
                                    for rid in caption.readers})) from err
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

    def set_limits(self, max_num_seqs: int) -> None:
        """Sequences handed to vLLM at once from now on (a live change; those in flight finish)."""
        assert max_num_seqs > 0
        self.max_num_seqs = max_num_seqs

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


def _lift(work: _Sequence | _Captioning, request: EncodeRequest | CaptionRequest) -> None:
    """A text or caption another request also waits for takes that request's priority when it is more urgent."""
    if request.priority < work.priority:
        work.priority, work.tenant = request.priority, request.tenant


def _tokens(work: _Sequence | _Captioning) -> int:
    return len(work.token_ids)


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
