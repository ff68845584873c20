"""The layers import one way (docs/development.md's table): no import cycle in either package; nothing under omni_ray/ imports
Ray but the Python client's Ray transport (``deployments/`` is the Serve layer); the request path and the API import
with torch, model code and Ray all unavailable; the scheduler and request-path tests load no model code; loading a
preset writes nothing."""

import ast
import pathlib
import subprocess
import sys

import pytest
from conftest import REPO

HEAVY = ("torch", "diffusers", "transformers", "vllm", "ray")
MODEL_CODE = ("diffusers", "transformers", "vllm")


def _modules(folder: str) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module under ``folder``."""
    return {".".join(f.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): f
            for f in sorted((REPO / folder).rglob("*.py"))}


def _imported(path: pathlib.Path, known: set[str]) -> set[str]:
    """The modules ``path`` imports, anywhere in it (a function's lazy import too); ``from a import b`` names the
    module ``a.b`` when there is one."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.add(full if full in known else node.module)
    return names


def _run_blocking(blocked: tuple[str, ...], code: str) -> subprocess.CompletedProcess:
    block = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
    return subprocess.run([sys.executable, "-c", block + code], capture_output=True, text=True, cwd=REPO)


def test_no_import_cycle_in_the_packages():
    modules = {**_modules("omni_ray"), **_modules("deployments")}
    graph = {name: {m for m in _imported(path, set(modules)) if m in modules and m != name}
             for name, path in modules.items()}
    cycles, done, stack = [], set(), []

    def visit(name):
        if name in stack:
            cycles.append(stack[stack.index(name):] + [name])
            return
        if name in done:
            return
        stack.append(name)
        for dependency in sorted(graph[name]):
            visit(dependency)
        stack.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)
    assert len(graph) > 60 and cycles == []


def test_nothing_under_omni_ray_imports_ray_but_the_clients_ray_transport():
    modules = _modules("omni_ray")
    offenders = [name for name, path in modules.items()
                 if any(m.split(".")[0] == "ray" for m in _imported(path, set()))]
    assert len(modules) > 40 and offenders == ["omni_ray.api.client"]
    client = ast.parse(modules["omni_ray.api.client"].read_text())
    top_level = [node for node in client.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert not any(m.split(".")[0] == "ray" for node in top_level for m in _names(node))  # lazily, in Client.ray
    result = _run_blocking(("ray",), "".join(f"import {name}\n" for name in modules))
    assert result.returncode == 0, result.stderr[-2000:]


def _names(node: ast.Import | ast.ImportFrom) -> list[str]:
    return [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]


def test_the_request_path_and_the_api_import_without_torch_model_code_or_ray():
    modules = ["omni_ray.request_path", "omni_ray.records", *_modules("omni_ray/api")]
    code = "".join(f"import {name}\n" for name in modules)
    result = _run_blocking(HEAVY, code + "print(sorted(m for m in sys.modules if m.startswith('omni_ray')))")
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = eval(result.stdout)
    assert "omni_ray.api.client" in loaded and not [m for m in loaded if m.startswith(("omni_ray.runners",
                                                                                       "omni_ray.engine"))]


def test_deployments_reach_model_runners_only_through_the_engine_builders():
    """The Serve layer imports no model runner and no model library; the stage deployments build their engines with
    ``omni_ray.engine.builders``, which picks the runners."""
    imports = {name: _imported(path, set()) for name, path in _modules("deployments").items()}
    runners = {name: sorted(m for m in found if m.startswith("omni_ray.runners") or m.split(".")[0] in MODEL_CODE)
               for name, found in imports.items()}
    assert {name: found for name, found in runners.items() if found} == {}
    assert {name for name, found in imports.items() if "omni_ray.engine.builders" in found} == {
        "deployments.encoder", "deployments.dit", "deployments.vae"}


@pytest.mark.parametrize("test_module", ["test_schedulers", "test_dit_split", "test_request_path"])
def test_scheduler_and_request_path_tests_load_no_model_code(test_module):
    code = (f"sys.path[:0] = ['tests', '.']\nimport {test_module}\n"
            "print(sorted(m for m in sys.modules if m.startswith('omni_ray.runners')))")
    result = _run_blocking(MODEL_CODE, code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_loading_every_preset_writes_nothing(tmp_path):
    """Presets whose checkpoint is missing name a directory under HOME: loading them must not build it."""
    presets = sorted((REPO / "stage_configs").glob("*.yaml"))
    code = (
        "import os, pathlib\n"
        "from omni_ray.config import load_config\n"
        f"for path in {[str(p) for p in presets]!r}:\n"
        "    load_config(path)\n"
        "print(sorted(str(p) for p in pathlib.Path(os.environ['HOME']).rglob('*')))\n"
    )
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env)
    assert len(presets) >= 8 and result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_a_coordinator_replica_loads_no_torch(tiny_dir, edit_dir):
    """What a coordinator replica imports (its class's module) and runs (planning a request, which counts the
    prompt's tokens and an edit's image tokens), with torch, diffusers and vLLM unavailable."""
    code = (
        "import asyncio, io, numpy as np\n"
        "from PIL import Image\n"
        "import deployments.coordinator\n"
        "from omni_ray.config import load_config\n"
        "from testing.coordinator import coordinator\n"
        f"text = coordinator(load_config('stage_configs/qwen_image_tiny.yaml', model={str(tiny_dir)!r}))\n"
        "plan = asyncio.run(text.plan({'prompt': 'a red cat'}))\n"
        f"edit = coordinator(load_config('stage_configs/qwen_image_edit_tiny.yaml', model={str(edit_dir)!r}))\n"
        "png = io.BytesIO(); Image.fromarray(np.zeros((100, 180, 3), np.uint8)).save(png, format='PNG')\n"
        "edited = asyncio.run(edit.plan({'prompt': 'make it red'}, png.getvalue()))\n"
        "print(plan.input_tokens.text > 0, edited.input_tokens.image > 0)\n"
    )
    result = _run_blocking(("torch", "diffusers", "vllm"), code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True", "True"]


ENGINE_INSIDES = ("scheduler", "runner", "step_times", "cache")  # what a core holds; ``core`` itself below


def _core_reads(source: str) -> list[str]:
    """Attribute reads into an engine core: ``.core`` but as ``EngineStats.core`` (``stats.core``), and what a core
    holds."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        of_stats = ast.unparse(node.value).split(".")[-1] == "stats"  # EngineStats.core: the core's figures
        if (node.attr == "core" and not of_stats) or node.attr in ENGINE_INSIDES:
            found.append(f"{ast.unparse(node)} (line {node.lineno})")
    return found


def test_nothing_under_deployments_reads_an_engine_cores_attributes():
    """The stage shims read their engine's figures from what its thread hands out (``engine.stats``), never from
    the core it drives on another thread."""
    assert _core_reads("cache = self.engine.core.cache\nfit = engine.core.step_times.fit") != []  # it would see one
    reads = {name: found for name, path in _modules("deployments").items() if (found := _core_reads(path.read_text()))}
    assert reads == {}


def test_a_family_imports_no_other_family_and_nothing_else_branches_on_one():
    """Each family's package imports no other family's (shared code is imported from the shared layers), the
    registry imports no family's code, and no line outside omni_ray/families/ compares a preset's family or reads a
    family's name (docs/adding-a-family.md)."""
    import re

    modules = {**_modules("omni_ray"), **_modules("deployments")}
    packages = sorted({name.split(".")[2] for name in modules
                       if name.startswith("omni_ray.families.") and name.count(".") >= 3})
    assert {"qwen_image", "qwen_image_2_1", "qwen_image_layered"} <= set(packages)
    crossing = {}
    for name, path in modules.items():
        if name.startswith("omni_ray.families.") and name.count(".") >= 2 and name.split(".")[2] in packages:
            own = name.split(".")[2]
            others = sorted(m for m in _imported(path, set(modules))
                            if m.startswith("omni_ray.families.") and m.split(".")[2] in packages
                            and m.split(".")[2] != own)
            if others:
                crossing[name] = others
    assert crossing == {}
    assert not [m for m in _imported(modules["omni_ray.families"], set(modules)) if m.startswith("omni_ray")]
    branch = re.compile(r"family *(==|!=|in)|\.FAMILY\b")
    found = [f"{path.relative_to(REPO)}:{number}" for name, path in modules.items()
             if not name.startswith("omni_ray.families")
             for number, line in enumerate(path.read_text().splitlines(), 1) if branch.search(line)]
    assert found == []
