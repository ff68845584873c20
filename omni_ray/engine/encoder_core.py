"""The encoder's engine core: vLLM's ``EngineCore`` under our engine contract.

vLLM schedules and batches; this core turns an ``EncodeRequest`` into one vLLM sequence per text (the prompt, and
the negative prompt for true CFG; for an edit each with the input image), and returns the request once all its
texts are encoded, template dropped.
"""

from __future__ import annotations

from omni_ray.engine.output import EngineCoreOutput, StepError
from omni_ray.stages.encode import (
    EncodedPrompt,
    EncodeRequest,
    PromptEmbeds,
    PromptTokenizer,
    VllmEncoder,
    to_prompt_embeds,
)


class EncoderEngineCore:
    def __init__(self, tokenizer: PromptTokenizer, encoder: VllmEncoder, max_sequence_length: int = 512):
        self.tokenizer = tokenizer
        self.encoder = encoder
        self.max_sequence_length = max_sequence_length
        self.pending: dict[str, dict[str, PromptEmbeds | None]] = {}  # request id -> part -> embeds once done

    def add_request(self, request: EncodeRequest) -> None:
        texts = {"prompt": request.prompt}
        if request.negative_prompt is not None:
            texts["negative"] = request.negative_prompt
        token_ids = {part: self.tokenizer.tokenize(text) for part, text in texts.items()}
        self.pending[request.request_id] = dict.fromkeys(texts)
        for part, ids in token_ids.items():
            self.encoder.add(f"{request.request_id}/{part}", ids, request.image)

    def abort_requests(self, request_ids: list[str]) -> None:
        sequences = []
        for request_id in request_ids:
            parts = self.pending.pop(request_id, None)
            if parts is not None:
                sequences += [f"{request_id}/{part}" for part in parts]
        if sequences:
            self.encoder.abort(sequences)

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[EngineCoreOutput]:
        if not self.pending:
            return []
        try:
            finished = self.encoder.step()
        except Exception as err:  # vLLM may have run any of them
            raise StepError(list(self.pending)) from err
        outputs = []
        for sequence_id, hidden in finished.items():
            request_id, part = sequence_id.rsplit("/", 1)
            parts = self.pending.get(request_id)
            if parts is None:  # aborted while vLLM ran it
                continue
            parts[part] = to_prompt_embeds(hidden, self.tokenizer.template, self.max_sequence_length)
            if all(embeds is not None for embeds in parts.values()):
                del self.pending[request_id]
                result = EncodedPrompt(prompt=parts["prompt"], negative=parts.get("negative"))
                outputs.append(EngineCoreOutput(request_id, result, "stop"))
        return outputs

    def shutdown(self) -> None:
        self.encoder.shutdown()
