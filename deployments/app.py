"""The app builder: ``serve run deployments.app:build_app stage_config=... model=...`` or ``serve run
config.yaml``."""

from __future__ import annotations

import pathlib
from typing import Any

import ray
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
from omni_ray.config import DeploymentConfig, DiTConfig, VAEConfig, load_config
from omni_ray.placement import gang_bundles, largest_shortfall

REPO = pathlib.Path(__file__).resolve().parents[1]


class AppArgs(BaseModel):
    """Arguments of ``build_app``, from a Serve config's ``args`` or ``serve run``'s ``key=value`` pairs."""

    model_config = ConfigDict(extra="forbid")

    stage_config: str = Field(
        "stage_configs/qwen_image_tiny.yaml",
        description="Preset YAML: a path, or one relative to the current directory or to this repository.",
    )
    model: str | None = Field(None, description="Checkpoint directory or hub id overriding the preset's `model`.")
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Preset fields laid over the stage config's (`{requests: {default_steps: 30}, loras: {...}}`; "
        "mappings merged key by key). Serve's config carries them, so `serve deploy` (or KubeRay's serveConfigV2) "
        "changes a setting without a new preset file: a changed `args` rebuilds the app and replaces every replica, "
        "one at a time, each draining its requests first (docs/reliability.md, Upgrades under load).",
    )


def build_app(args: dict) -> Application:
    """Binds the ``CrossEngineCoordinator`` ingress to the three stage deployments, each built from its stage
    config. The coordinator's deployment keeps the name ``Coordinator`` (metrics, dashboards and logs name it so)."""
    app_args = AppArgs.model_validate(args)
    config = checkpoints.ensure(load_config(resolve_stage_config(app_args.stage_config), model=app_args.model,
                                             overrides=app_args.overrides))
    # A coordinator or DiT replica being replaced (a redeploy, a scale-down) finishes the requests it holds, which
    # may run up to their deadline; other stage replicas' calls that outlive Serve's default wait are issued again.
    drain = {"graceful_shutdown_timeout_s": config.requests.timeout_s}
    encoder = stage_deployment(Encoder, config.encoder.deployment).bind(config)
    dit = serve.deployment(DiT).options(**gang_options(config.dit, "dit"), request_router_config=router_config(),
                                        **drain).bind(config)
    vae = serve.deployment(VAE).options(**gang_options(config.vae, "vae")).bind(config)
    return stage_deployment(CrossEngineCoordinator, config.coordinator, name="Coordinator", **drain).bind(
        encoder, dit, vae, config)


def stage_deployment(cls: type, options: DeploymentConfig, **more) -> serve.Deployment:
    """A Serve deployment of ``cls`` with the preset's placement options (and ``more`` of Serve's)."""
    return serve.deployment(cls).options(**deployment_options(options), **more)


def gang_options(stage: DiTConfig | VAEConfig, name: str) -> dict:
    """The options in Serve's terms of a stage whose replicas may be gangs (``name``: ``dit`` or ``vae``). With a
    gang (``<name>.parallel`` above world size 1), each replica gets a placement group: its own bundle, then one per
    rank, all on one node (``STRICT_PACK``), after a check that some node of the cluster can hold it; the ranks take
    the GPUs, the replica none."""
    options = deployment_options(stage.deployment)
    if stage.parallel.world_size > 1:
        bundles = gang_bundles(stage)
        check_gang_fits_a_node(bundles, stage, name)
        options["ray_actor_options"]["num_gpus"] = 0
        options |= {"placement_group_bundles": bundles, "placement_group_strategy": "STRICT_PACK"}
    return options


def check_gang_fits_a_node(bundles: list[dict[str, float]], stage: DiTConfig | VAEConfig, name: str) -> None:
    """Raises ValueError naming ``<name>.parallel`` when no node of the cluster can hold one replica's gang: its
    placement group would wait for ever and the app with it. The nodes are the live ones and, on an autoscaling
    cluster that publishes them, the node types it may add. Run where the builder runs on the cluster (``serve run
    config.yaml``, KubeRay); a builder called before Ray is initialised checks nothing."""
    if not ray.is_initialized():
        return
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]] + autoscaler_node_types()
    need = largest_shortfall(bundles, nodes)
    if need is not None:
        largest = max(nodes, key=lambda node: (node.get("GPU", 0), node.get("CPU", 0)), default={})
        raise ValueError(
            f"{name}.parallel: a gang of {stage.parallel.world_size} ranks needs {_resources(need)} on one node (the "
            f"replica's {name}.deployment, then {name}.parallel.rank_num_cpus CPUs and {name}.deployment.num_gpus "
            f"GPUs per rank, packed on one node), more than any node of the cluster has (the largest: "
            f"{_resources(largest)})"
        )


def autoscaler_node_types() -> list[dict[str, float]]:
    """The resources of each node type an autoscaling cluster may add (Ray's autoscaler v2 publishes them); none
    when it publishes nothing."""
    try:
        from ray._private.state import state

        config = state.get_cluster_config()
    except Exception:  # a private API: without it, only the live nodes count
        return []
    if config is None:
        return []
    return [dict(group.resources) for group in config.node_group_configs if group.max_count != 0]


def _resources(resources: dict[str, float]) -> str:
    shown = {name: amount for name, amount in resources.items()
             if name in ("CPU", "GPU") or not (name.startswith("node:") or name in ("memory", "object_store_memory"))}
    return ", ".join(f"{amount:g} {name}" for name, amount in sorted(shown.items())) or "nothing"


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
        "max_surge_percent": options.max_surge_percent,
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

