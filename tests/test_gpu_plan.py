"""The GPU plan (benchmarks/gpu_plan.py, issue 36) rehearsed on the CPU, so that the first command on a lent GPU does
not die of a typo: each command run end to end with ``--dry-run`` (the tiny checkpoints with random weights, as the
GPU's dummy presets, at toy sizes) writes every file it promises with every phase's figures; a command cut by its
limit names the phase and keeps the ones before it; and what travels with each command fits the device tool's 64 MiB."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from benchmarks import gpu_plan

DEVICE_LIMIT = 64 << 20  # what the device tool carries with one command, the working tree included


def run_plan(command: str, out, *options: str) -> subprocess.CompletedProcess:
    """``bash benchmarks/gpu_plan.sh COMMAND --dry-run`` as the device tool would run it, with no wheels to install."""
    (out / "no-wheels").mkdir(parents=True, exist_ok=True)
    environment = dict(os.environ, OUT=str(out), PYTHON=sys.executable, GPU_PLAN_WHEELS=str(out / "no-wheels"),
                       RAY_AUTH_MODE="disabled")
    return subprocess.run(["bash", "benchmarks/gpu_plan.sh", command, "--dry-run", *options], cwd=REPO,
                          env=environment, capture_output=True, text=True, timeout=600)


def rehearsed(command: str, out, phases: list[str]) -> dict:
    """The command's JSON once its dry run has ended well: every promised file written, every phase done."""
    result = run_plan(command, out)
    assert result.returncode == 0, result.stdout[-4000:]
    for name in (*gpu_plan.PROMISES[command], f"{command}.log"):
        assert (out / name).stat().st_size > 0, name
    assert not list(out.glob("*.partial"))
    record = json.loads((out / gpu_plan.COMMANDS[command][1]).read_text())
    assert (record["failed"], record["phases_skipped"], record["cut"], record["dry_run"]) == ([], [], None, True)
    assert record["environment"]["packages"]["torch"] and record["phases_done"] == phases
    return record


def test_the_profile_command_writes_the_machine_and_every_variant(tmp_path):
    record = rehearsed("profile", tmp_path, ["environment", "packages", "dit_and_vae"])
    assert "torch==" in (tmp_path / "have.txt").read_text()
    report = json.loads((tmp_path / "gpu.json").read_text())
    (size,) = report["sizes"]
    assert [row["batch"] for row in size["dit"]["eager"]] == [1, 2] == [row["batch"] for row in size["dit"]["compiled"]]
    assert size["dit"]["diffusers"][0]["step_s"] > 0 and size["vae_decode_s"] > 0
    assert report["distance"]["compiled"]["64"]["latents_rel_l2"] < 0.05  # compiled agrees with eager
    assert report["fp8_skipped"].startswith("dit.quantization: fp8 needs a CUDA GPU")  # said, not hidden
    assert report["profile"]["64"]["by_class_ms"]["matmul"] > 0 and report["skipped"] == []
    assert record["dit_and_vae"] == {"file": "gpu.json", "skipped": [], "fp8_skipped": report["fp8_skipped"]}


def test_the_small_card_command_measures_each_card_s_dit_and_the_banded_vae(tmp_path):
    """The one-card layout in process: a random Q4_0 GGUF file in the published layout, the DiT unstreamed and as
    each card's preset keeps its blocks (the tiny model's two: both, or one and one streamed), int4 (refused on the
    CPU), the banded decode, the encoder's weights away and back as between its turns on a shared card."""
    record = rehearsed("small_card", tmp_path, ["environment", "weights", "dit_uncapped", "dit_24gib", "dit_16gib",
                                                 "dit_int4", "vae_banded", "encoder_turns"])
    assert record["weights"]["bytes"] > 0
    for phase in ("dit_uncapped", "dit_24gib", "dit_16gib"):
        assert set(record[phase]["batches"]) == {"1", "2"} and all(
            row["step_s"] > 0 for row in record[phase]["batches"].values()), phase
    assert record["dit_uncapped"]["fetches"] == record["dit_24gib"]["fetches"] == 0
    streamed = record["dit_16gib"]
    assert streamed["kept"] == 1 and streamed["fetches"] > 0 and streamed["streamed_bytes_per_step"] > 0
    assert "dit.quantization: int4 runs on CUDA GPUs" in record["dit_int4"]["skipped"]  # the CPU: its refusal
    assert record["vae_banded"]["decode_s"] > 0
    turns = record["encoder_turns"]
    assert turns["weights_bytes"] > 0 and turns["kept_while_away_gib"] == 0 and turns["same_after"], turns
    assert len(turns["away_s"]) == len(turns["back_s"]) == 3


def test_a_command_cut_by_its_limit_names_the_phase_and_keeps_those_before_it(tmp_path):
    result = run_plan("profile", tmp_path, "--limit-s", "6")
    assert result.returncode == 124  # as the device tool's time limit ends a command
    record = json.loads((tmp_path / "gpu_profile.json").read_text())
    phases = ["environment", "packages", "dit_and_vae"]
    cut = phases.index(record["cut"]["phase"])
    assert record["phases_done"] == phases[:cut] and all(phase in record for phase in phases[:cut])
    assert record["cut"]["at_s"] >= 6 and f"[{phases[cut]}] cut at" in (tmp_path / "profile.log").read_text()
    assert not list(tmp_path.glob("*.partial"))


def test_a_failed_phase_is_recorded_one_past_the_budget_skipped_and_a_required_one_ends_the_command(tmp_path):
    record = gpu_plan.Record(tmp_path / "plan.json", "test", True, budget_s=30)  # no watchdog in this process
    record.phase("first", lambda: {"figure": 1})
    assert record.phase("late", lambda: {"figure": 2}, needs_s=60) is None
    assert record.phase("broken", lambda: 1 / 0) is None  # recorded; the command goes on
    with pytest.raises(gpu_plan.PhaseFailed):
        record.phase("needed", lambda: {}["missing"], required=True)
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert (saved["first"], saved["phases_done"], saved["phases_skipped"]) == ({"figure": 1}, ["first"], ["late"])
    assert [failure["phase"] for failure in saved["failed"]] == ["broken", "needed"]
    assert "ZeroDivisionError" in saved["failed"][0]["error"] and "KeyError" in saved["failed"][1]["error"]


@pytest.mark.serve
def test_the_serve_command_measures_served_in_process_and_diffusers(tmp_path):
    record = rehearsed("serve", tmp_path, ["environment", "start", "latency", "throughput", "in_process", "diffusers"])
    assert set(record["start"]["replicas"]) == {"Coordinator", "Encoder", "DiT", "VAE"}
    for phase, concurrency in (("latency", 1), ("throughput", 8)):
        figures = record[phase]
        assert (figures["ok"], figures["errors"], figures["concurrency"]) == (figures["requests"], {}, concurrency)
        assert figures["requests_per_s"] > 0 and set(figures["stage_ms_mean"]) == {"encoder", "dit", "vae"}
        assert figures["cpu_ms_per_image"]["coordinator"] >= 0
        assert set(figures["gpu_memory"]["by_process_mib"]) == set(record["start"]["replicas"])
    assert record["in_process"]["latency_s"]["mean"] > 0 and record["diffusers"]["latency_s"]["mean"] > 0
    assert record["served_over_in_process"] > 0
    assert "POST /v1/images/generations 200" in (tmp_path / "app.log").read_text()  # the app's own log


@pytest.mark.serve
def test_the_reliability_command_kills_the_dit_once_and_loses_nothing(tmp_path):
    record = rehearsed("reliability", tmp_path, ["environment", "start", "baseline", "requests", "after"])
    assert record["baseline"]["problems"] == [] == record["after"]["problems"]  # the replacement DiT serves
    requests = record["requests"]
    assert (requests["answered"], requests["lost"], requests["problems"]) == (requests["requests"], 0, [])
    assert requests["killed"]["replaced_by"] not in (None, requests["killed"]["pid"])
    assert set(requests["gpu_memory_before_kill"]) >= {"used_mib", "by_process_mib"}  # None here: no nvidia-smi
    assert record["after"]["change_mib"] is None and record["start"]["gpu_memory_before"]["used_mib"] is None
    assert requests["kinds"]["invalid"] > 0 and requests["kinds"]["streamed"] > 0 and requests["kinds"]["cancelled"] > 0


@pytest.mark.serve
def test_the_qwen21_command_serves_and_times_the_condition_cache(tmp_path):
    record = rehearsed("qwen21", tmp_path, ["environment", "start", "generation", "edit", "condition_cache"])
    assert record["generation"]["ok"] == record["generation"]["requests"] == record["edit"]["ok"]
    assert "vae_encode" in record["edit"]["stage_ms_mean"]  # the condition image went through the VAE's encoder
    cache = record["condition_cache"]
    assert cache["edit"]["cache_bytes"] > cache["generation"]["cache_bytes"] > 0
    assert all(len(cache[kind]["step_times_s"]) == 4 for kind in ("generation", "edit"))


@pytest.mark.parametrize("wheels", ["profile", "serve"])
def test_each_command_s_wheels_and_the_working_tree_fit_what_the_device_tool_carries(wheels):
    """The wheel sets as ``make gpu-wheels`` last built them (tools/gpu_wheels/*.manifest.json) and the tracked
    tree as it is now: a commit that grows either past the limit fails here, not on the GPU machine."""
    manifest_path = REPO / "tools" / "gpu_wheels" / f"{wheels}.manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["target"]["python_version"] == "3.12" and len(manifest["parts"]) == 1
    bundle = sum(w["size"] for w in manifest["wheels"]) + manifest_path.stat().st_size
    bundle += (REPO / "tools" / "wheelhouse.py").stat().st_size
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    tree = sum((REPO / name).stat().st_size for name in listed.decode().split("\0") if (REPO / name).is_file())
    assert tree + bundle < DEVICE_LIMIT - (2 << 20), f"{(tree + bundle) / 2**20:.1f} MiB"  # 2 MiB to spare
    names = {w["name"] for w in manifest["wheels"]}
    assert {"diffusers", "pydantic"} <= names and ("ray" in names) == (wheels == "serve")
    assert not names & {"torch", "transformers", "numpy", "virtualenv", "cryptography"}
