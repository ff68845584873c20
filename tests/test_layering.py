"""omni_ray/engine and omni_ray/stages run without Ray: they never import it, directly or through another module."""

import ast
import subprocess
import sys

from conftest import REPO

RAY_FREE = ["omni_ray/engine", "omni_ray/stages"]


def _imports(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_no_module_imports_ray():
    files = [f for folder in RAY_FREE for f in sorted((REPO / folder).rglob("*.py"))]
    assert any("stages" in str(f) for f in files)
    offenders = [str(f.relative_to(REPO)) for f in files if "ray" in _imports(f)]
    assert offenders == []


def test_stage_modules_import_with_ray_unavailable():
    modules = sorted(
        ".".join(f.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for folder in RAY_FREE
        for f in (REPO / folder).rglob("*.py")
    )
    code = "import sys; sys.modules['ray'] = None\n" + "\n".join(f"import {m}" for m in modules)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
