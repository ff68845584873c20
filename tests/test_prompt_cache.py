"""The encoder's prompt-embedding cache: keys, the byte bound, and a repeated prompt skipping vLLM's encoder."""

import time

import numpy as np
import pytest
import torch
from conftest import REPO

from omni_ray.config import load_config
from omni_ray.engine.builders import build_encoder_core
from omni_ray.engine.prompt_cache import PromptCache
from omni_ray.engine.stats import EncoderStats, PromptCacheStats
from omni_ray.records import EncodeRequest, PromptEmbeds


def embeds(tokens: int, seed: int = 0) -> PromptEmbeds:
    return PromptEmbeds(torch.randn(tokens, 16, generator=torch.Generator().manual_seed(seed)))


def test_keys_tell_apart_one_token_one_pixel_and_the_checkpoint():
    cache = PromptCache(1 << 20, "model", "{}")
    image = np.zeros((8, 8, 3), np.uint8)
    other = image.copy()
    other[7, 7, 2] = 1
    digest = PromptCache.image_digest
    keys = {cache.key([1, 2, 3]), cache.key([1, 2, 4]), cache.key([1, 2, 3], digest(image)),
            cache.key([1, 2, 3], digest(other)), cache.key([1, 2, 3], digest(image.reshape(4, 16, 3))),
            PromptCache(1 << 20, "other", "{}").key([1, 2, 3]), PromptCache(1 << 20, "model", "x{}").key([1, 2, 3])}
    assert len(keys) == 7
    assert cache.key([1, 2, 3], digest(image)) == cache.key([1, 2, 3], digest(image.copy()))


def test_a_hit_is_a_copy_and_the_cache_stays_within_its_bytes_under_1000_prompts():
    cache = PromptCache(200_000, "model", "{}")
    cache.put(cache.key([0]), embeds(10))
    got = cache.get(cache.key([0]))
    assert torch.equal(got.embeds, embeds(10).embeds)
    got.embeds.zero_()  # a caller changing its copy changes nothing stored
    assert torch.equal(cache.get(cache.key([0])).embeds, embeds(10).embeds)
    for i in range(1, 1000):
        cache.put(cache.key([i]), embeds(5 + i % 60, seed=i))
        assert cache.nbytes <= 200_000
    assert cache.nbytes == sum(e.embeds.nelement() * 4 for e in cache._entries.values())
    assert 0 < len(cache) < 1000 and cache.get(cache.key([1])) is None  # the oldest left
    assert torch.equal(cache.get(cache.key([999])).embeds, embeds(5 + 999 % 60, seed=999).embeds)
    cache.put(cache.key([5000]), embeds(4000))  # larger than the whole cache: not kept, nothing evicted for it
    assert cache.get(cache.key([5000])) is None and cache.nbytes <= 200_000
    assert (cache.num_hits, cache.num_misses) == (3, 2)


def test_lookups_refresh_an_entry():
    cache = PromptCache(3 * 10 * 16 * 4, "model", "{}")  # three entries of 10 tokens
    for i in range(3):
        cache.put(cache.key([i]), embeds(10, i))
    cache.get(cache.key([0]))  # 0 is now the most recent: 1 leaves next
    cache.put(cache.key([3]), embeds(10, 3))
    assert cache.get(cache.key([1])) is None and cache.get(cache.key([0])) is not None


@pytest.mark.vllm
def test_a_repeated_prompt_skips_vllm_and_returns_the_same_embeddings(tiny_dir):
    config = load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir))
    core = build_encoder_core(config)
    try:
        assert core.stats() == EncoderStats(0, PromptCacheStats(0, 0, 0, 0))  # an empty cache is one too

        def encode(request: EncodeRequest):
            start, steps = time.perf_counter(), 0
            core.add_request(request)
            while core.has_unfinished_requests():
                outputs = core.step()
                steps += 1
            assert [o.request_id for o in outputs] == [request.request_id]
            return outputs[0].result, steps, time.perf_counter() - start

        first, _, cold_s = encode(EncodeRequest("a", "a red cat on a mat", "blurry"))
        assert core.num_encoded == 2 and (core.cache.num_hits, core.cache.num_misses) == (0, 2)
        assert core.stats().prompt_cache == PromptCacheStats(0, 2, 2, core.cache.nbytes) and core.cache.nbytes > 0
        again, steps, warm_s = encode(EncodeRequest("b", "a red cat on a mat", "blurry"))
        assert core.num_encoded == 2 and core.cache.num_hits == 2  # vLLM ran nothing
        assert steps == 1 and warm_s < cold_s / 5, (warm_s, cold_s)
        assert torch.equal(again.prompt.embeds, first.prompt.embeds)
        assert torch.equal(again.negative.embeds, first.negative.embeds)
        # One character off: encoded, and its own embeddings (the prompt hits, the negative one misses)
        other, _, _ = encode(EncodeRequest("c", "a red cat on a mat", "blurrx"))
        assert core.num_encoded == 3 and torch.equal(other.prompt.embeds, first.prompt.embeds)
        assert not torch.equal(other.negative.embeds, first.negative.embeds)
        one_char, _, _ = encode(EncodeRequest("d", "a red cat on a hat"))
        assert core.num_encoded == 4 and not torch.equal(one_char.prompt.embeds[:first.prompt.num_tokens],
                                                         first.prompt.embeds[:one_char.prompt.num_tokens])

        # The same new text arriving while it is encoded waits for it: one sequence in vLLM for three requests, one
        # of which leaves; the others get equal embeddings, each its own tensor.
        for request_id in ("e", "f", "g"):
            core.add_request(EncodeRequest(request_id, "a lighthouse at dusk"))
        assert len(core.sequences) == 1
        core.abort_requests(["e"])  # the one that started it: the sequence goes on for the others
        assert len(core.sequences) == 1
        results = {}
        while core.has_unfinished_requests():
            results.update({o.request_id: o.result for o in core.step()})
        assert sorted(results) == ["f", "g"] and core.num_encoded == 5
        assert torch.equal(results["f"].prompt.embeds, results["g"].prompt.embeds)
        assert results["f"].prompt.embeds.data_ptr() != results["g"].prompt.embeds.data_ptr()
        for request_id in ("h", "i"):  # every reader gone: the sequence leaves vLLM
            core.add_request(EncodeRequest(request_id, "a harbour in fog"))
        core.abort_requests(["h", "i"])
        assert not core.sequences and not core.running and not core.has_unfinished_requests()
    finally:
        core.shutdown()


class FakeEncoder:
    """A SequenceEncoder that refuses texts holding ``refused`` and whose step fails when told to: the core's
    bookkeeping, not vLLM, is the subject."""

    def __init__(self, refused: int):
        self.refused, self.waiting, self.fail_next = refused, {}, False

    def add(self, sequence_id, token_ids, images=()):
        if self.refused in token_ids:
            raise ValueError("refused")
        self.waiting[sequence_id] = len(token_ids)

    def abort(self, sequence_ids):
        for sequence_id in sequence_ids:
            self.waiting.pop(sequence_id, None)

    def step(self):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("step failed")
        done, self.waiting = self.waiting, {}
        return {sequence_id: torch.ones(n, 8) for sequence_id, n in done.items()}

    def shutdown(self):
        pass


def test_a_refused_text_leaves_nothing_behind_and_a_failed_step_spares_cached_requests(tiny_dir):
    from omni_ray.engine.encoder_core import EncoderEngineCore
    from omni_ray.engine.output import StepError
    from omni_ray.tokenizer import PromptTokenizer

    tokenizer = PromptTokenizer(str(tiny_dir))
    refused = min(set(tokenizer.tokenize("zebra")) - set(tokenizer.tokenize("a cat a dog")))  # only zebra's
    core = EncoderEngineCore(tokenizer, FakeEncoder(refused), cache=PromptCache(1 << 20, "m", "t"))
    core.add_request(EncodeRequest("a", "a cat", "zebra"))
    (failed,) = core.step()  # its prompt went to the encoder, then its negative was refused: it fails alone
    assert failed.request_id == "a" and failed.finish_reason == "error" and "refused" in str(failed.error)
    assert not core.pending and not core.sequences and not core.running and not core.encoder.waiting
    core.add_request(EncodeRequest("b", "a cat"))  # the same text again: encoded, not left waiting on a ghost
    assert list(core.sequences) == ["b/prompt"] and not core.encoder.waiting  # it waits in the core for a step
    (done,) = core.step()
    assert done.request_id == "b" and not core.has_unfinished_requests()

    core.add_request(EncodeRequest("cached", "a cat"))
    core.add_request(EncodeRequest("new", "a dog"))
    core.encoder.fail_next = True
    with pytest.raises(StepError) as info:
        core.step()
    assert info.value.request_ids == ["new"]  # the cached request did not need the failed step
    core.abort_requests(info.value.request_ids)  # as the engine does with a failed step's requests
    assert [o.request_id for o in core.step()] == ["cached"]
