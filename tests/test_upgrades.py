"""Upgrades under load (issue 41): the Serve config changes three times, through `serve deploy` as an operator (and
KubeRay's operator) applies it, while 16 requests at a time flow (a quarter streamed) and the page is read. Every
request is answered 200 and streams complete; requests admitted before a change finish on the replicas that took
them; later requests see the new settings.

What Ray Serve does with each change: (a) a deployment's `num_replicas` in the Serve config's `deployments` is
updated in place, the running replicas kept and one more started; (b) and (c) change the application's `args`
(`overrides` of the preset), which gives the app a new code version: Serve builds it again and replaces every
replica of every deployment, a few at a time, each old one draining its requests (`graceful_shutdown_timeout_s`)
before it stops.
"""

from __future__ import annotations

import copy
import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import pytest
import yaml
from conftest import REPO

from testing.local_serve import LocalServe
from testing.serving import stage_stats

pytestmark = pytest.mark.serve

CONCURRENCY = 16
STREAMED = CONCURRENCY // 4  # the first four workers stream
ADAPTER_WORKER = 7  # asks for the preset's adapter A, through every change
LONG_WORKER = 15  # asks for many steps: a denoise that runs while its DiT replica is told to stop
LONG_STEPS = 40
SIZE = "64x64"


@dataclass
class Answer:
    worker: int
    sent: float  # monotonic
    done: float
    status: int
    steps: int | None = None  # the denoising steps the request ran (None: unknown)
    streamed: bool = False
    error: str = ""


@dataclass
class Load:
    """Workers that each send one request after another until stopped; a reader of the page and the model list."""

    base: str
    answers: list[Answer] = field(default_factory=list)
    page_reads: list[tuple[float, int]] = field(default_factory=list)  # (when, status) of / and /v1/models
    health: list[tuple[float, int]] = field(default_factory=list)  # (when, status) of /health
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._work, args=(i,), daemon=True) for i in range(CONCURRENCY)]
        threads.append(threading.Thread(target=self._read_page, daemon=True))
        for thread in threads:
            thread.start()
        return threads

    def _work(self, worker: int) -> None:
        sent_count = 0
        while not self.stop.is_set():
            body = {"prompt": f"a lighthouse at dusk, worker {worker}, request {sent_count}", "size": SIZE,
                    "seed": 1000 * worker + sent_count}
            if worker == ADAPTER_WORKER:
                body["model"] = "A"
            elif worker == LONG_WORKER:
                body["num_inference_steps"] = LONG_STEPS
            sent = time.monotonic()
            answer = self._stream(worker, body) if worker < STREAMED else self._json(worker, body)
            answer.sent, answer.done = sent, time.monotonic()
            with self.lock:
                self.answers.append(answer)
            sent_count += 1

    def _json(self, worker: int, body: dict) -> Answer:
        status, reply = _post(self.base + "/v1/images/generations", {**body, "timings": True})
        if status != 200:
            return Answer(worker, 0, 0, status, error=json.dumps(reply)[:300])
        assert len(reply["data"]) == 1 and reply["data"][0]["b64_json"]
        return Answer(worker, 0, 0, status, steps=sum(reply["data"][0]["dit_passes"].values()))

    def _stream(self, worker: int, body: dict) -> Answer:
        request = urllib.request.Request(self.base + "/v1/images/generations",
                                         json.dumps({**body, "stream": True, "progress": True}).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                events = [json.loads(line[len(b"data: "):]) for line in response if line.startswith(b"data: ")]
        except urllib.error.HTTPError as err:
            return Answer(worker, 0, 0, err.code, streamed=True, error=err.read().decode()[:300])
        kinds = [event["type"] for event in events]
        progress = [event for event in events if event["type"] == "image_generation.progress"]
        totals = {event["total_steps"] for event in progress}
        # Complete: one event per step, all of them, then the image.
        if kinds[-1:] != ["image_generation.completed"] or not events[-1]["b64_json"] or totals != {len(progress)}:
            return Answer(worker, 0, 0, 200, streamed=True, error=f"stream incomplete: {kinds[-3:]} {totals}")
        return Answer(worker, 0, 0, 200, steps=len(progress), streamed=True)

    def _read_page(self) -> None:
        while not self.stop.wait(2.0):
            for path, reads in (("/", self.page_reads), ("/v1/models", self.page_reads), ("/health", self.health)):
                try:
                    with urllib.request.urlopen(self.base + path, timeout=120) as response:
                        response.read()
                        status = response.status
                except urllib.error.HTTPError as err:
                    status = err.code
                reads.append((time.monotonic(), status))

    def done_since(self, when: float) -> list[Answer]:
        with self.lock:
            return [a for a in self.answers if a.sent >= when]


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def _replicas(served: LocalServe) -> dict[str, set[str]]:
    """Each deployment's replica ids."""
    deployments = served.applications()["omni-ray"]["deployments"]
    return {name: {r["replica_id"] for r in d["replicas"]} for name, d in deployments.items()}


def _models(served: LocalServe) -> list[str]:
    with urllib.request.urlopen(served.base_url + "/v1/models", timeout=60) as response:
        return [model["id"] for model in json.loads(response.read())["data"]]


def _wait_for_answers(load: Load, since: float, count: int, timeout_s: float = 300) -> list[Answer]:
    deadline = time.monotonic() + timeout_s
    while len(answers := load.done_since(since)) < count:
        assert time.monotonic() < deadline, f"{len(answers)} of {count} requests answered"
        time.sleep(0.5)
    return answers


def test_three_config_changes_under_load_answer_every_request(tiny_dir, tiny_adapters):
    preset = yaml.safe_load((REPO / "stage_configs" / "qwen_image_tiny.yaml").read_text())
    preset["requests"]["default_steps"] = 6
    preset["requests"]["timeout_s"] = 300.0  # the drain waits as long for a replica's requests
    preset["loras"] = {"A": tiny_adapters["A"]}
    preset["dit"]["max_batch_tokens"] = 4096
    with LocalServe(REPO / "config.yaml", model=str(tiny_dir), preset=preset, dashboard=True) as served:
        config = copy.deepcopy(served.config)  # what the cluster runs (its port, model and preset filled in)
        app = config["applications"][0]
        first = _replicas(served)
        load = Load(served.base_url)
        threads = load.start()
        started = time.monotonic()
        try:
            _wait_for_answers(load, started, CONCURRENCY)  # warm
            assert stage_stats({"address": served.address})["DiT"]["max_batch_tokens"] == 4096
            changes = {}

            # (a) More DiT replicas: Serve scales the deployment in place.
            app["deployments"] = [{"name": "DiT", "num_replicas": 2}]
            changes["a"] = _apply(served, config)
            after_a = _replicas(served)
            assert len(after_a["DiT"]) == 2 and first["DiT"] < after_a["DiT"]  # the first replica kept
            assert all(after_a[name] == first[name] for name in ("Coordinator", "Encoder", "VAE"))

            # (b) An added adapter and a new default step count: new args, so every replica is replaced.
            app["args"]["overrides"] = {"loras": {"B": tiny_adapters["B"]}, "requests": {"default_steps": 3}}
            changes["b"] = _apply(served, config)
            after_b = _replicas(served)
            assert all(not after_b[name] & after_a[name] for name in after_a)  # none of the old replicas is left
            assert len(after_b["DiT"]) == 2  # the Serve config's count holds across the rebuild
            assert _models(served) == ["qwen-image-tiny", "A", "B"]
            status, reply = _post(served.base_url + "/v1/images/generations",
                                  {"prompt": "a red cat", "size": SIZE, "model": "B", "timings": True})
            assert status == 200 and sum(reply["data"][0]["dit_passes"].values()) == 3, reply

            # (c) A smaller DiT token budget.
            app["args"]["overrides"]["dit"] = {"max_batch_tokens": 2048}
            changes["c"] = _apply(served, config)
            assert len(_replicas(served)["DiT"]) == 2
            assert stage_stats({"address": served.address})["DiT"]["max_batch_tokens"] == 2048

            tail = time.monotonic()
            _wait_for_answers(load, tail, CONCURRENCY)  # as many again on the last settings
        finally:
            load.stop.set()
            for thread in threads:
                thread.join(timeout=600)
        ended = time.monotonic()

    answers = load.answers
    failed = [a for a in answers if a.status != 200 or a.error]
    in_flight = {name: [a for a in answers if a.sent < sent < a.done] for name, (sent, _) in changes.items()}
    seconds = [a.done - a.sent for a in answers if a.worker != LONG_WORKER]
    during = [a.done - a.sent for a in answers if a.worker != LONG_WORKER
              and any(sent < a.done and a.sent < running for sent, running in changes.values())]
    print(f"\n{len(answers)} requests ({sum(a.streamed for a in answers)} streamed), {len(load.page_reads)} page "
          f"reads in {ended - started:.0f} s; failed: {len(failed)}; changes applied in "
          + ", ".join(f"({name}) {running - sent:.0f} s" for name, (sent, running) in changes.items())
          + "; requests in flight as each went out: " + ", ".join(f"({n}) {len(a)}" for n, a in in_flight.items())
          + f"; latency median {sorted(seconds)[len(seconds) // 2]:.1f} s, longest {max(seconds):.1f} s (while a "
          f"change ran: {max(during, default=0):.1f} s); /health not 200 {sum(s != 200 for _, s in load.health)} "
          f"of {len(load.health)} reads")
    assert not failed, failed[:5]
    assert not any(thread.is_alive() for thread in threads)  # none lost: every worker's last request came back
    assert {status for _, status in load.page_reads} == {200}
    assert any(changes["a"][0] <= when <= changes["c"][1] for when, _ in load.page_reads)  # the page during them
    # Requests admitted before a change went out finished (on the replicas that took them: a replaced replica
    # drains), answered 200 as every other.
    assert in_flight["b"] and in_flight["c"]
    assert any(a.worker == LONG_WORKER for a in in_flight["b"] + in_flight["c"])  # a long denoise among them
    assert any(a.streamed for a in in_flight["b"] + in_flight["c"])
    # The default steps: 6 for every request sent before (b) went out, 3 for every one sent after it ran.
    plain = [a for a in answers if a.worker not in (ADAPTER_WORKER, LONG_WORKER)]
    assert {a.steps for a in plain if a.sent < changes["b"][0]} == {6}
    assert {a.steps for a in plain if a.sent > changes["b"][1]} == {3}
    assert {a.steps for a in answers if a.worker == LONG_WORKER} == {LONG_STEPS}


def _apply(served: LocalServe, config: dict) -> tuple[float, float]:
    """`serve deploy` of ``config``; returns when it was sent and when the app ran on it again (monotonic)."""
    sent = time.monotonic()
    served.deploy(config)
    served.wait_running()
    return sent, time.monotonic()
