"""LoRA adapters in the DiT engine on the small checkpoint: a mixed-adapter stream batched together against the same
requests served one adapter per batch, and what LoRA adds to a step.

    python -m benchmarks.lora [--size 128x128] [--steps 8] [--rank 16] [--out benchmarks/results/lora.json]

1. Stream: 16 requests at once (true CFG), round robin over 4 adapters, into one DiT engine (max batch 8) driven as
   the served DiT drives it (``AsyncEngine``). "mixed" is our scheduler: any adapters share a step. "one adapter per
   batch" is the same engine with the adapter added to the batch key, as systems that batch only requests of one
   adapter do (vLLM-Omni's diffusion LoRA); it steps one adapter's 4 requests at a time and switches between them.
2. Per step: one engine step of a batch of b requests (true CFG) with no adapter resident, with 4 resident and no
   row using one, and with every row using one (4 adapters among the rows).

The adapters have random weights (made with peft, as the tests make theirs); rank and targets are what the speed
depends on, not the values.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import tempfile
import time
import uuid

from benchmarks import write_report
from benchmarks.engine_throughput import PROMPTS, RESULTS, machine, save_figure

NEGATIVE = "blurry, low quality"
NUM_ADAPTERS = 4


def run(size: tuple[int, int], steps: int, rank: int, concurrency: int, repeats: int) -> dict:
    import torch

    from omni_ray.checkpoints.tiny import write_checkpoint
    from omni_ray.engine.async_engine import AsyncEngine
    from omni_ray.engine.core import DiTEngineCore
    from omni_ray.engine.dit_scheduler import DiTScheduler
    from omni_ray.engine.lora_residency import LoraResidency
    from omni_ray.records import DenoiseParams, DenoiseRequest, LoraRef, stack_id
    from omni_ray.runners.denoise import DenoiseRunner
    from omni_ray.runners.lora import AdapterFiles, read_lora
    from testing.lora_files import TARGETS, make_adapter
    from testing.reference import PromptEncoder

    class OneAdapterPerBatch(DiTScheduler):
        def batch_key(self, request):
            return (*request.batch_key, stack_id(request.params.loras))

    torch.set_num_threads(max(1, torch.get_num_threads()))
    checkpoint = pathlib.Path.home() / ".cache" / "omni-ray" / "bench-small"
    if not (checkpoint / "model_index.json").exists():
        write_checkpoint(checkpoint, seed=0, size="small")
    folder = pathlib.Path(tempfile.mkdtemp(prefix="omni-ray-lora-bench-"))
    paths = [str(make_adapter(checkpoint, folder / f"style{i}", rank=rank, seed=i)) for i in range(NUM_ADAPTERS)]
    adapters = [LoraRef(f"style{i}", path) for i, path in enumerate(paths)]
    encoder = PromptEncoder(str(checkpoint))
    embeds, (negative,) = encoder.encode([PROMPTS[i % len(PROMPTS)] for i in range(concurrency)]), encoder.encode(
        [NEGATIVE])
    height, width = size
    runner = DenoiseRunner.load(str(checkpoint), max_loras=NUM_ADAPTERS)
    layers = [read_lora(path, runner.lora_shapes) for path in paths]

    def request(i: int, lora, num_steps: int = steps) -> DenoiseRequest:
        params = DenoiseParams(height, width, num_steps, 1000 + i, 4.0, loras=(lora,) if lora else (), true_cfg=True)
        return DenoiseRequest(uuid.uuid4().hex, params, embeds[i % len(embeds)], negative)

    def stream(scheduler_class) -> float:
        """Seconds for ``concurrency`` requests sent at once, adapters round robin, through the async engine."""
        engine = AsyncEngine(lambda: DiTEngineCore(scheduler_class(max_batch_size=8, max_wait_steps=steps), runner),
                             "dit").start()
        residency = LoraResidency(engine, NUM_ADAPTERS, AdapterFiles(paths))

        async def one(i: int) -> None:
            lora = adapters[i % NUM_ADAPTERS]
            async with residency.use(lora):
                await engine.generate(request(i, lora))

        async def all_at_once() -> float:
            for lora in adapters:  # resident before the clock starts: loading is not what is compared
                async with residency.use(lora):
                    pass
            start = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(concurrency)))
            return time.perf_counter() - start

        try:
            return min(asyncio.run(all_at_once()) for _ in range(repeats))
        finally:
            engine.shutdown()
            for lora in adapters:
                runner.remove_lora(lora.key)

    def step_seconds(batch: int, loras: list, timed: int = 10) -> float:
        """One engine step (after the first, which prepares) of ``batch`` requests, the fastest of ``timed``."""
        core = DiTEngineCore(DiTScheduler(max_batch_size=batch, max_wait_steps=steps), runner)
        for i in range(batch):
            core.add_request(request(i, loras[i % len(loras)], timed + 2))
        core.step()
        times = []
        for _ in range(timed):
            start = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - start)
        core.abort_requests(list(core.scheduler.entries))
        core.step()
        return min(times)

    stream(DiTScheduler)  # warm-up
    mixed = stream(DiTScheduler)
    per_adapter = stream(OneAdapterPerBatch)
    print(f"{concurrency} concurrent over {NUM_ADAPTERS} adapters: mixed {concurrency / mixed:.2f} img/s, one adapter "
          f"per batch {concurrency / per_adapter:.2f} img/s (x{per_adapter / mixed:.2f})", flush=True)

    steps_rows = []
    for batch in (1, 2, 4, 8):
        base = step_seconds(batch, [None])
        for lora, layer in zip(adapters, layers):
            runner.add_lora(lora.key, layer)
        resident_unused = step_seconds(batch, [None])
        adapted = step_seconds(batch, adapters)
        for lora in adapters:
            runner.remove_lora(lora.key)
        steps_rows.append({"batch": batch, "no_lora_s": base, "resident_unused_s": resident_unused,
                           "every_row_lora_s": adapted, "lora_overhead": adapted / base - 1})
        print(f"batch {batch}: step {1000 * base:.1f} ms without LoRA, {1000 * resident_unused:.1f} ms with 4 "
              f"resident and unused, {1000 * adapted:.1f} ms with an adapter on every row "
              f"(+{100 * (adapted / base - 1):.0f}%)", flush=True)
    return {
        "checkpoint": "small", "height": height, "width": width, "steps": steps, "rank": rank,
        "adapters": NUM_ADAPTERS, "concurrency": concurrency, "max_batch_size": 8, "true_cfg": True,
        "stream": {"mixed_s": mixed, "mixed_img_s": concurrency / mixed, "one_adapter_per_batch_s": per_adapter,
                   "one_adapter_per_batch_img_s": concurrency / per_adapter, "speedup": per_adapter / mixed},
        "step": steps_rows, "machine": machine(),
        "lora_linear_flops_share": {"small": lora_flops_share(runner.lora_shapes, rank, TARGETS), **flops_shares(rank)},
    }


def lora_flops_share(shapes: dict[str, tuple[int, int]], rank: int, targets: tuple[str, ...]) -> float:
    """What an adapter of ``rank`` on ``targets`` adds to the FLOPs of the transformer's Linear layers (per token:
    r * (in + out) against in * out); attention's own FLOPs, which grow with the tokens, are left out."""
    base = sum(i * o for i, o in shapes.values())
    adapted = sum(rank * (i + o) for name, (i, o) in shapes.items() if any(name.endswith("." + t) for t in targets))
    return adapted / base


def flops_shares(rank: int) -> dict:
    """The LoRA FLOP share for the small checkpoint and for Qwen-Image at full size (built on the meta device)."""
    from torch import nn

    from testing.full_size import build_meta
    from testing.lora_files import TARGETS

    full = build_meta()["transformer"]
    shapes = {n: (m.in_features, m.out_features) for n, m in full.named_modules() if isinstance(m, nn.Linear)}
    return {"full_size": lora_flops_share(shapes, rank, TARGETS)}


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    stream = report["stream"]
    bars = left.bar(["mixed adapters\nin a step", "one adapter\nper batch"],
                    [stream["mixed_img_s"], stream["one_adapter_per_batch_img_s"]], color=["tab:green", "tab:gray"])
    left.bar_label(bars, fmt="%.2f")
    left.set_ylabel("images / s")
    left.set_title(f"{report['concurrency']} concurrent, {report['adapters']} adapters (rank {report['rank']}), "
                   f"{report['width']}x{report['height']}, {report['steps']} steps, CFG", fontsize=9)
    rows = report["step"]
    batches = [r["batch"] for r in rows]
    for key, label in (("no_lora_s", "no LoRA"), ("resident_unused_s", "4 resident, unused"),
                       ("every_row_lora_s", "an adapter on every row")):
        right.plot(batches, [1000 * r[key] for r in rows], marker="o", label=label)
    right.set_xlabel("requests in the step (true CFG: 2 rows each)")
    right.set_ylabel("ms per step")
    right.set_xticks(batches)
    right.set_title("one DiT step, small checkpoint", fontsize=9)
    right.legend(fontsize=8)
    save_figure(fig, report["machine"], path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="128x128", help="WxH")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="runs per measurement; the fastest counts")
    parser.add_argument("--out", default=str(RESULTS / "lora.json"))
    args = parser.parse_args()
    width, height = (int(side) for side in args.size.split("x"))
    write_report(run((height, width), args.steps, args.rank, args.concurrency, args.repeats), args.out, plot)


if __name__ == "__main__":
    main()
