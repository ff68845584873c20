"""The KubeRay manifests: valid against the RayService CRD, their Serve config valid and in step with config.gpu.yaml,
and the placement the app builder produces is what the worker groups are sized for; the Redis their GCS fault
tolerance names (k8s/redis.yaml) valid as Kubernetes objects and wired to them."""

import copy
import functools
import importlib
import math
import re

import jsonschema
import pytest
import yaml
from conftest import REPO

from deployments.app import AppArgs, build_app

CRD = REPO.parent / "shared" / "kuberay" / "ray.io_rayservices.yaml"
MANIFESTS = sorted((REPO / "k8s").glob("*.yaml"))
STAGES = {"Encoder", "DiT", "VAE"}


def strict(schema: dict) -> dict:
    """The CRD's schema, with unknown fields rejected as the API server's strict field validation does."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@functools.cache
def crd_schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    (v1,) = [version for version in crd["spec"]["versions"] if version["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


@pytest.fixture(scope="module")
def validator():
    schema = strict(crd_schema())
    # apiVersion, kind and metadata are checked by Kubernetes itself, outside the CRD's schema.
    schema["properties"]["metadata"] = {"type": "object", "required": ["name"]}
    return jsonschema.Draft7Validator(schema)


def documents():
    docs = [(path, doc) for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert docs, "no manifests in k8s/"
    return docs


def rayservices():
    docs = [(path, doc) for path, doc in documents() if doc.get("kind") == "RayService"]
    assert docs, "no RayService in k8s/"
    return docs


def errors(validator, doc) -> list[str]:
    found = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
    if doc.get("apiVersion") != "ray.io/v1" or doc.get("kind") != "RayService":
        found.append("not a ray.io/v1 RayService")
    return found


def test_every_manifest_is_a_valid_rayservice(validator):
    for path, doc in rayservices():
        assert errors(validator, doc) == [], path.name


@pytest.mark.parametrize(
    "breakage",
    [
        lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(minReplica=3),  # typo: unknown field
        lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(maxReplicas="six"),  # wrong type
        lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"].pop("template"),  # required field missing
        lambda d: d["spec"].pop("rayClusterConfig"),
        lambda d: d.update(kind="RayCluster"),
    ],
)
def test_a_broken_copy_fails(validator, breakage):
    _, doc = rayservices()[0]
    broken = copy.deepcopy(doc)
    breakage(broken)
    assert errors(validator, broken) != []


INT_OR_STRING = {"anyOf": [{"type": "integer"}, {"type": "string"}]}
LABELS = {"type": "object", "additionalProperties": {"type": "string"}}


def kubernetes_schemas() -> dict[tuple[str, str], dict]:
    """Schemas of the Kubernetes objects besides the RayServices in k8s/, by (apiVersion, kind). The pod template, the
    claim spec and the label selector are Kubernetes' own OpenAPI schemas, as the RayService CRD embeds them; the
    Deployment's and Service's spec around them hold the fields of Kubernetes' that these manifests may use."""
    cluster = crd_schema()["properties"]["spec"]["properties"]["rayClusterConfig"]["properties"]
    pod_template = cluster["headGroupSpec"]["properties"]["template"]
    volume = pod_template["properties"]["spec"]["properties"]["volumes"]["items"]["properties"]
    claim_spec = volume["ephemeral"]["properties"]["volumeClaimTemplate"]["properties"]["spec"]
    metadata = {"type": "object", "required": ["name"],
                "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": LABELS,
                               "annotations": LABELS}}
    deployment = {
        "type": "object", "required": ["selector", "template"],
        "properties": {
            "replicas": {"type": "integer"}, "selector": claim_spec["properties"]["selector"],
            "strategy": {"type": "object", "properties": {
                "type": {"enum": ["Recreate", "RollingUpdate"]},
                "rollingUpdate": {"type": "object", "properties": {"maxSurge": INT_OR_STRING,
                                                                   "maxUnavailable": INT_OR_STRING}}}},
            "template": pod_template, "minReadySeconds": {"type": "integer"},
            "revisionHistoryLimit": {"type": "integer"}, "progressDeadlineSeconds": {"type": "integer"}}}
    service = {
        "type": "object", "required": ["ports"],
        "properties": {
            "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"]}, "selector": LABELS,
            "clusterIP": {"type": "string"},
            "ports": {"type": "array", "items": {"type": "object", "required": ["port"], "properties": {
                "name": {"type": "string"}, "port": {"type": "integer"}, "targetPort": INT_OR_STRING,
                "protocol": {"enum": ["TCP", "UDP", "SCTP"]}, "appProtocol": {"type": "string"}}}}}}

    def kind(api_version: str, name: str, spec: dict) -> dict:
        return {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
                "properties": {"apiVersion": {"const": api_version}, "kind": {"const": name}, "metadata": metadata,
                               "spec": spec}}

    return {("v1", "PersistentVolumeClaim"): kind("v1", "PersistentVolumeClaim", claim_spec),
            ("apps/v1", "Deployment"): kind("apps/v1", "Deployment", deployment),
            ("v1", "Service"): kind("v1", "Service", service)}


@pytest.fixture(scope="module")
def kubernetes_validators() -> dict:
    return {key: jsonschema.Draft7Validator(strict(schema)) for key, schema in kubernetes_schemas().items()}


def kubernetes_errors(validators, doc) -> list[str]:
    validator = validators.get((doc.get("apiVersion"), doc.get("kind")))
    if validator is None:
        return [f"{doc.get('apiVersion')} {doc.get('kind')} is not a kind k8s/ is checked for"]
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def redis_objects() -> dict[str, dict]:
    objects = {doc["kind"]: doc for path, doc in documents() if path.name == "redis.yaml"}
    assert objects.keys() == {"PersistentVolumeClaim", "Deployment", "Service"}
    return objects


def test_every_other_manifest_is_a_valid_kubernetes_object_and_none_holds_a_secret(kubernetes_validators):
    for path, doc in documents():
        if doc.get("kind") != "RayService":
            assert kubernetes_errors(kubernetes_validators, doc) == [], path.name
    assert redis_objects()
    assert not [path.name for path, doc in documents() if doc.get("kind") == "Secret"]  # passwords are created


@pytest.mark.parametrize(
    "kind, breakage",
    [
        ("Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0].update(imagePullPolicyy="Always")),
        ("Deployment", lambda d: d["spec"].update(replicas="one")),
        ("Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0]["env"][0]["valueFrom"]
         ["secretKeyRef"].pop("key")),
        ("Deployment", lambda d: d["spec"]["strategy"].update(type="Rolling")),
        ("Service", lambda d: d["spec"]["ports"][0].update(port="6379")),
        ("Service", lambda d: d.update(kind="Services")),
        ("PersistentVolumeClaim", lambda d: d["spec"].update(accesModes=["ReadWriteOnce"])),
    ],
)
def test_a_broken_copy_of_the_redis_manifest_fails(kubernetes_validators, kind, breakage):
    broken = copy.deepcopy(redis_objects()[kind])
    breakage(broken)
    assert kubernetes_errors(kubernetes_validators, broken) != []


def test_every_rayservice_keeps_its_gcs_in_the_redis_of_k8s_redis_yaml():
    """GCS fault tolerance (issue 41): each RayService's gcsFaultToleranceOptions name k8s/redis.yaml's Service and
    the Secret key its Redis takes its password from; KubeRay's own rules for it hold (ray-operator's
    utils/validation.go: no redis-password in rayStartParams, no REDIS_PASSWORD, RAY_REDIS_ADDRESS or REDIS_USERNAME
    in the head's environment, no ray.io/ft-enabled annotation); the storage namespace is KubeRay's (the RayCluster's
    UID), so a NewCluster upgrade's new cluster never reads the old one's tables; and the proxies run on every node,
    so the worker pods serve while the head is down."""
    redis = redis_objects()
    pod = redis["Deployment"]["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert redis["Deployment"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert redis["Service"]["spec"]["selector"].items() <= labels.items()
    (container,) = pod["spec"]["containers"]
    (port,) = redis["Service"]["spec"]["ports"]
    assert port["targetPort"] in {p.get("name") for p in container["ports"]} | {p["containerPort"]
                                                                                 for p in container["ports"]}
    password = {item["name"]: item for item in container["env"]}["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    args = dict(zip(container["args"][::2], container["args"][1::2]))
    assert args["--requirepass"] == "$(REDIS_PASSWORD)" and args["--appendonly"] == "yes"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    claim = volumes[mounts[args["--dir"]]]["persistentVolumeClaim"]["claimName"]
    assert claim == redis["PersistentVolumeClaim"]["metadata"]["name"]
    # One pod at a time on a ReadWriteOnce volume: KubeRay supports a standalone Redis only.
    deployment = redis["Deployment"]["spec"]
    assert deployment["replicas"] == 1 and deployment["strategy"]["type"] == "Recreate"
    for path, doc in rayservices():
        cluster = doc["spec"]["rayClusterConfig"]
        options = cluster["gcsFaultToleranceOptions"]
        assert options["redisAddress"] == f"{redis['Service']['metadata']['name']}:{port['port']}", path.name
        assert options["redisPassword"] == {"valueFrom": {"secretKeyRef": password}}, path.name
        assert options.get("backend", "redis") == "redis" and "externalStorageNamespace" not in options, path.name
        head = cluster["headGroupSpec"]
        assert not {"redis-password", "redis-username"} & head["rayStartParams"].keys(), path.name
        head_env = {item["name"] for item in head["template"]["spec"]["containers"][0].get("env", [])}
        assert not {"REDIS_PASSWORD", "RAY_REDIS_ADDRESS", "REDIS_USERNAME"} & head_env, path.name
        assert "ray.io/ft-enabled" not in doc["metadata"].get("annotations", {}), path.name
        assert serve_config(doc)["proxy_location"] == "EveryNode", path.name


# KubeRay 1.7's upgrade strategies (the CRD leaves the type a plain string, so the test names them).
UPGRADE_STRATEGIES = {"NewCluster", "NewClusterWithIncrementalUpgrade", "None"}


def test_every_manifest_names_its_upgrade_strategy():
    """A change of the cluster spec (the image) brings up a new RayCluster and moves the traffic once its Serve app is
    healthy: said in the manifest, not left to the operator's default or its ENABLE_ZERO_DOWNTIME variable."""
    for path, doc in rayservices():
        assert doc["spec"]["upgradeStrategy"] == {"type": "NewCluster"}, path.name
        assert doc["spec"]["upgradeStrategy"]["type"] in UPGRADE_STRATEGIES


def test_the_incremental_upgrade_in_the_docs_is_a_valid_rayservice(validator):
    """docs/kuberay.md's NewClusterWithIncrementalUpgrade block, put in rayservice.yaml, validates against the CRD
    (and without the gateway class it requires, does not); the strategy steps Serve's target capacity, which only
    the Ray autoscaler turns into pods."""
    text = (REPO / "docs" / "kuberay.md").read_text()
    (block,) = [b for b in text.split("```yaml")[1:] if "NewClusterWithIncrementalUpgrade" in b.split("```")[0]]
    strategy = yaml.safe_load(block.split("```")[0])
    (doc,) = [doc for path, doc in rayservices() if path.name == "rayservice.yaml"]
    changed = copy.deepcopy(doc)
    changed["spec"].update(strategy)
    assert changed["spec"]["upgradeStrategy"]["type"] == "NewClusterWithIncrementalUpgrade"
    assert errors(validator, changed) == []
    assert changed["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"]
    del changed["spec"]["upgradeStrategy"]["clusterUpgradeOptions"]["gatewayClassName"]
    assert errors(validator, changed) != []


def serve_config(doc) -> dict:
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)
    return config


def test_serve_config_validates_and_matches_config_gpu_yaml():
    gpu = yaml.safe_load((REPO / "config.gpu.yaml").read_text())
    gpu_presets = {"stage_configs/qwen_image.yaml", "stage_configs/qwen_image_shared.yaml"}
    for path, doc in rayservices():
        config = serve_config(doc)
        assert [a["name"] for a in config["applications"]] == [a["name"] for a in gpu["applications"]]
        for app, reference in zip(config["applications"], gpu["applications"]):
            module, attr = app["import_path"].split(":")
            assert getattr(importlib.import_module(module), attr) is build_app
            args = AppArgs.model_validate(app["args"])
            assert args.stage_config in gpu_presets, path.name
            if path.name == "rayservice.yaml":  # the first example is config.gpu.yaml's app
                assert args.stage_config == AppArgs.model_validate(reference["args"]).stage_config
            assert (app["route_prefix"], app["import_path"]) == (reference["route_prefix"], reference["import_path"])
            assert deployments(app["args"]).keys() == deployments(reference["args"]).keys() == STAGES | {"Coordinator"}


def deployments(args: dict) -> dict:
    """The app's deployments by name, as Serve builds them. The model is swapped for the hub id: the manifest's
    volume path does not exist here, and placement comes from the stage config alone."""
    from ray.serve._private.build_app import build_app as serve_build  # internal: pinned with ray 2.60

    app = build_app({**args, "model": "Qwen/Qwen-Image"})
    return {d.name: d for d in serve_build(app, name="omni-ray").deployments}


def replica_range(deployment) -> tuple[int, int]:
    autoscaling = deployment._deployment_config.autoscaling_config
    if autoscaling is not None:
        return autoscaling.min_replicas, autoscaling.max_replicas
    return deployment.num_replicas, deployment.num_replicas


def quantity(value) -> float:
    return float(str(value).removesuffix("Gi"))


def test_builder_placement_is_what_the_worker_groups_are_sized_for():
    """The stages' GPUs, at their fewest and most replicas, fill the worker group's pods at its fewest and most."""
    for path, doc in rayservices():
        (app,) = serve_config(doc)["applications"]
        built = deployments(app["args"])
        cluster = doc["spec"]["rayClusterConfig"]
        assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
        (group,) = cluster["workerGroupSpecs"]
        container = group["template"]["spec"]["containers"][0]
        gpus_per_pod = int(container["resources"]["limits"]["nvidia.com/gpu"])
        cpus_per_pod = quantity(container["resources"]["requests"]["cpu"])
        for name in STAGES:
            options = built[name].ray_actor_options
            assert 0 < options["num_gpus"] <= gpus_per_pod, name
            assert options["num_cpus"] <= cpus_per_pod, name
        assert built["Coordinator"].ray_actor_options["num_gpus"] == 0
        for bound, pods in ((0, group["minReplicas"]), (1, group["maxReplicas"])):
            gpus = sum(replica_range(built[name])[bound] * built[name].ray_actor_options["num_gpus"] for name in STAGES)
            cpus = sum(replica_range(built[name])[bound] * built[name].ray_actor_options["num_cpus"] for name in STAGES)
            assert math.ceil(gpus / gpus_per_pod) == pods, (path.name, bound)
            assert cpus <= pods * cpus_per_pod, (path.name, bound)
        if path.name == "rayservice.yaml":
            assert gpus_per_pod == 1 and replica_range(built["DiT"]) == (1, 4)
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["dshm"] == "/dev/shm" and app["args"]["model"].startswith(mounts["models"] + "/")


def test_dockerfile_installs_the_package_with_gpu_vllm_on_a_ray_gpu_image():
    dockerfile = (REPO / "k8s" / "Dockerfile").read_text()
    assert "FROM rayproject/ray:2.60.0-py311-gpu" in dockerfile
    assert '.[gpu]' in dockerfile
    images = {c["image"] for _, doc in rayservices() for c in containers(doc)}
    assert len(images) == 1  # head and workers run the same image


def containers(doc):
    cluster = doc["spec"]["rayClusterConfig"]
    yield from cluster["headGroupSpec"]["template"]["spec"]["containers"]
    for group in cluster["workerGroupSpecs"]:
        yield from group["template"]["spec"]["containers"]



def test_every_ray_container_reads_the_api_keys_from_a_secret():
    """The coordinator may run on any pod: each one's OMNI_RAY_API_KEY comes from the same Secret."""
    for path, doc in rayservices():
        cluster = doc["spec"]["rayClusterConfig"]
        templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
        for template in templates:
            for container in template["spec"]["containers"]:
                env = {item["name"]: item for item in container.get("env", [])}
                assert env["OMNI_RAY_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "omni-ray-api-keys",
                                                                                 "key": "keys"}, path.name


def test_every_ray_container_reads_the_key_limits_from_an_optional_secrets_file():
    """Per-key quotas: OMNI_RAY_KEY_LIMITS_FILE names a file of the omni-ray-key-limits Secret, mounted where it
    says; the Secret is optional (without it, no quotas), so the pods start without it."""
    for path, doc in rayservices():
        cluster = doc["spec"]["rayClusterConfig"]
        templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
        for template in templates:
            volumes = {volume["name"]: volume for volume in template["spec"]["volumes"]}
            assert volumes["key-limits"]["secret"] == {"secretName": "omni-ray-key-limits", "optional": True}
            for container in template["spec"]["containers"]:
                env = {item["name"]: item for item in container.get("env", [])}
                mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
                assert env["OMNI_RAY_KEY_LIMITS_FILE"]["value"] == mounts["key-limits"] + "/limits", path.name


def test_every_worker_is_ready_by_the_app_s_health_route_within_the_probe_s_timeout():
    """The serve Service's pods are ready while the app's /health (answered from the coordinator's own knowledge,
    GCS outage included: tests/test_operations.py) says every stage serves, read with a timeout the probe's covers."""
    for path, doc in rayservices():
        for group in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
            (container,) = group["template"]["spec"]["containers"]
            probe = container["readinessProbe"]
            command = probe["exec"]["command"][-1]
            assert "http://localhost:8000/health" in command and "local_raylet_healthz" in command, path.name
            reads = [int(seconds) for seconds in re.findall(r"wget -T (\d+)", command)]
            assert sum(reads) <= probe["timeoutSeconds"] and probe["failureThreshold"] * probe["periodSeconds"] >= 15
            assert "livenessProbe" not in container  # KubeRay's: a stage without replicas must not restart pods
