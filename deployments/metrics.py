"""omni-ray's Prometheus metrics, through Ray Serve's metrics API (Ray exports them with its `ray_` prefix).

Every stage metric carries a `stage` label (encoder, dit, vae, coordinator). Ray 2.60 exports each sample with its
process's `WorkerId` and `NodeAddress`, not with Serve's deployment and replica tags: tell replicas apart by WorkerId.
"""

from __future__ import annotations

from ray.serve import metrics

LATENCY_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]

queue_length = metrics.Gauge(
    "omni_queue_length", description="Requests a stage engine holds (waiting or running) after its last step.",
    tag_keys=("stage",),
)
running_batch_size = metrics.Gauge(
    "omni_running_batch_size", description="Requests the stage engine's last step advanced or finished; 0 once it "
    "has not stepped for a second.",
    tag_keys=("stage",),
)
step_latency = metrics.Histogram(
    "omni_step_latency_seconds", description="Duration of one engine step.", boundaries=LATENCY_BOUNDARIES,
    tag_keys=("stage",),
)
stage_request_latency = metrics.Histogram(
    "omni_stage_request_latency_seconds", description="Time a request spends in one stage, queueing included.",
    boundaries=LATENCY_BOUNDARIES, tag_keys=("stage",),
)
request_latency = metrics.Histogram(
    "omni_request_latency_seconds", description="End-to-end latency of an images request at the coordinator.",
    boundaries=LATENCY_BOUNDARIES, tag_keys=("stage",),
)
images_generated = metrics.Counter(
    "omni_images_generated_total", description="Images returned to callers.", tag_keys=("stage",),
)
errors = metrics.Counter(
    "omni_errors_total", description="Failed requests, by stage and error type.", tag_keys=("stage", "type"),
)
dit_passes = metrics.Counter(
    "omni_dit_passes_total",
    description="Transformer passes of finished DiT requests, by outcome: computed, or reused by cache acceleration "
    "(true CFG runs two passes per step).",
    tag_keys=("stage", "outcome"),
)
STALL_BOUNDARIES = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5]
event_loop_stall = metrics.Histogram(
    "omni_event_loop_stall_seconds",
    description="How late the coordinator's event loop woke a 50 ms sleeper, less the time its thread waited for a "
    "CPU: how long something ran on the loop or held the GIL.",
    boundaries=STALL_BOUNDARIES, tag_keys=("stage",),
)
event_loop_cpu_wait = metrics.Histogram(
    "omni_event_loop_cpu_wait_seconds",
    description="The rest of that lateness: the time the loop's thread was ready to run and waited for a CPU held by "
    "other threads or processes (a busy machine, not the loop).",
    boundaries=STALL_BOUNDARIES, tag_keys=("stage",),
)
process_cpu = metrics.Counter(
    "omni_process_cpu_seconds_total", description="CPU time of the replica's process, all its threads.",
    tag_keys=("stage",),
)
lora_loads = metrics.Counter(
    "omni_lora_loads_total",
    description="LoRA adapters a DiT replica put on its device: on first use, or again after it evicted them.",
    tag_keys=("stage", "adapter"),
)
queued_work = metrics.Gauge(
    "omni_dit_queued_work_seconds",
    description="Cost-seconds of the requests a DiT replica holds, queued and running: their remaining steps at the "
    "replica's measured step times (what its routing and autoscaling read).",
    tag_keys=("stage",),
)
paused_requests = metrics.Gauge(
    "omni_dit_paused_requests", description="Admitted DiT requests the last step paused for more urgent ones.",
    tag_keys=("stage",),
)
condition_cache_bytes = metrics.Gauge(
    "omni_dit_condition_cache_bytes",
    description="Qwen-Image 2.1: bytes of the condition caches (text and condition-image keys and values, per CFG "
    "branch) the DiT's admitted requests hold.",
    tag_keys=("stage",),
)
condition_cache_budget_bytes = metrics.Gauge(
    "omni_dit_condition_cache_budget_bytes",
    description="Qwen-Image 2.1: the bytes the DiT's condition caches may take together (dit.cache_memory_bytes); "
    "set only when bounded.",
    tag_keys=("stage",),
)
condition_cache_waiting = metrics.Gauge(
    "omni_dit_condition_cache_waiting_requests",
    description="Qwen-Image 2.1: requests the DiT's last step left in its queue because their condition cache did "
    "not fit the room left.",
    tag_keys=("stage",),
)
finish_estimate = metrics.Histogram(
    "omni_finish_estimate_seconds",
    description="The coordinator's estimate, as each request arrives, of the seconds the DiT would take to finish it "
    "(requests past their deadline by it are refused with a 503).",
    boundaries=LATENCY_BOUNDARIES, tag_keys=("stage",),
)
prompt_cache = metrics.Counter(
    "omni_encoder_prompt_cache_total",
    description="Texts the encoder looked up in its prompt-embedding cache, by outcome: hit (not encoded again) or "
    "miss (encoded, or waiting for the identical text being encoded).",
    tag_keys=("stage", "outcome"),
)
prompt_cache_bytes = metrics.Gauge(
    "omni_encoder_prompt_cache_bytes", description="Bytes of prompt embeddings the encoder's cache holds.",
    tag_keys=("stage",),
)
# Per-key quotas (deployments.http.quotas), tagged with the API key's name (key0, key1; never the key).
quota_requests = metrics.Counter(
    "omni_quota_requests_total", description="Requests a key's quotas admitted.", tag_keys=("stage", "key"),
)
quota_images = metrics.Counter(
    "omni_quota_images_total", description="Images (n, times a Layered request's layers) of admitted requests, per "
    "key.", tag_keys=("stage", "key"),
)
quota_work = metrics.Counter(
    "omni_quota_work_tokens_total", description="DiT token-steps (work tokens per step x steps x n) of admitted "
    "requests, per key.", tag_keys=("stage", "key"),
)
quota_refusals = metrics.Counter(
    "omni_quota_refusals_total", description="Requests refused with a 429, per key and the limit they would pass "
    "(rpm, ipm, concurrent, work).", tag_keys=("stage", "key", "limit"),
)
quota_running = metrics.Gauge(
    "omni_quota_running_requests", description="A coordinator replica's admitted requests of a key still running "
    "(sum over replicas: the key's concurrent requests).", tag_keys=("stage", "key"),
)
user_config_refusals = metrics.Counter(
    "omni_user_config_refusals_total", description="user_config changes a deployment refused (logged with the "
    "reason; the replica kept its settings).", tag_keys=("stage",),
)
quota_store_errors = metrics.Counter(
    "omni_quota_store_errors_total", description="Quota checks the counter store did not answer in time: the "
    "request was admitted unchecked (quotas fail open).", tag_keys=("stage",),
)
