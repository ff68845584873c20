"""Per-key quotas through the ingress's routes, without a Ray cluster: the coordinator over fake stages with API keys
and limits. Over each limit a 429 in OpenAI's shape with Retry-After, under it nothing refused; a concurrent
request's hold ends with its response (JSON, stream, a client gone); two coordinators over one store share the
counts, as the app's replicas share its ledger actor."""

import asyncio
import io

import httpx
import pytest
from conftest import REPO
from PIL import Image

from deployments.http.api_keys import ApiKeys
from deployments.http.quotas import MemoryQuotas, Quotas
from deployments.http.routes import build_api
from omni_ray.config import load_config
from omni_ray.quotas import QuotaSettings
from testing import coordinator
from testing.fake_stages import FakeStages
from testing.openai_api import conforms

KEYS = ("sk-first", "sk-second")
BODY = {"prompt": "a cat", "size": "64x64", "num_inference_steps": 2}


@pytest.fixture(scope="module")
def config(tiny_dir):
    return load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir))


def keyed(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def quotas(text: str, store: MemoryQuotas | None = None) -> Quotas:
    return Quotas(QuotaSettings.parse(text, num_keys=len(KEYS)), store or MemoryQuotas())


def client(config, limits: str | Quotas, stages=None):
    limited = quotas(limits) if isinstance(limits, str) else limits
    return coordinator.client(config, stages, api_keys=ApiKeys(KEYS), quotas=limited)


def assert_refused(response, error_type: str, what: str, max_wait_s: int = 60) -> dict:
    assert response.status_code == 429, response.text
    body = response.json()
    conforms("ErrorResponse", body)
    error = body["error"]
    assert (error["type"], error["code"], error["param"]) == (error_type, "rate_limit_exceeded", None)
    assert what in error["message"] and "sk-" not in error["message"]
    assert 1 <= int(response.headers["Retry-After"]) <= max_wait_s
    return error


def test_requests_per_minute_per_key(config):
    http = client(config, "default: rpm=2; key1: rpm=3")
    for _ in range(2):
        assert http.post("/v1/images/generations", json=BODY, headers=keyed(KEYS[0])).status_code == 200
    refused = http.post("/v1/images/generations", json=BODY, headers=keyed(KEYS[0]))
    assert_refused(refused, "requests", "Rate limit reached for key0 on requests per minute (RPM): Limit 2, Used 2")
    for _ in range(3):  # key1's own limit, none of key0's use
        assert http.post("/v1/images/generations", json=BODY, headers=keyed(KEYS[1])).status_code == 200
    assert http.post("/v1/images/generations", json=BODY, headers=keyed(KEYS[1])).status_code == 429
    assert http.get("/v1/models", headers=keyed(KEYS[0])).status_code == 200  # only image requests are charged


def test_images_per_minute_counts_n_and_edits(config):
    http = client(config, "default: ipm=3")
    assert http.post("/v1/images/generations", json={**BODY, "n": 2}, headers=keyed(KEYS[0])).status_code == 200
    refused = http.post("/v1/images/generations", json={**BODY, "n": 2}, headers=keyed(KEYS[0]))
    assert_refused(refused, "requests", "images per minute (IPM): Limit 3, Used 2, Requested 2")
    edit = http.post("/v1/images/edits", data={"prompt": "a hat", "size": "64x64", "num_inference_steps": "2"},
                     files={"image": ("cat.png", png_bytes(), "image/png"),
                            "mask": ("mask.png", png_bytes(mask=True), "image/png")}, headers=keyed(KEYS[0]))
    assert edit.status_code == 200, edit.text  # the third image: a masked edit
    too_many = http.post("/v1/images/generations", json={**BODY, "n": 4}, headers=keyed(KEYS[1]))
    assert_refused(too_many, "requests", "Request too large for key1 on images per minute (IPM): Limit 3")


def test_dit_work_per_minute_is_a_tokens_limit(config):
    http = client(config, "default: work=1")  # reads a request's work from its refusal
    refused = assert_refused(http.post("/v1/images/generations", json=BODY, headers=keyed(KEYS[0])), "tokens",
                             "Request too large for key0 on DiT work tokens per minute (TPM): Limit 1, Used 0")
    one = int(refused["message"].split("Requested ")[1].split(".")[0])
    assert one % 2 == 0 and one // 2 > 16  # work tokens per step (16 image tokens and the prompt's) x 2 steps
    two = assert_refused(http.post("/v1/images/generations", json={**BODY, "n": 2}, headers=keyed(KEYS[0])),
                         "tokens", "TPM")
    assert f"Requested {2 * one}." in two["message"]
    http = client(config, f"default: work={2.5 * one}")
    for _ in range(2):
        assert http.post("/v1/images/generations", json=BODY, headers=keyed(KEYS[0])).status_code == 200
    refused = http.post("/v1/images/generations", json=BODY, headers=keyed(KEYS[0]))
    assert_refused(refused, "tokens", f"Limit {2.5 * one:g}, Used {2 * one}, Requested {one}")
    assert http.post("/v1/images/generations", json=BODY, headers=keyed(KEYS[1])).status_code == 200


class GatedStages(FakeStages):
    """Denoising waits for ``opened`` (set in the test's event loop)."""

    def __init__(self):
        super().__init__()
        self.opened = asyncio.Event()
        self.started = asyncio.Event()

    async def _run(self, call):
        if call.name == "denoise":
            self.started.set()
            await self.opened.wait()
        await super()._run(call)


def test_concurrent_requests_hold_until_their_response_ends_however_it_ends(config):
    async def scenario():
        stages = GatedStages()
        limited = quotas("default: concurrent=1")
        app = build_api(coordinator.coordinator(config, stages, api_keys=ApiKeys(KEYS), quotas=limited))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as http:
            async def post(key=KEYS[0], **extra):
                return await http.post("/v1/images/generations", json={**BODY, **extra}, headers=keyed(key))

            for extra in ({}, {"stream": True, "partial_images": 1}):  # a JSON request, then a stream
                running = asyncio.create_task(post(**extra))
                await stages.started.wait()
                refused = await post()
                assert_refused(refused, "requests", "concurrent requests: Limit 1, Used 1, Requested 1", 1)
                assert refused.headers["Retry-After"] == "1"
                other = asyncio.create_task(post(KEYS[1]))  # key1: the same default over its own use
                stages.opened.set()
                assert [(await running).status_code, (await other).status_code] == [200, 200]
                stages.opened.clear()
                stages.started.clear()
            for extra in ({}, {"stream": True}):  # the client goes away mid-request
                gone = asyncio.create_task(post(**extra))
                await stages.started.wait()
                assert (await post()).status_code == 429
                gone.cancel()
                await asyncio.gather(gone, return_exceptions=True)
                stages.started.clear()
            assert limited.running["key0"] == 0
            stages.opened.set()
            assert (await post()).status_code == 200
        assert limited.store.ledger.usage("key0")["concurrent"] == 0

    asyncio.run(scenario())


def test_under_the_limits_nothing_is_refused(config):
    http = client(config, "default: rpm=20, ipm=40, concurrent=2, work=1e9")
    for n, stream in ((1, False), (2, True), (3, False), (1, True)) * 2:
        response = http.post("/v1/images/generations", json={**BODY, "n": n, "stream": stream},
                             headers=keyed(KEYS[0]))
        assert response.status_code == 200


def test_two_coordinators_over_one_store_share_each_keys_counts(config):
    store = MemoryQuotas()
    replicas = [client(config, quotas("default: rpm=3", store)) for _ in range(2)]
    answers = [replicas[i % 2].post("/v1/images/generations", json=BODY, headers=keyed(KEYS[0])).status_code
               for i in range(6)]
    assert answers == [200, 200, 200, 429, 429, 429]
    assert replicas[1].post("/v1/images/generations", json=BODY, headers=keyed(KEYS[1])).status_code == 200


def test_an_open_server_has_no_quotas(config):
    http = coordinator.client(config, quotas=quotas("default: rpm=1"))  # limits, but no keys: nobody to charge
    for _ in range(3):
        assert http.post("/v1/images/generations", json=BODY).status_code == 200


def png_bytes(mask: bool = False) -> bytes:
    """An image, or an inpainting mask (OpenAI's: transparent where to repaint, here the left half)."""
    image = Image.new("RGBA" if mask else "RGB", (64, 64), (200, 30, 30, 255)[:4 if mask else 3])
    if mask:
        image.paste((0, 0, 0, 0), (0, 0, 32, 64))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


class ReservingStages(FakeStages):
    """Fake stages whose DiT admits every request (reserving it under its id) and records what is given up."""

    def __init__(self):
        super().__init__()
        self.reserved, self.released = [], []

    async def estimate(self, plan, request_id=None, budget_s=None):
        self.reserved.append(request_id)
        return 0.0

    def release(self, request_id):
        self.released.append(request_id)


def test_a_request_refused_by_its_quota_after_admission_gives_up_its_dit_reservation(config):
    stages = ReservingStages()
    http = client(config, "default: rpm=1", stages)
    assert http.post("/v1/images/generations", json=BODY, headers=keyed(KEYS[0])).status_code == 200
    assert stages.released == []  # it ran: its calls took the reservation up
    refused = http.post("/v1/images/generations", json=BODY, headers=keyed(KEYS[0]))
    assert_refused(refused, "requests", "Limit 1, Used 1")
    assert len(stages.reserved) == 2 and stages.released == [stages.reserved[1]]


def test_a_request_that_fails_gives_up_its_dit_reservation(config):
    """Admitted, then failed before its denoise calls took the reservation up: left, the reservation would count in
    the replica's estimates until the request's deadline (a served module's earlier failures once made its later
    requests 503 "the DiT would finish this request in about 593 s")."""
    stages = ReservingStages()
    http = client(config, "default: rpm=100", stages)
    assert http.post("/v1/images/generations", json=BODY, headers=keyed(KEYS[0])).status_code == 200
    assert stages.released == []
    stages.fail = {"denoise": RuntimeError("the DiT fell over")}
    assert http.post("/v1/images/generations", json=BODY, headers=keyed(KEYS[0])).status_code == 500
    assert len(stages.reserved) == 2 and stages.released == [stages.reserved[1]]
