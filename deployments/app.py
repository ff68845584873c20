"""The app builder: ``serve run deployments.app:build_app stage_config=... model=...`` or ``serve run
config.yaml``."""

from __future__ import annotations

import pathlib

from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve import Application

from deployments.autoscaling import QueuedWorkPolicy
from deployments.coordinator import CrossEngineCoordinator
from deployments.dit import DiT
from deployments.encoder import Encoder
from deployments.routing import router_config
from deployments.vae import VAE
from omni_ray import checkpoints
from omni_ray.config import DeploymentConfig, load_config

REPO = pathlib.Path(__file__).resolve().parents[1]


class AppArgs(BaseModel):
    """Arguments of ``build_app``, from a Serve config's ``args`` or ``serve run``'s ``key=value`` pairs."""

    model_config = ConfigDict(extra="forbid")

    stage_config: str = Field(
        "stage_configs/qwen_image_tiny.yaml",
        description="Preset YAML: a path, or one relative to the current directory or to this repository.",
    )
    model: str | None = Field(None, description="Checkpoint directory or hub id overriding the preset's `model`.")


def build_app(args: dict) -> Application:
    """Binds the ``CrossEngineCoordinator`` ingress to the three stage deployments, each built from its stage
    config. The coordinator's deployment keeps the name ``Coordinator`` (metrics, dashboards and logs name it so)."""
    app_args = AppArgs.model_validate(args)
    config = checkpoints.ensure(load_config(resolve_stage_config(app_args.stage_config), model=app_args.model))
    # A coordinator or DiT replica being replaced (a redeploy, a scale-down) finishes the requests it holds, which
    # may run up to their deadline; other stage replicas' calls that outlive Serve's default wait are issued again.
    drain = {"graceful_shutdown_timeout_s": config.requests.timeout_s}
    encoder = stage_deployment(Encoder, config.encoder.deployment).bind(config)
    dit = stage_deployment(DiT, config.dit.deployment, request_router_config=router_config(), **drain).bind(config)
    vae = stage_deployment(VAE, config.vae.deployment).bind(config)
    return stage_deployment(CrossEngineCoordinator, config.coordinator, name="Coordinator", **drain).bind(
        encoder, dit, vae, config)


def stage_deployment(cls: type, options: DeploymentConfig, **more) -> serve.Deployment:
    """A Serve deployment of ``cls`` with the preset's placement options (and ``more`` of Serve's)."""
    return serve.deployment(cls).options(**deployment_options(options), **more)


def deployment_options(options: DeploymentConfig) -> dict:
    """The preset's options in Serve's terms."""
    env = {"OMP_WAIT_POLICY": options.omp_wait_policy.upper()}  # read once, when the replica's process starts
    if options.torch_threads is not None:
        env["OMP_NUM_THREADS"] = str(options.torch_threads)
    actor = {"num_cpus": options.num_cpus, "num_gpus": options.num_gpus, "runtime_env": {"env_vars": env}}
    if options.resources:
        actor["resources"] = dict(options.resources)
    result = {
        "max_ongoing_requests": options.max_ongoing_requests,
        "max_queued_requests": options.max_queued_requests,
        "ray_actor_options": actor,
    }
    if options.autoscaling is not None:
        scaling = options.autoscaling.model_dump(exclude={"target_queued_work_s"})
        if options.autoscaling.target_queued_work_s is not None:
            scaling["policy"] = {"policy_function": QueuedWorkPolicy,
                                 "policy_kwargs": {"target_work_s": options.autoscaling.target_queued_work_s}}
        result["autoscaling_config"] = scaling
    else:
        result["num_replicas"] = options.num_replicas or 1
    return result


def resolve_stage_config(path: str) -> pathlib.Path:
    candidate = pathlib.Path(path).expanduser()
    if candidate.is_absolute() or candidate.exists():
        return candidate
    return REPO / candidate

