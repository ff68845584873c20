"""The design card's shape: the repository's top level holds its entries, and the class Serve binds as the app's
ingress is the CrossEngineCoordinator."""

import subprocess

from conftest import REPO

CARD = {"pyproject.toml", "omni_ray", "deployments", "stage_configs", "tests", "k8s", "README.md"}
BESIDE = {"Makefile", "benchmarks", "testing", "tools", "docs", ".ci", ".gitignore"}  # and the Serve configs


def test_the_top_level_holds_the_cards_entries():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    top = {path.split("/")[0] for path in tracked.split()}
    configs = {name for name in top if name.startswith("config") and name.endswith(".yaml")}
    assert "config.yaml" in configs and top - configs == CARD | BESIDE


def test_serve_binds_the_cross_engine_coordinator_as_the_ingress(tiny_dir):
    from ray.serve._private.build_app import build_app as serve_build  # internal: pinned with ray 2.60

    from deployments.app import build_app
    from deployments.coordinator import CrossEngineCoordinator
    from deployments.http.routes import ROUTES

    built = serve_build(build_app({"model": str(tiny_dir)}), name="omni-ray")
    by_name = {deployment.name: deployment for deployment in built.deployments}
    ingress = by_name[built.ingress_deployment_name].func_or_class
    assert ingress is CrossEngineCoordinator and ingress.__name__ == "CrossEngineCoordinator"
    assert set(by_name) == {"Coordinator", "Encoder", "DiT", "VAE"}
    assert all(callable(getattr(ingress, method)) for method in ROUTES)  # every route is the coordinator's
