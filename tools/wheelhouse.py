"""Offline install bundles of omni-ray and its runtime dependencies, for machines without internet access.

A bundle ("wheelhouse") is a directory of parts, ``part-01/``, ``part-02/``, ..., each at most ``--limit-mib`` MiB, so
that each part fits one transfer to the target machine. Every part holds a copy of ``manifest.json``, which lists every
wheel with its version, size and sha256 and says which part holds which file; ``part-01/`` also holds this script, so
the bundle installs itself. The same manifest sits at the top of the bundle directory.

Build, on a machine with internet access, from the repository root::

    pip list --format=freeze > have.txt                       # on the target machine
    python tools/wheelhouse.py build --out wheelhouse --python-version 3.12 \\
        --platform manylinux_2_28_x86_64 --have have.txt [--limit-mib 60] [--requirement 'extra>=1' ...]

``build`` carries the dependencies in ``pyproject.toml``'s ``[project].dependencies`` and any given with
``--requirement``, less torch (the target's own is used) and vllm (its CUDA wheel is too big to carry), less every
requirement that a package listed in ``--have`` already satisfies, plus omni-ray itself as a pure-Python wheel. Only
lines of the form ``name==version`` in the have-file count; others (``-e ...``, ``name @ url``) are listed and ignored.
``--only FILE`` carries that requirements file's requirements instead, and no omni-ray wheel: the GPU plan's set
(``tools/gpu_wheels/*.txt``, ``make gpu-wheels``), which travels beside the source tree. ``--drop NAME`` leaves a
downloaded dependency out after all (one that only a feature the target will not use imports).

``pip download`` resolves the dependencies for the target: CPython ``--python-version`` on the ``--platform`` tags,
binary wheels only. A ``manylinux_2_N`` platform also admits every older glibc and its legacy alias (a manylinux_2_28
machine runs manylinux2014 wheels), which pip would otherwise not consider. The packages in the have-file take part in
the resolution as stand-ins at exactly their listed versions: empty wheels without dependencies. So the versions chosen
for the rest agree with what the target has, and nothing that only those packages need (torch's CUDA libraries,
sympy) is downloaded. pip fails, naming the package, when a dependency needs a newer version than the target has;
delete that line from the have-file to carry a newer version. Stand-ins declare no dependencies, so pip cannot check
a carried package against what the target's own packages require of it. pip evaluates environment markers
(``; python_version < "3.12"``) for the Python that runs ``build``, not the target's. After the download, the
stand-ins and any wheel of torch, triton or ``nvidia-*`` are dropped. Without ``--have``, pip downloads torch and its
CUDA libraries (several GB) to resolve, and the bundle also carries torch's smaller dependencies (sympy, networkx,
jinja2 and so on).

Each wheel is then trimmed: its members matching ``TRIMS`` (Ray's Java jars, the dashboard's JavaScript source maps;
fnmatch patterns against the member's full path, where ``*`` also matches ``/``) are removed and its ``RECORD`` loses
their lines. Everything else in the wheel, and its file name, stays as it was; a wheel with nothing to trim is copied
byte for byte. The wheels are then packed into parts; a wheel larger than a part is cut into byte chunks,
``<wheel>.chunk-000``, ``<wheel>.chunk-001``, ..., spread over parts. The build ends with a summary: each wheel's size
before and after trimming, the total, and the parts.

Install, on the target machine, once every part has been copied into one directory (as ``part-NN/`` subdirectories,
or with the parts' contents merged into it)::

    python part-01/wheelhouse.py install DIR [--target DIR] [--python PATH] [--ignore-requires-python]

``install`` checks that every file the manifest names is present and that its sha256 matches, joins the chunks, and
runs ``python -m pip install --no-index --no-deps`` on every wheel: the manifest is the complete set, and omni-ray's own
torch pin would otherwise ask for a torch the bundle does not carry. ``--python`` names the interpreter that runs
pip (default: the one running this script); ``--target`` installs into a directory instead of its environment. It
then reads each distribution's version as that interpreter sees it (under ``--target`` alone, when given), prints a
table, and exits non-zero if any differs from the manifest. When omni-ray's Requires-Python excludes the target's
Python, ``build`` warns and pip refuses omni-ray's wheel unless ``install`` is given ``--ignore-requires-python``.

``python wheelhouse.py list DIR`` prints a bundle's manifest as a table.

``build`` needs the ``packaging`` package; ``install`` and ``list`` need only the standard library.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass
from email.parser import BytesHeaderParser
from pathlib import Path

try:  # `build` only: `install` and `list` run on the target machine with the standard library alone
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:
    HAVE_PACKAGING = False
else:
    HAVE_PACKAGING = True

REPO_ROOT = Path(__file__).resolve().parent.parent
MANIFEST = "manifest.json"
MIB = 1024 * 1024
# Never carried: the target's own torch is used, and vLLM's CUDA wheel is too big to carry.
EXCLUDED_REQUIREMENTS = frozenset({"torch", "vllm"})
# Wheel members removed from every wheel: Java support and the dashboard's source maps, which serving never uses.
TRIMS = ("ray/jars/*", "ray/dashboard/**/*.map")
DEFAULT_PLATFORMS = ("manylinux_2_28_x86_64",)
# The old names of manylinux_2_17, _2_12 and _2_5, which some wheels still carry alone.
LEGACY_MANYLINUX = (("manylinux2014", 17), ("manylinux2010", 12), ("manylinux1", 5))
# Room kept free in every part for manifest.json and (in part-01) this script; `bundle` checks it sufficed.
MANIFEST_ALLOWANCE = 256 * 1024
# Run by the interpreter that received the wheels: {canonical name: version} of the distributions it sees, first
# found first (importlib.metadata.version's rule), under the paths given as arguments when there are any.
VERSIONS_PROBE = """
import importlib.metadata, json, re, sys
dists = importlib.metadata.distributions(path=sys.argv[1:]) if sys.argv[1:] else importlib.metadata.distributions()
versions = {}
for dist in dists:
    versions.setdefault(re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower(), dist.version)
print(json.dumps(versions))
"""


class BundleError(Exception):
    """A bundle cannot be built or installed; the message says why."""


def run(command: list[str], failure: str, **options) -> subprocess.CompletedProcess:
    """``subprocess.run(command, **options)``; a non-zero exit raises BundleError(``failure``).

    The command's own output, left on the terminal, says more.
    """
    result = subprocess.run(command, **options)
    if result.returncode != 0:
        raise BundleError(f"{failure} (exit {result.returncode})")
    return result


# ---------------------------------------------------------------------------------------------------------------------
# What to carry


@dataclass
class Selection:
    """The outcome of comparing the project's requirements with what the target has."""

    carry: list[str]  # requirements to download for the target
    left_out: list[str]  # requirements not carried, each with the reason
    pins: dict[str, Version]  # the target's packages the bundle relies on, by canonical name


def read_have(text: str) -> tuple[dict[str, Version], list[str]]:
    """Parse ``pip freeze`` / ``pip list --format=freeze`` output: ({canonical name: version}, lines ignored).

    Only ``name==version`` lines count; comments and blank lines are skipped, and other lines (editable installs,
    ``name @ url``) are returned so that the caller can say they were ignored.
    """
    have, ignored = {}, []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            ignored.append(line)
            continue
        specifiers = list(requirement.specifier)
        if len(specifiers) != 1 or specifiers[0].operator != "==" or specifiers[0].version.endswith(".*"):
            ignored.append(line)
            continue
        have[canonicalize_name(requirement.name)] = Version(specifiers[0].version)
    return have, ignored


def select_requirements(requirements: list[str], have: dict[str, Version]) -> Selection:
    """Decide which requirements the bundle carries, given the target's packages ``have``.

    torch and vllm are never carried. A requirement that a package in ``have`` satisfies is left out; one that the
    target has in an unsuitable version is carried, and that package is then not among the pins (the bundle replaces
    it). Pre-releases on the target count as satisfying.
    """
    carry, left_out, replaced = [], [], set()
    for text in requirements:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        installed = have.get(name)
        if name in EXCLUDED_REQUIREMENTS:
            left_out.append(f"{text}: never carried")
        elif installed is not None and requirement.specifier.contains(installed, prereleases=True):
            left_out.append(f"{text}: the target has {installed}")
        else:
            carry.append(text)
            replaced.add(name)
    pins = {name: version for name, version in have.items() if name not in replaced}
    return Selection(carry, left_out, pins)


def is_torch_stack(name: str) -> bool:
    """Whether a canonical name is torch or part of the CUDA stack that comes with it: never carried."""
    return name in {"torch", "triton"} or name.startswith("nvidia-")


def drop_target_wheels(wheels: list[Path], pinned: set[str], unwanted: set[str] = frozenset()
                       ) -> tuple[list[Path], list[Path]]:
    """Split downloaded wheels into (kept, dropped): dropped are the target's own packages, torch's stack and the
    ``unwanted`` (canonical names given with ``--drop``)."""
    kept, dropped = [], []
    for wheel in wheels:
        name = parse_wheel_filename(wheel.name)[0]
        (dropped if name in pinned or name in unwanted or is_torch_stack(name) else kept).append(wheel)
    return kept, dropped


# ---------------------------------------------------------------------------------------------------------------------
# Download


def expand_platforms(platforms: list[str]) -> list[str]:
    """The platform tags to give pip: each ``manylinux_2_N_<arch>`` with every older glibc and the legacy aliases.

    pip takes ``--platform`` literally, so a wheel tagged only manylinux2014 would not match manylinux_2_28.
    """
    tags = []
    for platform in platforms:
        match = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
        if match is None:
            tags.append(platform)
            continue
        glibc, arch = int(match[1]), match[2]
        tags += [f"manylinux_2_{minor}_{arch}" for minor in range(glibc, 4, -1)]
        tags += [f"{alias}_{arch}" for alias, minor in LEGACY_MANYLINUX if minor <= glibc]
    return list(dict.fromkeys(tags))


def write_stand_in(directory: Path, name: str, version: Version) -> None:
    """Write an empty wheel without dependencies that stands in for a package the target has, at its version.

    A public version gets the local label ``+wheelhouse``: a constraint ``==version`` still matches it, and pip
    prefers it to the index's wheel of the same version because a local label ranks above none.
    """
    stand_in = str(version) if version.local else f"{version}+wheelhouse"
    stem = f"{name.replace('-', '_')}-{stand_in}"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {stand_in}\n"
    wheel_info = "Wheel-Version: 1.0\nGenerator: wheelhouse\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    with zipfile.ZipFile(directory / f"{stem}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{stem}.dist-info/METADATA", metadata)
        wheel.writestr(f"{stem}.dist-info/WHEEL", wheel_info)


def download(
    requirements: list[str], pins: dict[str, Version], dest: Path, python_version: str, platforms: list[str]
) -> None:
    """``pip download`` the wheels of ``requirements`` and their dependencies for the target into ``dest``.

    ``pins`` take part as stand-ins at exactly their versions (see `write_stand_in`); their wheels land in ``dest``
    too and are dropped afterwards.
    """
    with tempfile.TemporaryDirectory() as tmp:
        stand_ins, constraints = Path(tmp, "stand-ins"), Path(tmp, "constraints.txt")
        stand_ins.mkdir()
        for name, version in pins.items():
            write_stand_in(stand_ins, name, version)
        constraints.write_text("".join(f"{name}=={version}\n" for name, version in pins.items()))
        command = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--implementation", "cp"]
        command += ["--python-version", python_version, "--dest", str(dest)]
        command += [f"--platform={tag}" for tag in expand_platforms(platforms)]
        command += ["--find-links", str(stand_ins), "--constraint", str(constraints), *requirements]
        run(command, "pip download failed. If pip names a conflict with a version pinned by the have-file, the "
                     "target's version is too old for the bundle: delete its line to carry a newer one")


def build_project_wheel(dest: Path) -> Path:
    """Build omni-ray's own pure-Python wheel into ``dest`` and return its path.

    The build runs in a copy of the working tree as git sees it (tracked and unignored files), so that setuptools'
    ``build/`` directory does not land in the checkout.
    """
    command = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    listing = run(command, "git could not list the working tree", cwd=REPO_ROOT, stdout=subprocess.PIPE).stdout.decode()
    with tempfile.TemporaryDirectory() as tmp:
        source, built = Path(tmp, "source"), Path(tmp, "built")
        for relative in filter(None, listing.split("\0")):
            if (REPO_ROOT / relative).is_file():  # a tracked file deleted from the working tree is not
                (source / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO_ROOT / relative, source / relative)
        command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(built), "."]
        run(command, "building omni-ray's wheel failed", cwd=source)
        (wheel,) = built.glob("*.whl")
        return Path(shutil.move(wheel, dest / wheel.name))


def read_requirements(path: Path) -> list[str]:
    """A requirements file's requirements: one a line, ``#`` comments and blank lines skipped."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def read_project(pyproject: Path) -> dict:
    """The ``[project]`` table of a pyproject.toml."""
    return tomllib.loads(pyproject.read_text())["project"]


# ---------------------------------------------------------------------------------------------------------------------
# Trim


def is_record(member: str) -> bool:
    """Whether a wheel member is the RECORD of its top-level .dist-info directory."""
    top, _, rest = member.partition("/")
    return top.endswith(".dist-info") and rest == "RECORD"


def record_path(line: str) -> str:
    """The path field of a RECORD line (a CSV row): "" for a blank line."""
    fields = next(csv.reader([line]), None)
    return fields[0] if fields else ""


def without_record_lines(record: bytes, removed: set[str]) -> bytes:
    """``record`` less the lines of the members in ``removed``; every other line is kept as it was."""
    lines = record.decode().splitlines(keepends=True)
    return "".join(line for line in lines if record_path(line) not in removed).encode()


def trim_wheel(source: Path, dest: Path, patterns: tuple[str, ...] = TRIMS) -> list[str]:
    """Write ``source`` less its members matching ``patterns`` to ``dest``; return the removed members' names.

    The other members keep their content, date, permissions and order, and the RECORD loses the removed members'
    lines. A wheel with nothing to remove is copied byte for byte, keeping its upstream sha256.
    """
    with zipfile.ZipFile(source) as wheel:
        members = wheel.infolist()
        removed = [m.filename for m in members if any(fnmatch.fnmatchcase(m.filename, p) for p in patterns)]
        if not removed:
            shutil.copyfile(source, dest)
            return []
        gone = set(removed)
        with zipfile.ZipFile(dest, "w") as trimmed:
            for member in members:
                if member.filename in gone:
                    continue
                data = wheel.read(member)
                trimmed.writestr(member, without_record_lines(data, gone) if is_record(member.filename) else data)
    return removed


def wheel_identity(wheel: Path) -> tuple[str, str]:
    """(canonical name, version) from a wheel's METADATA: what ``importlib.metadata`` reports once installed."""
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        headers = BytesHeaderParser().parsebytes(archive.read(metadata))
    return canonicalize_name(headers["Name"]), headers["Version"]


# ---------------------------------------------------------------------------------------------------------------------
# Split into parts


@dataclass(frozen=True)
class Piece:
    """A file of the bundle: a whole wheel, or a byte range of one."""

    wheel: str  # the wheel's file name
    file: str  # this piece's file name: the wheel's own, or <wheel>.chunk-NNN
    offset: int
    size: int


def cut(wheel: str, size: int, capacity: int) -> list[Piece]:
    """A wheel of ``size`` bytes as pieces of at most ``capacity`` bytes: itself, or chunks in order."""
    if size <= capacity:
        return [Piece(wheel, wheel, 0, size)]
    return [
        Piece(wheel, f"{wheel}.chunk-{index:03d}", offset, min(capacity, size - offset))
        for index, offset in enumerate(range(0, size, capacity))
    ]


def pack(pieces: list[Piece], capacity: int) -> list[list[Piece]]:
    """Group pieces into as few parts of at most ``capacity`` bytes as first-fit, largest first, finds."""
    parts: list[list[Piece]] = []
    room: list[int] = []
    for piece in sorted(pieces, key=lambda p: (-p.size, p.file)):
        index = next((i for i, free in enumerate(room) if piece.size <= free), len(parts))
        if index == len(parts):
            parts.append([])
            room.append(capacity)
        parts[index].append(piece)
        room[index] -= piece.size
    return parts


def write_piece(source: Path, piece: Piece, dest: Path) -> str:
    """Copy a piece's bytes of ``source`` to ``dest``; return their sha256."""
    with source.open("rb") as wheel:
        wheel.seek(piece.offset)
        data = wheel.read(piece.size)
    dest.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def directory_size(directory: Path) -> int:
    """The total size of the files directly in ``directory``."""
    return sum(f.stat().st_size for f in directory.iterdir() if f.is_file())


def bundle(wheels: list[Path], out: Path, target: dict, limit: int, patterns: tuple[str, ...] = TRIMS) -> dict:
    """Trim ``wheels``, write them into parts of at most ``limit`` bytes under ``out``, and return the manifest.

    Everything after the download happens here, on plain wheel files. ``target`` describes the machine the wheels
    are for and is recorded in the manifest.
    """
    capacity = limit - Path(__file__).stat().st_size - MANIFEST_ALLOWANCE
    if capacity <= 0:
        raise BundleError(f"a part of {limit} bytes leaves no room for wheels")
    with tempfile.TemporaryDirectory() as tmp:
        entries, pieces, sources = [], {}, {}
        for wheel in sorted(wheels, key=lambda w: w.name):
            trimmed = sources[wheel.name] = Path(tmp, wheel.name)
            removed = trim_wheel(wheel, trimmed, patterns)
            name, version = wheel_identity(trimmed)
            size = trimmed.stat().st_size
            entries.append({
                "name": name, "version": version, "filename": wheel.name, "size": size,
                "sha256": hashlib.sha256(trimmed.read_bytes()).hexdigest(),
                "original_size": wheel.stat().st_size, "trimmed_members": len(removed),
            })
            pieces[wheel.name] = cut(wheel.name, size, capacity)
        parts = pack([p for ps in pieces.values() for p in ps], capacity)
        written = {}  # piece file -> its manifest record
        for number, part_pieces in enumerate(parts, 1):
            part = out / f"part-{number:02d}"
            part.mkdir(parents=True)
            for piece in part_pieces:
                digest = write_piece(sources[piece.wheel], piece, part / piece.file)
                written[piece.file] = {"file": piece.file, "part": part.name, "size": piece.size, "sha256": digest}
    for entry in entries:
        entry["pieces"] = [written[piece.file] for piece in pieces[entry["filename"]]]
    manifest = {
        "target": target, "limit_bytes": limit, "trims": list(patterns),
        "parts": [f"part-{n:02d}" for n in range(1, len(parts) + 1)], "wheels": entries,
    }
    write_manifest(manifest, out, limit)
    return manifest


def write_manifest(manifest: dict, out: Path, limit: int) -> None:
    """Write the manifest to ``out`` and every part, this script to part-01, and check every part's size."""
    text = json.dumps(manifest, indent=1) + "\n"
    (out / MANIFEST).write_text(text)
    for part in manifest["parts"]:
        (out / part / MANIFEST).write_text(text)
    shutil.copy2(Path(__file__), out / manifest["parts"][0] / Path(__file__).name)
    for part in manifest["parts"]:
        if directory_size(out / part) > limit:
            raise BundleError(f"{out / part} exceeds {limit} bytes: the manifest outgrew MANIFEST_ALLOWANCE")


def build(args: argparse.Namespace) -> int:
    """The ``build`` command: select, download, trim and split; print a summary."""
    if not HAVE_PACKAGING:
        raise BundleError("build needs the 'packaging' package")
    if args.out.exists() and any(args.out.iterdir()):
        raise BundleError(f"{args.out} is not empty; remove it or choose another --out")
    project = read_project(REPO_ROOT / "pyproject.toml")
    have, ignored = read_have(args.have.read_text()) if args.have else ({}, [])
    have.pop(canonicalize_name(project["name"]), None)  # the bundle always carries the project itself
    if args.only and args.requirement:
        raise BundleError("--requirement adds to the project's dependencies; with --only, write it in the file")
    requirements = read_requirements(args.only) if args.only else project["dependencies"] + args.requirement
    selection = select_requirements(requirements, have)
    if not SpecifierSet(project.get("requires-python", "")).contains(args.python_version):
        print(f"warning: {project['name']} requires Python {project['requires-python']}; the target has "
              f"{args.python_version} (install with --ignore-requires-python)")
    with tempfile.TemporaryDirectory() as tmp:
        downloads = Path(tmp)
        if selection.carry:
            download(selection.carry, selection.pins, downloads, args.python_version, args.platform)
        if not args.only:
            build_project_wheel(downloads)
        unwanted = {canonicalize_name(name) for name in args.drop}
        kept, dropped = drop_target_wheels(sorted(downloads.glob("*.whl")), set(selection.pins), unwanted)
        for name in sorted(unwanted - {parse_wheel_filename(wheel.name)[0] for wheel in dropped}):
            print(f"warning: --drop {name}: no such wheel was downloaded")
        target = {"python_version": args.python_version, "implementation": "cp", "platforms": args.platform}
        manifest = bundle(kept, args.out, target, args.limit_mib * MIB)
    print_build_summary(manifest, args.out, selection, dropped, ignored)
    return 0


def mib(size: int) -> str:
    return f"{size / MIB:.2f} MiB"


def print_build_summary(
    manifest: dict, out: Path, selection: Selection, dropped: list[Path], ignored: list[str]
) -> None:
    """What was left out, each wheel's size before and after trimming, the total, and the parts."""
    for line in ignored:
        print(f"have-file line ignored (not name==version): {line}")
    for line in selection.left_out:
        print(f"left out: {line}")
    if dropped:
        print("dropped after download: " + ", ".join(w.name for w in dropped))
    wheels = manifest["wheels"]
    width = max(len(w["filename"]) for w in wheels)
    print(f"\n{'wheel':<{width}}  {'downloaded':>12}  {'bundled':>12}  trimmed members")
    for w in wheels:
        print(f"{w['filename']:<{width}}  {mib(w['original_size']):>12}  {mib(w['size']):>12}  {w['trimmed_members']}")
    before, after = (sum(w[key] for w in wheels) for key in ("original_size", "size"))
    print(f"{f'total ({len(wheels)} wheels)':<{width}}  {mib(before):>12}  {mib(after):>12}")
    for part in manifest["parts"]:
        print(f"{out / part}: {mib(directory_size(out / part))}, {len(list((out / part).iterdir()))} files")


# ---------------------------------------------------------------------------------------------------------------------
# Install and list


def load_manifest(bundle_dir: Path) -> dict:
    """The manifest in ``bundle_dir`` or in one of its ``part-NN`` subdirectories."""
    for candidate in [bundle_dir / MANIFEST, *sorted(bundle_dir.glob(f"part-*/{MANIFEST}"))]:
        if candidate.is_file():
            return json.loads(candidate.read_text())
    raise BundleError(f"no {MANIFEST} in {bundle_dir} or its part-NN subdirectories")


def locate(bundle_dir: Path, piece: dict) -> Path | None:
    """A piece's file: in its part's subdirectory, or directly in ``bundle_dir`` when the parts were merged."""
    for path in (bundle_dir / piece["part"] / piece["file"], bundle_dir / piece["file"]):
        if path.is_file():
            return path
    return None


def assemble(bundle_dir: Path, entry: dict, dest: Path) -> Path:
    """Join a wheel's verified pieces into ``dest``; raise, naming the file, on a damaged piece or wheel."""
    wheel = dest / entry["filename"]
    with wheel.open("wb") as joined:
        for piece in entry["pieces"]:
            path = locate(bundle_dir, piece)
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() != piece["sha256"]:
                raise BundleError(f"{path}: sha256 differs from the manifest's (damaged, or from another bundle)")
            joined.write(data)
    if hashlib.sha256(wheel.read_bytes()).hexdigest() != entry["sha256"]:
        raise BundleError(f"{entry['filename']}: the joined chunks' sha256 differs from the manifest's")
    return wheel


def installed_versions(python: str, target: Path | None) -> dict[str, str]:
    """{canonical name: version} of the distributions that ``python`` sees (under ``target`` alone, when given)."""
    command = [python, "-c", VERSIONS_PROBE, *([str(target)] if target else [])]
    return json.loads(run(command, "reading the installed versions failed", stdout=subprocess.PIPE).stdout)


def install(args: argparse.Namespace) -> int:
    """The ``install`` command: verify, join, pip install, then check the installed versions."""
    manifest = load_manifest(args.bundle)
    missing = [
        str(args.bundle / piece["part"] / piece["file"])
        for entry in manifest["wheels"] for piece in entry["pieces"] if locate(args.bundle, piece) is None
    ]
    if missing:
        raise BundleError("missing from the bundle: " + ", ".join(missing))
    with tempfile.TemporaryDirectory() as tmp:
        wheels = [assemble(args.bundle, entry, Path(tmp)) for entry in manifest["wheels"]]
        command = [args.python, "-m", "pip", "install", "--no-index", "--find-links", tmp, "--no-deps"]
        command += ["--target", str(args.target)] if args.target else []
        command += ["--ignore-requires-python"] if args.ignore_requires_python else []
        run(command + [str(w) for w in wheels], "pip install failed")
    return check_versions(manifest, installed_versions(args.python, args.target))


def check_versions(manifest: dict, installed: dict[str, str]) -> int:
    """Print bundled against installed versions; 0 if all agree, else 1."""
    width = max(len(w["name"]) for w in manifest["wheels"])
    print(f"\n{'package':<{width}}  {'bundled':<20}  {'installed':<20}")
    mismatches = 0
    for w in manifest["wheels"]:
        found = installed.get(w["name"], "(absent)")
        mismatches += found != w["version"]
        print(f"{w['name']:<{width}}  {w['version']:<20}  {found:<20}  {'ok' if found == w['version'] else 'MISMATCH'}")
    print(f"{len(manifest['wheels']) - mismatches} of {len(manifest['wheels'])} installed as bundled")
    return 1 if mismatches else 0


def list_bundle(args: argparse.Namespace) -> int:
    """The ``list`` command: the manifest as a table."""
    manifest = load_manifest(args.bundle)
    target = manifest["target"]
    print(f"for CPython {target['python_version']} on {', '.join(target['platforms'])}; trims: {manifest['trims']}")
    for w in manifest["wheels"]:
        where = ", ".join(f"{p['part']}/{p['file']}" for p in w["pieces"])
        print(f"{w['name']:<28} {w['version']:<14} {mib(w['size']):>12}  {where}")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    build_parser = commands.add_parser("build", help="download, trim and split the wheels into parts")
    build_parser.add_argument("--out", type=Path, required=True, help="bundle directory (must be empty or absent)")
    build_parser.add_argument("--python-version", default="3.12", help="the target's Python, e.g. 3.12")
    build_parser.add_argument(
        "--platform", action="append",
        help=f"the target's platform tag, repeatable (default: {', '.join(DEFAULT_PLATFORMS)})",
    )
    build_parser.add_argument("--have", type=Path, help="the target's `pip list --format=freeze` output")
    build_parser.add_argument("--limit-mib", type=int, default=60, help="largest part, in MiB (default: 60)")
    build_parser.add_argument(
        "--requirement", action="append", default=[], help="an extra requirement to carry, repeatable"
    )
    build_parser.add_argument(
        "--only", type=Path, help="a requirements file to carry instead of the project's dependencies and its own "
        "wheel (the project then travels as source)"
    )
    build_parser.add_argument(
        "--drop", action="append", default=[], help="a downloaded dependency to leave out after all, repeatable"
    )
    build_parser.set_defaults(run=build)

    install_parser = commands.add_parser("install", help="verify and install a bundle")
    install_parser.add_argument("bundle", type=Path, help="directory holding the part-NN directories or their files")
    install_parser.add_argument("--target", type=Path, help="install into this directory (pip install --target)")
    install_parser.add_argument("--python", default=sys.executable, help="interpreter to install for")
    install_parser.add_argument(
        "--ignore-requires-python", action="store_true", help="passed to pip: install despite Requires-Python"
    )
    install_parser.set_defaults(run=install)

    list_parser = commands.add_parser("list", help="print a bundle's manifest")
    list_parser.add_argument("bundle", type=Path)
    list_parser.set_defaults(run=list_bundle)

    args = parser.parse_args(argv)
    if args.command == "build" and not args.platform:
        args.platform = list(DEFAULT_PLATFORMS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return args.run(args)
    except BundleError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
