"""Every queue a request waits in takes work by priority, then tenant share, then arrival, as the DiT's does: the
encoder's core (over a fake encoder and captioner), the VAE's scheduler, and the coordinator's slots for uploads and
image files. No model: the order is the subject."""

import asyncio
import time

import numpy as np
import torch

from omni_ray.engine.encoder_core import EncoderEngineCore
from omni_ray.engine.fair_share import FairShare
from omni_ray.engine.prompt_cache import PromptCache
from omni_ray.engine.vae_scheduler import VaeScheduler
from omni_ray.families.qwen_image.facts import PromptTemplate
from omni_ray.records import (
    CaptionRequest,
    Decoded,
    DecodeRequest,
    EncodeRequest,
    ImageEncodeRequest,
    Latents,
    VaeOutput,
)

SQUARE, WIDE = (64, 64), (64, 96)


class FakeTokenizer:
    """One token per character, no template: the texts' order, not their embeddings, is the subject."""

    template = PromptTemplate("{}", drop=0, truncates=False)

    def tokenize(self, text, num_images=0):
        return [ord(c) for c in text]

    def image_slots(self, token_ids, image_sizes=()):
        return None


class FakeCaptionTokenizer:
    def tokenize(self, language):
        return [1, 2, 3]

    def decode(self, token_ids):
        return "a caption"


class FakeEncoder:
    """A SequenceEncoder that runs every sequence it holds for ``steps`` steps, records what it was handed in order,
    and checks it never holds more than ``max_num_seqs`` (vLLM's bound)."""

    def __init__(self, max_num_seqs, steps=1):
        self.max_num_seqs, self.steps = max_num_seqs, steps
        self.added: list[str] = []
        self.running: dict[str, int] = {}  # sequence id -> steps left

    def add(self, sequence_id, token_ids, images=()):
        assert len(self.running) < self.max_num_seqs, "handed more than vLLM runs at once"
        self.added.append(sequence_id)
        self.running[sequence_id] = self.steps

    def abort(self, sequence_ids):
        for sequence_id in sequence_ids:
            self.running.pop(sequence_id, None)

    def step(self):
        self.running = {sequence_id: left - 1 for sequence_id, left in self.running.items()}
        done = [sequence_id for sequence_id, left in self.running.items() if left == 0]
        for sequence_id in done:
            del self.running[sequence_id]
        return {sequence_id: torch.ones(4, 8) for sequence_id in done}

    def shutdown(self):
        pass


class FakeCaptioner(FakeEncoder):
    def add(self, sequence_id, token_ids, image):
        super().add(sequence_id, token_ids)

    def step(self):
        return {sequence_id: [7, 8] for sequence_id in super().step()}


def encoder_core(max_num_seqs, steps=1, cache=False):
    return EncoderEngineCore(FakeTokenizer(), FakeEncoder(max_num_seqs, steps), max_num_seqs=max_num_seqs,
                             cache=PromptCache(1 << 20, "m", "t") if cache else None,
                             captioner=FakeCaptioner(max_num_seqs, steps), caption_tokenizer=FakeCaptionTokenizer())


def finished(core):
    """Request ids that finished in one step, in order."""
    return [output.request_id for output in core.step() if output.finished]


def test_a_light_tenant_s_texts_take_the_next_free_seats_behind_a_heavy_tenant_s_flood():
    core = encoder_core(max_num_seqs=4)
    for i in range(20):
        core.add_request(EncodeRequest(f"heavy{i:02}", f"a heavy prompt {i:02}", tenant="heavy"))
    core.add_request(EncodeRequest("light0", "a light prompt 00", tenant="light"))
    core.add_request(EncodeRequest("light1", "a light prompt 01", tenant="light"))
    # First come first served would run them in the sixth step; turns by tenant share put them in the first.
    assert sorted(finished(core)) == ["heavy00", "heavy01", "light0", "light1"]
    assert core.encoder.added == ["heavy00/prompt", "light0/prompt", "heavy01/prompt", "light1/prompt"]  # the rest
    # wait in the core, not in vLLM
    assert finished(core) == ["heavy02", "heavy03", "heavy04", "heavy05"]
    # A later arrival of the light tenant goes first: the heavy one has used the encoder more lately.
    core.add_request(EncodeRequest("light2", "a light prompt 02", tenant="light"))
    assert "light2" in finished(core) and core.encoder.added[8] == "light2/prompt"
    while core.has_unfinished_requests():
        core.step()
    assert len(core.encoder.added) == 23 and not core.sequences


def test_an_urgent_text_runs_next_waiting_behind_only_the_sequences_already_in_flight():
    core = encoder_core(max_num_seqs=2)
    for i in range(10):
        core.add_request(EncodeRequest(f"bulk{i}", f"bulk prompt {i}", priority=0))
    core.add_request(EncodeRequest("urgent", "an urgent prompt", priority=-1))
    assert finished(core) == ["bulk0", "urgent"]  # arrived behind ten, handed over with the first free seat

    slow = encoder_core(max_num_seqs=2, steps=2)  # each sequence in flight for two steps
    for i in range(10):
        slow.add_request(EncodeRequest(f"bulk{i}", f"bulk prompt {i}"))
    assert finished(slow) == []  # bulk0 and bulk1 in flight
    slow.add_request(EncodeRequest("urgent", "an urgent prompt", priority=-1))
    assert finished(slow) == ["bulk0", "bulk1"]
    assert slow.encoder.added == ["bulk0/prompt", "bulk1/prompt"]  # no seat was free: it waited in the core
    slow.step()
    assert slow.encoder.added[2] == "urgent/prompt"  # the first seat that freed, before the eight bulk texts


def test_a_more_urgent_request_for_a_waiting_text_lifts_it_and_both_share_one_sequence():
    core = encoder_core(max_num_seqs=1, cache=True)
    for i in range(3):
        core.add_request(EncodeRequest(f"bulk{i}", f"bulk prompt {i}"))
    core.add_request(EncodeRequest("late", "a lighthouse"))
    core.add_request(EncodeRequest("urgent", "a lighthouse", priority=-1))  # the same text, waiting
    assert len(core.sequences) == 4
    assert finished(core) == ["late", "urgent"] and core.encoder.added == ["late/prompt"]
    core.add_request(EncodeRequest("cached", "a lighthouse"))
    assert "cached" in finished(core)  # from the prompt cache, not queued behind the bulk texts
    assert core.num_encoded == 2


def test_a_waiting_request_aborted_never_reaches_the_encoder():
    core = encoder_core(max_num_seqs=1)
    core.add_request(EncodeRequest("first", "first"))
    core.add_request(EncodeRequest("gone", "gone", "blurry"))
    core.abort_requests(["gone"])
    assert finished(core) == ["first"] and core.step() == []
    assert core.encoder.added == ["first/prompt"] and not core.has_unfinished_requests()


def test_captions_are_handed_to_their_own_engine_by_priority_and_tenant_share():
    core = encoder_core(max_num_seqs=1)
    image = np.zeros((64, 64, 4), np.uint8)
    for i in range(3):
        core.add_request(CaptionRequest(f"bulk{i}", image + i, tenant="heavy"))
    core.add_request(CaptionRequest("light", image + 10, tenant="light"))
    core.add_request(CaptionRequest("urgent", image + 20, priority=-1, tenant="heavy"))
    core.add_request(EncodeRequest("text", "a text"))  # the pooling engine's seat is its own
    order = []
    while core.has_unfinished_requests():
        order += finished(core)
    # The urgent caption first, beside the text; then the light tenant's, served less lately than the heavy one.
    assert order == ["text", "urgent", "light", "bulk0", "bulk1", "bulk2"]


def decode(request_id, size=SQUARE, priority=0, tenant="", preview=False):
    return DecodeRequest(request_id, Latents(torch.zeros(1), *size), preview=preview, priority=priority,
                         tenant=tenant)


def batches(scheduler, limit=100):
    out = []
    while scheduler.has_requests() and len(out) < limit:
        batch = scheduler.schedule()
        out.append(batch.request_ids)
        scheduler.update_from_output(batch, VaeOutput(finished={r: Decoded(None, None) for r in batch.request_ids}))
    return out


def test_the_vae_batches_the_most_urgent_request_s_key_first():
    scheduler = VaeScheduler(max_batch_size=2)
    for i in range(4):
        scheduler.add_request(decode(f"bulk{i}"))
    scheduler.add_request(decode("urgent", WIDE, priority=-1))
    scheduler.add_request(decode("urgent-square", priority=-1))
    scheduler.add_request(ImageEncodeRequest("edit", np.zeros((*WIDE, 3), np.uint8), priority=-2))
    assert batches(scheduler) == [["edit"], ["urgent"], ["urgent-square", "bulk0"], ["bulk1", "bulk2"], ["bulk3"]]


def test_the_vae_shares_its_batches_between_tenants():
    scheduler = VaeScheduler(max_batch_size=2)
    for i in range(6):
        scheduler.add_request(decode(f"heavy{i}", tenant="heavy"))
    scheduler.add_request(decode("light0", tenant="light"))
    scheduler.add_request(decode("light1", tenant="light"))
    assert batches(scheduler, 2) == [["heavy0", "light0"], ["heavy1", "light1"]]
    assert batches(scheduler, 1) == [["heavy2", "heavy3"]]
    scheduler.add_request(decode("light2", tenant="light"))
    scheduler.add_request(decode("light3", tenant="light"))
    assert batches(scheduler) == [["light2", "light3"], ["heavy4", "heavy5"]]  # the heavy tenant used it lately


def test_an_urgent_preview_still_waits_for_final_images():
    scheduler = VaeScheduler(max_batch_size=4)
    scheduler.add_request(decode("preview", priority=-1, preview=True))
    scheduler.add_request(decode("final", WIDE, priority=1))
    assert batches(scheduler) == [["final"], ["preview"]]


def test_fair_share_forgets_use_below_one_unit_and_tenants_without_work():
    shares = FairShare(halflife_steps=1)

    class Work:
        def __init__(self, priority, tenant):
            self.priority, self.tenant = priority, tenant

    a, b = Work(0, "a"), Work(0, "b")
    shares.charge([a], lambda work: 4)
    assert shares.in_turn([a, b], lambda work: 1) == [b, a]
    for _ in range(3):
        shares.charge([], lambda work: 1)  # halved each step: 4, 2, 1, then forgotten
    assert shares.usage == {} and shares.in_turn([a, b], lambda work: 1) == [b, a]  # b served longest ago (never)
    shares.forget({"b"})
    assert shares.served == {}


def test_the_coordinator_s_slots_go_to_the_most_urgent_waiter_then_the_oldest():
    from deployments.priority_slots import PrioritySlots

    async def main():
        slots = PrioritySlots(1)
        order = []

        async def job(name, priority):
            async with slots.take(priority):
                order.append(name)
                await asyncio.sleep(0.01)

        first = asyncio.create_task(job("first", 1))
        await asyncio.sleep(0)  # it holds the one slot
        bulk = [asyncio.create_task(job(f"bulk{i}", 1)) for i in range(3)]
        await asyncio.sleep(0)
        urgent = asyncio.create_task(job("urgent", 0))
        await asyncio.gather(first, *bulk, urgent)
        return order, slots

    order, slots = asyncio.run(main())
    assert order == ["first", "urgent", "bulk0", "bulk1", "bulk2"] and slots.free == 1


def test_the_coordinator_writes_an_urgent_request_s_image_before_queued_bulk_ones(monkeypatch):
    from deployments import coordinator as module
    from deployments.priority_slots import PrioritySlots
    from omni_ray.api.schema import parse_request

    written = []

    def write(pixels, output_format, compression, alpha):
        written.append(int(pixels[0, 0, 0]))
        time.sleep(0.01)  # a PNG of a large image: the thread is busy
        return b"png"

    monkeypatch.setattr(module, "write_image_file", write)
    plain = object.__new__(module._PlainCoordinator)
    plain.write_slots = PrioritySlots(1)
    bulk, urgent = (parse_request({"prompt": "a cat", "priority": priority}) for priority in (1, 0))

    async def main():
        writes = [asyncio.create_task(plain._write(np.full((1, 1, 3), i, np.uint8), bulk)) for i in range(4)]
        await asyncio.sleep(0)  # the first holds the slot, three wait
        writes.append(asyncio.create_task(plain._write(np.full((1, 1, 3), 9, np.uint8), urgent)))
        return await asyncio.gather(*writes)

    assert asyncio.run(main()) == [b"png"] * 5
    assert written == [0, 9, 1, 2, 3]
