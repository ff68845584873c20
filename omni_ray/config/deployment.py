"""How Ray Serve places a stage's replicas (``deployment``: replicas, CPUs, GPUs, autoscaling) and what every stage
config shares."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from omni_ray.config.base import Dtype, Frozen, PositiveInt


class AutoscalingConfig(Frozen):
    """Ray Serve autoscaling bounds for one stage."""

    min_replicas: int = Field(1, ge=0, description="Fewest replicas the stage scales down to.")
    max_replicas: PositiveInt = Field(1, description="Most replicas the stage scales up to.")
    target_ongoing_requests: float = Field(
        2.0, gt=0, description="Ongoing requests per replica that Serve aims for when it scales."
    )
    target_queued_work_s: float | None = Field(
        None, gt=0, description="DiT only: scale on the work the replicas hold instead, in cost-seconds (their "
        "requests' remaining steps at their measured step times; deployments/autoscaling.py): as many replicas "
        "as that work over this.",
    )
    look_back_period_s: float = Field(30.0, gt=0, description="Seconds of the replicas' reports Serve averages "
                                      "before each decision.")
    upscale_delay_s: float = Field(30.0, ge=0, description="How long Serve's decision to add replicas must hold "
                                   "before it acts.")
    downscale_delay_s: float = Field(600.0, ge=0, description="How long Serve's decision to remove replicas must "
                                     "hold before it acts.")

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        return self


class DeploymentConfig(Frozen):
    """How Ray Serve places one stage's replicas."""

    num_replicas: PositiveInt | None = Field(
        None, description="Fixed replica count; leave unset when autoscaling is given (then Serve scales)."
    )
    autoscaling: AutoscalingConfig | None = Field(None, description="Autoscaling bounds instead of a fixed count.")
    max_ongoing_requests: PositiveInt = Field(
        8, description="Requests Serve sends to one replica at once; at least the engine's batch limit."
    )
    max_queued_requests: PositiveInt = Field(
        256, description="Requests that may wait for a replica; past it callers get a 503 with Retry-After."
    )
    max_surge_percent: int = Field(
        0, ge=0, le=100,
        description="Replicas Serve starts beside the old ones while it replaces them (a changed app's args, code or "
        "actor options), in percent of the count, rounded up. With some, an old replica serves until its replacement "
        "is ready; with 0 (Serve's default), Serve stops old replicas before it starts new ones, and a stage of one "
        "replica answers nothing while its replacement starts. A surge replica needs its resources free meanwhile "
        "(a GPU stage's: a spare GPU, or room for the autoscaler to add one), else the replacement waits for them.",
    )
    num_cpus: float = Field(1.0, ge=0, description="Logical CPUs each replica reserves.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs each replica reserves (1 for a GPU stage).")
    torch_threads: PositiveInt | None = Field(
        None,
        description="CPU threads for each replica's torch (OMP_NUM_THREADS); unset, Ray gives the replica's whole "
        "CPUs, at least 1. CPU presets raise it so that fractional replicas still use every core.",
    )

    resources: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict,
        description="Custom Ray resources each replica needs, e.g. {omni_dit_node: 1}: pins the stage to the nodes "
        "(or KubeRay worker groups) that declare them.",
    )
    omp_wait_policy: Literal["passive", "active"] = Field(
        "passive",
        description="What each replica's idle OpenMP threads do (OMP_WAIT_POLICY): sleep (passive), or spin for the "
        "next parallel region (active), which saves microseconds on a dedicated core and burns the cores that other "
        "replicas of a CPU machine share.",
    )

    @model_validator(mode="after")
    def _check_scaling(self) -> DeploymentConfig:
        if self.num_replicas is not None and self.autoscaling is not None:
            raise ValueError("give either num_replicas or autoscaling, not both")
        return self


class StageConfig(Frozen):
    runner: Literal["model", "simulated"] = Field(
        "model",
        description="model: run the checkpoint. simulated: compute nothing, wait as long as the stage would take on "
        "a GPU and return outputs of Qwen-Image's real shapes (omni_ray.runners.gpu_costs), for load tests on any "
        "machine; only the tokenizer is read from `model`.",
    )
    dtype: Dtype = Field("float32", description="Weights and activations dtype.")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="Torch device the stage runs on.")
    deployment: DeploymentConfig = Field(
        default_factory=DeploymentConfig, description="Ray Serve options for the stage's deployment."
    )
