import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> pathlib.Path:
    """The tiny checkpoint (seed 0), built once per test session; tests never depend on a user's cache."""
    from omni_ray.checkpoints.tiny import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@pytest.fixture(scope="session")
def edit_dir(tmp_path_factory) -> pathlib.Path:
    """The tiny edit checkpoint (seed 0), written by the command users run:
    `python -m omni_ray.checkpoints.tiny --edit DIR`."""
    from omni_ray.checkpoints.tiny import main

    out = tmp_path_factory.mktemp("ckpt") / "tiny-edit"
    main([str(out), "--edit"])
    return out


@pytest.fixture(scope="session")
def edit_plus_dir(tmp_path_factory) -> pathlib.Path:
    """The tiny Edit-Plus checkpoint (seed 0; Qwen-Image-Edit-2509's pipeline class), written by the command users
    run: `python -m omni_ray.checkpoints.tiny --edit-plus DIR`."""
    from omni_ray.checkpoints.tiny import main

    out = tmp_path_factory.mktemp("ckpt") / "tiny-edit-plus"
    main([str(out), "--edit-plus"])
    return out


@pytest.fixture(scope="session")
def layered_dir(tmp_path_factory) -> pathlib.Path:
    """The tiny Qwen-Image-Layered checkpoint (seed 0), written by the command users run:
    `python -m omni_ray.checkpoints.tiny DIR --layered`."""
    from omni_ray.checkpoints.tiny import main

    out = tmp_path_factory.mktemp("ckpt") / "tiny-layered"
    main([str(out), "--layered"])
    return out


@pytest.fixture(scope="session")
def tiny21_dir(tmp_path_factory) -> pathlib.Path:
    """The tiny Qwen-Image 2.1 checkpoint (seed 0), written by the command users run:
    `python -m omni_ray.checkpoints.tiny DIR --qwen-image-2-1`."""
    from omni_ray.checkpoints.tiny import main

    out = tmp_path_factory.mktemp("ckpt") / "tiny-2.1"
    main([str(out), "--qwen-image-2-1"])
    return out


@pytest.fixture(scope="session")
def tiny_adapters(tiny_dir, tmp_path_factory) -> dict[str, str]:
    """Two LoRA adapters of the tiny checkpoint, by name, of different ranks (the parallel tests)."""
    from testing.lora_files import two_adapters

    return two_adapters(tiny_dir, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def runner(tiny_dir):
    """The tiny checkpoint's DiT runner, one per test module (the engine and cache tests)."""
    from omni_ray.runners.denoise import DenoiseRunner

    return DenoiseRunner.load(str(tiny_dir))


def encode_all(core, requests) -> tuple[dict, int]:
    """Drives an encoder engine core by hand until ``requests`` are encoded: (request id -> result, steps run)."""
    for request in requests:
        core.add_request(request)
    results, steps = {}, 0
    while core.has_unfinished_requests():
        results.update({o.request_id: o.result for o in core.step()})
        steps += 1
    return results, steps


def pytest_configure(config):
    """Under pytest-xdist each worker's torch takes its share of the cores (OMP_NUM_THREADS, which vLLM's and the
    gangs' processes inherit): two workers of two threads each on two cores spent a fifth of the time spinning and
    swapping (``make test-fast``: 433 s against 360 s with one thread each)."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import torch

        torch.set_num_threads(threads)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the groups given here (it was called first)
def pytest_collection_modifyitems(config, items):
    """Tests that start vLLM run last: vLLM binds threads for its whole process, which would slow the rest. Under
    pytest-xdist (``-n``) they are handed out last too, so a worker that has run one runs no other kind after it.
    Those that build a full-width model (``full_width``) go to one worker, one after another (``--dist loadgroup``):
    two at once would pass the CI machine's 24 GiB. The served ones (``serve``) go to one worker too, one cluster at
    a time: each scans the machine's processes for its cluster's, and would find another's."""
    items.sort(key=lambda item: item.get_closest_marker("vllm") is not None)
    for item in items:
        for group in ("full_width", "serve"):
            if item.get_closest_marker(group) is not None:
                item.add_marker(pytest.mark.xdist_group(group))
