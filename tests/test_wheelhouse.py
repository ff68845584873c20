"""tools/wheelhouse.py on wheels built here: trimming, splitting, installing, and the choice of what to carry.

The download (pip download against the index) needs the network and is not tested; everything after it works on a
directory of wheels, and that is what these tests drive.
"""

import base64
import csv
import hashlib
import io
import json
import os
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from tools import wheelhouse

MIB = 1024 * 1024
TARGET = {"python_version": "3.12", "implementation": "cp", "platforms": ["manylinux_2_28_x86_64"]}
FAKERAY_FILES = {
    "ray/__init__.py": b'__version__ = "1.0"\n',
    "ray/jars/ray_dist.jar": random.Random(0).randbytes(3 * MIB),
    "ray/dashboard/__init__.py": b"",
    "ray/dashboard/client/build/static/js/main.js": b"console.log('dashboard');\n",
    "ray/dashboard/client/build/static/js/main.js.map": b'{"version": 3, "sources": []}\n',
}
TRIMMED_AWAY = {"ray/jars/ray_dist.jar", "ray/dashboard/client/build/static/js/main.js.map"}


def digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(directory: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A pure-Python wheel with ``files``, its METADATA, WHEEL and a RECORD listing everything."""
    info = f"{name}-{version}.dist-info"
    members = dict(files)
    members[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    members[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for path, data in members.items():
        writer.writerow([path, digest(data), len(data)])
    writer.writerow([f"{info}/RECORD", "", ""])
    members[f"{info}/RECORD"] = record.getvalue().encode()
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for path, data in members.items():
            archive.writestr(path, data)
    return wheel


@pytest.fixture
def wheels(tmp_path) -> dict[str, Path]:
    """fakeray 1.0 (with a jar and a source map to trim), tinypkg 0.3, and bigpkg 2.0 (2.5 MiB, nothing to trim)."""
    directory = tmp_path / "wheels"
    directory.mkdir()
    return {
        "fakeray": make_wheel(directory, "fakeray", "1.0", FAKERAY_FILES),
        "tinypkg": make_wheel(directory, "tinypkg", "0.3", {"tinypkg/__init__.py": b"VALUE = 42\n"}),
        "bigpkg": make_wheel(
            directory, "bigpkg", "2.0",
            {"bigpkg/__init__.py": b"", "bigpkg/blob.bin": random.Random(1).randbytes(5 * MIB // 2)},
        ),
    }


def read_members(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def pip_install_target(wheel: Path, target: Path) -> None:
    command = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--target", str(target), str(wheel)]
    subprocess.run(command, check=True, capture_output=True)


def import_from(target: Path, code: str) -> str:
    """Run ``code`` in a fresh interpreter that imports from ``target`` first; return its stdout."""
    env = {**os.environ, "PYTHONPATH": str(target)}
    return subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True).stdout


def test_trim_removes_exactly_the_trim_list_and_keeps_record_consistent(wheels, tmp_path):
    trimmed = tmp_path / "out" / wheels["fakeray"].name
    trimmed.parent.mkdir()
    removed = wheelhouse.trim_wheel(wheels["fakeray"], trimmed)

    assert set(removed) == TRIMMED_AWAY
    before, after = read_members(wheels["fakeray"]), read_members(trimmed)
    assert set(after) == set(before) - TRIMMED_AWAY
    record_name = "fakeray-1.0.dist-info/RECORD"
    assert all(after[name] == before[name] for name in after if name != record_name)
    rows = list(csv.reader(after[record_name].decode().splitlines()))
    assert {row[0] for row in rows} == set(after)
    for path, hash_field, size in rows:
        if path == record_name:
            assert (hash_field, size) == ("", "")
        else:
            assert (hash_field, int(size)) == (digest(after[path]), len(after[path]))
    assert trimmed.stat().st_size < MIB < wheels["fakeray"].stat().st_size


def test_a_wheel_without_trimmable_members_is_copied_byte_for_byte(wheels, tmp_path):
    copy = tmp_path / wheels["tinypkg"].name
    assert wheelhouse.trim_wheel(wheels["tinypkg"], copy) == []
    assert copy.read_bytes() == wheels["tinypkg"].read_bytes()


def test_the_trimmed_wheel_installs_and_imports(wheels, tmp_path):
    trimmed = tmp_path / wheels["fakeray"].name
    wheelhouse.trim_wheel(wheels["fakeray"], trimmed)
    target = tmp_path / "target"
    pip_install_target(trimmed, target)

    out = import_from(target, "import ray, ray.dashboard; print(ray.__version__, ray.__file__)")
    version, location = out.split()
    assert version == "1.0"
    assert Path(location).is_relative_to(target)
    assert not (target / "ray" / "jars").exists()
    assert (target / "ray/dashboard/client/build/static/js/main.js").is_file()


def test_parts_stay_under_the_limit_and_chunks_join_back(wheels, tmp_path):
    out = tmp_path / "bundle"
    manifest = wheelhouse.bundle(list(wheels.values()), out, TARGET, limit=MIB)

    parts = sorted(p for p in out.iterdir() if p.is_dir())
    assert [p.name for p in parts] == manifest["parts"] and len(parts) >= 3
    assert all(sum(f.stat().st_size for f in part.iterdir()) <= MIB for part in parts)
    assert {"wheelhouse.py", "manifest.json"} <= {f.name for f in parts[0].iterdir()}
    assert all(json.loads((part / "manifest.json").read_text()) == manifest for part in parts)

    (big,) = [w for w in manifest["wheels"] if w["name"] == "bigpkg"]
    assert [p["file"] for p in big["pieces"]] == [f"{big['filename']}.chunk-{i:03d}" for i in range(len(big["pieces"]))]
    assert len(big["pieces"]) >= 3
    joined = b"".join((out / p["part"] / p["file"]).read_bytes() for p in big["pieces"])
    assert joined == wheels["bigpkg"].read_bytes()  # nothing to trim: the upstream bytes
    assert hashlib.sha256(joined).hexdigest() == big["sha256"]

    (ray,) = [w for w in manifest["wheels"] if w["name"] == "fakeray"]
    assert (ray["version"], ray["trimmed_members"]) == ("1.0", 2)
    assert ray["size"] < MIB < ray["original_size"]


def run_install(bundle_dir: Path, target: Path, capsys) -> tuple[int, str, str]:
    code = wheelhouse.main(["install", str(bundle_dir), "--target", str(target)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_install_verifies_installs_and_checks_versions(wheels, tmp_path, capsys):
    out = tmp_path / "bundle"
    wheelhouse.bundle(list(wheels.values()), out, TARGET, limit=MIB)
    target = tmp_path / "target"

    code, stdout, _ = run_install(out, target, capsys)

    assert code == 0
    assert "3 of 3 installed as bundled" in stdout
    assert import_from(target, "import tinypkg, bigpkg, ray; print(tinypkg.VALUE, ray.__version__)").split() == [
        "42", "1.0"
    ]
    assert (target / "bigpkg" / "blob.bin").stat().st_size == 5 * MIB // 2


def test_install_from_the_parts_contents_merged_into_one_directory(wheels, tmp_path, capsys):
    out = tmp_path / "bundle"
    wheelhouse.bundle(list(wheels.values()), out, TARGET, limit=MIB)
    merged = tmp_path / "merged"
    merged.mkdir()
    for file in out.glob("part-*/*"):
        (merged / file.name).write_bytes(file.read_bytes())

    code, stdout, _ = run_install(merged, tmp_path / "target", capsys)

    assert code == 0 and "3 of 3 installed as bundled" in stdout


def test_install_refuses_a_chunk_with_one_byte_changed(wheels, tmp_path, capsys):
    out = tmp_path / "bundle"
    manifest = wheelhouse.bundle(list(wheels.values()), out, TARGET, limit=MIB)
    (big,) = [w for w in manifest["wheels"] if w["name"] == "bigpkg"]
    chunk = out / big["pieces"][1]["part"] / big["pieces"][1]["file"]
    data = bytearray(chunk.read_bytes())
    data[1000] ^= 0x01
    chunk.write_bytes(bytes(data))
    target = tmp_path / "target"

    code, _, stderr = run_install(out, target, capsys)

    assert code != 0
    assert str(chunk) in stderr and "sha256" in stderr
    assert not target.exists()  # refused before pip ran


def test_install_refuses_a_bundle_missing_a_chunk(wheels, tmp_path, capsys):
    out = tmp_path / "bundle"
    manifest = wheelhouse.bundle(list(wheels.values()), out, TARGET, limit=MIB)
    (big,) = [w for w in manifest["wheels"] if w["name"] == "bigpkg"]
    chunk = out / big["pieces"][2]["part"] / big["pieces"][2]["file"]
    chunk.unlink()
    target = tmp_path / "target"

    code, _, stderr = run_install(out, target, capsys)

    assert code != 0
    assert "missing" in stderr and str(chunk) in stderr
    assert not target.exists()


def test_install_fails_when_an_installed_version_differs_from_the_manifest(wheels, tmp_path, capsys):
    out = tmp_path / "bundle"
    manifest = wheelhouse.bundle([wheels["tinypkg"]], out, TARGET, limit=MIB)
    manifest["wheels"][0]["version"] = "0.4"
    for path in [out / "manifest.json", *out.glob("part-*/manifest.json")]:
        path.write_text(json.dumps(manifest))

    code, stdout, _ = run_install(out, tmp_path / "target", capsys)

    assert code == 1
    assert "MISMATCH" in stdout and "0 of 1 installed as bundled" in stdout


def test_requirements_the_target_satisfies_are_left_out_and_older_ones_kept():
    requirements = [
        "torch==2.13.*", "vllm==0.32.0", "ray[serve]==2.60.*", "transformers>=5.16.1,<5.20", "numpy>=1.26",
        "Pillow>=10", "pydantic>=2",
    ]
    have = {name: Version(v) for name, v in [
        ("torch", "2.11.0"), ("transformers", "5.17.0"), ("numpy", "1.24.4"), ("pillow", "11.3.0"), ("sympy", "1.14")
    ]}

    selection = wheelhouse.select_requirements(requirements, have)

    assert selection.carry == ["ray[serve]==2.60.*", "numpy>=1.26", "pydantic>=2"]
    assert len(selection.left_out) == 4
    assert selection.pins == {name: have[name] for name in ("torch", "transformers", "pillow", "sympy")}


def test_without_a_have_file_only_torch_and_vllm_are_left_out():
    selection = wheelhouse.select_requirements(["torch==2.13.*", "vllm==0.32.0", "numpy>=1.26"], {})
    assert (selection.carry, selection.pins) == (["numpy>=1.26"], {})


def test_read_have_takes_pinned_lines_by_canonical_name():
    text = "# comment\nTyping_Extensions==4.15.0\ntorch==2.11.0+cu130\n-e git+https://x/y.git#egg=y\nz @ file:///z\n\n"
    have, ignored = wheelhouse.read_have(text)
    assert have == {"typing-extensions": Version("4.15.0"), "torch": Version("2.11.0+cu130")}
    assert ignored == ["-e git+https://x/y.git#egg=y", "z @ file:///z"]


def test_downloaded_wheels_of_the_target_and_torch_stack_are_dropped():
    names = [
        "torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl", "triton-3.5.0-cp312-cp312-manylinux_2_28_x86_64.whl",
        "nvidia_cublas_cu12-12.6.4.1-py3-none-manylinux2014_x86_64.whl", "numpy-2.3.4+wheelhouse-py3-none-any.whl",
        "fastapi-0.120.0-py3-none-any.whl",
    ]
    kept, dropped = wheelhouse.drop_target_wheels([Path(n) for n in names], {"numpy"})
    assert [w.name for w in kept] == ["fastapi-0.120.0-py3-none-any.whl"]
    assert len(dropped) == 4


def test_a_manylinux_platform_admits_older_glibc_and_legacy_aliases():
    tags = wheelhouse.expand_platforms(["manylinux_2_28_x86_64"])
    assert {"manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert "manylinux_2_29_x86_64" not in tags and len(tags) == len(set(tags))


def test_only_carries_a_requirements_file_and_drop_leaves_named_dependencies_out(tmp_path):
    """The GPU plan's sets: ``--only FILE`` instead of the project's dependencies; ``--drop NAME`` after the
    download, by canonical name."""
    only = tmp_path / "set.txt"
    only.write_text("# what the target lacks\nray==2.60.0\n\ndiffusers==0.42.1  # the pipeline\n")
    assert wheelhouse.read_requirements(only) == ["ray==2.60.0", "diffusers==0.42.1"]
    names = ["virtualenv-21.0.0-py3-none-any.whl", "py_spy-0.4.3-py2.py3-none-manylinux1_x86_64.whl",
             "fastapi-0.120.0-py3-none-any.whl", "numpy-2.3.4+wheelhouse-py3-none-any.whl"]
    kept, dropped = wheelhouse.drop_target_wheels([Path(n) for n in names], {"numpy"}, {"virtualenv", "py-spy"})
    assert [w.name for w in kept] == ["fastapi-0.120.0-py3-none-any.whl"] and len(dropped) == 3
    args = wheelhouse.parse_args(["build", "--out", "x", "--only", str(only), "--drop", "Py_Spy"])
    assert (args.only, args.drop) == (only, ["Py_Spy"])
