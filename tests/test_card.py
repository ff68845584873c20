"""Stages taking turns on one card (``card``, issue 50 item 4), without a cluster: turns granted one at a time in the
order asked; the tiny checkpoint run in process with its three stages on one "card" (the CPU here), 16 requests at a
time, each image the same as without turns (within a level: a turn changes when a stage computes, and so which
requests share a step batch, which may reorder float32 sums, never what it computes), no two
turns at once, the encoder's weights off the device between its turns and back for each, every stage's holdings
counted; the placement check of a one-card preset with the encoder taking turns; what a card refuses; and the Serve
app's card actor's class ending a dead holder's turn. The actor itself is served in tests/test_serve_one_card.py."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from conftest import REPO, encode_all

from omni_ray.config import ConfigError, load_config
from omni_ray.engine.card import LocalCard
from omni_ray.pipeline import Pipeline
from testing.numerics import assert_within_a_level

ON_CARD = {"card": {"stages": ["encoder", "dit", "vae"]}, "encoder": {"runner": "transformers"}}


def test_turns_are_granted_one_at_a_time_in_the_order_asked():
    card, order, inside = LocalCard(), [], []

    def stage(name: str, turns: int) -> None:
        for _ in range(turns):
            card.take(name)
            inside.append(name)
            assert len(inside) == 1, inside
            order.append(name)
            time.sleep(0.001)
            inside.remove(name)
            card.give(name, 100, 10)

    threads = [threading.Thread(target=stage, args=(name, 20)) for name in ("encoder", "dit", "vae")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stats = card.stats()
    assert len(order) == 60 and stats.turns == {"encoder": 20, "dit": 20, "vae": 20} and stats.overlaps == 0
    assert stats.peak_bytes == 100 + 2 * 10  # a turn's 100 beside the other two's 10 each

    # first come, first served: the holder asking again waits behind the two that asked while it held the turn
    card, order = LocalCard(), []
    card.take("dit")
    waiting = []
    for name in ("encoder", "vae"):
        thread = threading.Thread(target=lambda n=name: (card.take(n), order.append(n), card.give(n, 0, 0)))
        thread.start()
        waiting.append(thread)
        time.sleep(0.05)  # asked in this order
    again = threading.Thread(target=lambda: (card.take("dit"), order.append("dit"), card.give("dit", 0, 0)))
    again.start()
    time.sleep(0.05)
    card.give("dit", 0, 0)
    for thread in [*waiting, again]:
        thread.join()
    assert order == ["encoder", "vae", "dit"]


def _images(pipeline: Pipeline, bodies: list[dict]) -> list[np.ndarray]:
    async def run_all():
        return await asyncio.gather(*(pipeline.generate(body) for body in bodies))

    return [decoded.pixels for results in asyncio.run(run_all()) for decoded in results]


BODIES = [{"prompt": f"a cat number {i % 5}", "size": ("64x64", "96x64")[i % 2], "num_inference_steps": 3, "seed": i,
           **({"negative_prompt": "blurry", "true_cfg_scale": 4.0} if i % 3 == 0 else {})} for i in range(16)]


@pytest.fixture(scope="module")
def alone(tiny_dir) -> list[np.ndarray]:
    config = load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir),
                         overrides={"encoder": {"runner": "transformers"}})
    pipeline = Pipeline(config)
    try:
        return _images(pipeline, BODIES)
    finally:
        pipeline.stages.shutdown()


def test_stages_taking_turns_make_the_same_images_and_never_meet(tiny_dir, alone):
    config = load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir), overrides=ON_CARD)
    pipeline = Pipeline(config)
    try:
        images = _images(pipeline, BODIES)
        encoder_weights = pipeline.stages.encoder.stats  # the engine's latest snapshot: read below through the card
        stats = pipeline.stages.card.stats()
        parked = pipeline.stages.encoder.core.weights
        moves = pipeline.stages.encoder.core.weights.moves
    finally:
        pipeline.stages.shutdown()
    assert encoder_weights.requests == 16
    for got, expected in zip(images, alone):  # step batches form otherwise when stages wait for turns
        assert_within_a_level(got, expected)
    assert stats.overlaps == 0
    assert stats.turns["dit"] >= 3 and stats.turns["vae"] >= 2 and stats.turns["encoder"] >= 1, stats.turns
    assert parked.away  # off the device since its last turn
    weights = sum(host.numel() * host.element_size() for _, _, host in parked.host)
    assert weights > 0 and stats.held_bytes["encoder"] == 0  # its weights left the device after its last turn
    assert stats.turn_peak_bytes["encoder"] == weights  # and were all there for its turns
    assert moves == stats.turns["encoder"] - 1  # brought in for each (its first turn was its start)
    assert stats.held_bytes["dit"] > 0 and stats.held_bytes["vae"] > 0  # theirs stay
    assert stats.peak_bytes <= stats.held_bytes["dit"] + stats.held_bytes["vae"] + weights
    assert stats.peak_bytes >= stats.held_bytes["dit"] + stats.held_bytes["vae"]


def test_a_card_refuses_what_cannot_take_turns(tiny_dir):
    preset = REPO / "stage_configs/qwen_image_tiny.yaml"
    with pytest.raises(ConfigError, match=r"card.stages: dit takes turns on one card: dit.deployment.num_replicas"):
        load_config(preset, model=str(tiny_dir),
                    overrides={**ON_CARD, "dit": {"deployment": {"num_replicas": 2}}})
    with pytest.raises(ConfigError, match="names a stage twice"):
        load_config(preset, model=str(tiny_dir), overrides={"card": {"stages": ["dit", "dit"]}})
    with pytest.raises(ConfigError, match="dit.parallel spreads the dit over several GPUs"):
        load_config(preset, model=str(tiny_dir),
                    overrides={"card": {"stages": ["dit", "vae"]}, "dit": {"parallel": {"ulysses": 2}}})


@pytest.mark.vllm
def test_vllm_s_encoder_takes_turns_its_weights_leaving_between_them(tiny_dir):
    """vLLM's engine (eager) with its model's weights parked on the host between turns and brought back for each:
    the embeddings are diffusers' encode_prompt's, as without turns (tests/test_encoder_engine.py). On this CPU vLLM's
    linear layers compute from oneDNN-packed copies made at load, which stay: what moves here is every parameter and
    buffer of its modules (on a GPU, the weights themselves)."""
    from diffusers import QwenImagePipeline

    from omni_ray.engine.builders import build_encoder_core
    from omni_ray.records import EncodeRequest

    config = load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir),
                         overrides={"card": {"stages": ["encoder", "dit", "vae"]}})
    card = LocalCard()
    core = build_encoder_core(config, card)
    try:
        requests = [EncodeRequest(f"e{i}", prompt, "blurry" if i % 2 else None)
                    for i, prompt in enumerate(["a red cat", "a lighthouse on a cliff at sunset", "night"])]
        results, steps = encode_all(core, requests)
        parked, moves = core.weights.away, core.weights.moves
    finally:
        core.shutdown()
    reference = QwenImagePipeline.from_pretrained(tiny_dir)
    for request in requests:
        expected, _ = reference.encode_prompt(request.prompt, device="cpu")
        assert (results[request.request_id].prompt.embeds - expected[0]).abs().max().item() < 1e-4
    stats = card.stats()
    assert parked and moves == stats.turns["encoder"] - 1 and 1 <= moves <= steps, (moves, stats.turns)
    assert stats.held_bytes["encoder"] == 0 and stats.turn_peak_bytes["encoder"] > 0


def test_the_placement_check_counts_residents_and_the_largest_turn():
    """The 24 GB card preset with a bf16 vLLM encoder (not its AWQ one) taking turns: its 16.2 GiB turn (weights
    and work) fits beside the DiT only with most of its blocks streamed; 10 kept pass (23.9 GiB), 11 do not."""
    from omni_ray.placement import card_need_gib, stage_memory

    encoder = {"runner": "model", "device": "cuda", "dtype": "bfloat16", "gpu_memory_utilization": 0.5,
               "quantization": "none", "weights_dir": None, "deployment": {"num_gpus": 0.5}}

    def preset(kept: int, **encoder_fields):
        return {"card": {"stages": ["encoder", "dit", "vae"]}, "encoder": {**encoder, **encoder_fields},
                "dit": {"offload": {"blocks_on_gpu": kept}, "deployment": {"num_gpus": 0.3}},
                "vae": {"deployment": {"num_gpus": 0.2}}}

    path = REPO / "stage_configs/qwen_image_24gb_card.yaml"
    config = load_config(path, overrides=preset(10))
    estimates = stage_memory(config, 24)
    need, largest = card_need_gib(estimates)
    assert (need, largest.stage, largest.turn_gib) == (23.9, "encoder", 16.2)
    assert {e.stage: round(e.need_gib - e.turn_gib, 1) for e in estimates} == {"encoder": 1.2, "dit": 5.3, "vae": 1.2}
    with pytest.raises(ConfigError, match=r"card.stages: the stages sharing the card need about 24.1 GiB, more than "
                                          r"the 24.0 GiB card \(gpu_memory_gib\): they hold encoder 1.2, dit 5.5, "
                                          r"vae 1.2 GiB"):
        load_config(path, overrides=preset(11))
    with pytest.raises(ConfigError, match=r"encoder.gpu_memory_utilization: vLLM starts only with 0.8 of the card "
                                          r"\(19.2 GiB\) free, but the stages sharing it hold about 6.5 GiB"):
        load_config(path, overrides=preset(10, gpu_memory_utilization=0.8, deployment={"num_gpus": 0.8}))


class _Replica:
    """A stage replica as the card's actor sees it: ``__ray_ready__.remote()`` answers, hangs, or raises as a dead
    actor's does."""

    def __init__(self, state: str = "alive"):
        self.state = state
        self.__ray_ready__ = self
        self.asked = 0

    def remote(self):
        import ray.exceptions

        async def ready():
            self.asked += 1
            if self.state == "dead":
                raise ray.exceptions.ActorDiedError()
            if self.state == "hung":
                await asyncio.sleep(3600)

        return ready()


def test_the_card_s_actor_ends_the_turn_of_a_dead_holder_and_only_a_dead_one(monkeypatch):
    """A replica that dies holding the turn would stall the card: the actor (``deployments/card.py``, here its class
    without Ray) asks the holder whether it lives once a turn has been asked for ``HOLDER_CHECK_S``."""
    from deployments import card

    monkeypatch.setattr(card, "HOLDER_CHECK_S", 0.05)
    monkeypatch.setattr(card, "PING_TIMEOUT_S", 0.05)
    replicas = {"encoder": _Replica(), "dit": _Replica(), "vae": _Replica()}

    async def scenario():
        turns = card.CardTurns()
        for stage, replica in replicas.items():
            await turns.register(stage, replica)
        # Alive, and then slow to answer: its turn goes on however long the DiT asks.
        await turns.take("vae")
        asking = asyncio.ensure_future(turns.take("dit"))
        await asyncio.sleep(0.3)
        replicas["vae"].state = "hung"
        await asyncio.sleep(0.3)
        assert not asking.done() and replicas["vae"].asked >= 4 and turns.ledger.holder == "vae"
        await turns.give("vae", 100, 10)
        await asyncio.wait_for(asking, 1)
        assert turns.ledger.holder == "dit"
        # Dead while holding the turn: the next stage asking has it within a check, the dead one holds nothing.
        replicas["dit"].state = "dead"
        started = time.monotonic()
        await asyncio.wait_for(turns.take("encoder"), 2)
        assert turns.ledger.holder == "encoder" and time.monotonic() - started >= card.HOLDER_CHECK_S
        assert turns.ledger.stats.held_bytes.get("dit", 0) == 0
        # A replacement registering while its predecessor holds the turn ends that turn too.
        await turns.register("encoder", _Replica())
        assert turns.ledger.holder is None
        await asyncio.wait_for(turns.take("vae"), 1)

    asyncio.run(scenario())
