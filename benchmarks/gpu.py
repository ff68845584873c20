"""The DiT and VAE stages at Qwen-Image's full size on one GPU, against diffusers on the same weights, in one run.

    python -m benchmarks.gpu                          # on a machine with a CUDA GPU: every variant, JSON and a plot
    python -m benchmarks.gpu --profile                # where one step's time goes, by kernel class
    python -m benchmarks.gpu --counts                 # any machine: parameter counts (every published config folder)
                                                      # and the shared preset's placement

On a lent GPU machine this runs as the GPU plan's first command (``benchmarks/gpu_plan.py``: ``profile``), which
writes the report after each phase and rehearses it on the CPU at toy sizes.

No checkpoint can be downloaded here, so both models are built from Qwen-Image's published architecture with random
bf16 weights, directly on the GPU. For each size (512, 1024, 1328 square), true CFG on, the time of one denoising step
(the best of a few after a warm-up) of:

- ``diffusers``: ``QwenImagePipeline``'s eager denoise loop, one request (two transformer forwards a step, diffusers'
  own attention processor), per step from a ``--steps`` run to latents;
- ``eager``: ``DenoiseRunner.step`` on b requests at once (b = 1, 2, 4, 8), CFG's two passes in one forward;
- ``compiled``: the same with ``dit.compile`` (regional compilation, warmed up first; the compile time is reported);
- ``fp8``: the same with ``dit.quantization: fp8`` as well (needs torchao and compute capability 8.9+);

with the achieved TFLOP/s against ``2*6.79e9*N + 4*60*3072*N^2`` FLOPs per pass (N image plus text tokens) and the
device's peak, and peak GPU memory; the VAE decode of one image, ours (``VaeRunner``) and diffusers'
(``AutoencoderKLQwenImage.decode``); and the distance of compiled and FP8 steps to eager bf16 ones (latents after
one step from the same state, and the decoded pixels in uint8 levels). ``--profile`` adds, at 1024 and 1328, one eager
step's GPU time by kernel class (matmul, attention, elementwise/norm, copies) and the time the GPU sat idle between
kernels (launch gaps), from torch's profiler. Prompt embeddings are random ``[L, 3584]`` (L = ``--text-tokens``): the
encoder stage is not measured. Writes JSON (and a plot beside it).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

from benchmarks import write_report
from omni_ray.checkpoints.full_size import BASE_CONFIGS, CONFIG_DIR, published_configs
from omni_ray.families.qwen_image.facts import LATENT_CHANNELS, PUBLISHED_PARAMS, TEXT_HIDDEN, image_tokens
from omni_ray.runners.gpu_costs import dit_pass_flops
from testing.full_size import parameter_counts

_SCHEDULER_FILE = CONFIG_DIR / "scheduler" / "scheduler_config.json"
SCHEDULER_CONFIG = {k: v for k, v in json.loads(_SCHEDULER_FILE.read_text()).items() if not k.startswith("_")}
FULL_LAYERS = 60
VARIANTS = ("diffusers", "eager", "compiled", "fp8")
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense, per the vendor's data sheets


def dit_flops(height: int, width: int, text_tokens: int, passes: int) -> float:
    """The DiT forward's FLOPs (``runners.gpu_costs.dit_pass_flops``) for ``passes`` rows of one image."""
    return passes * dit_pass_flops(image_tokens(height, width) + text_tokens)


def build(device: str, num_layers: int):
    import torch
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    transformer_config = QwenImageTransformer2DModel.load_config(CONFIG_DIR / "transformer")
    transformer_config["num_layers"] = num_layers
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):  # random weights made on the GPU, in bf16: never 80 GB of fp32 on the host
        transformer = QwenImageTransformer2DModel.from_config(transformer_config)
        vae = AutoencoderKLQwenImage.from_config(AutoencoderKLQwenImage.load_config(CONFIG_DIR / "vae"))
    torch.set_default_dtype(torch.float32)
    return transformer.eval(), vae.eval()


def timed(fn, repeats: int) -> float:
    """The best of ``repeats`` runs of ``fn`` after one warm-up, in seconds, with the GPU synchronised."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        _synchronize()
        start = time.perf_counter()
        fn()
        _synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_gib() -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None


def _reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


KERNEL_CLASSES = (  # first match wins; names as CUDA profiles spell them (cuBLAS, CUTLASS, cuDNN, Triton, ATen)
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa", "mha")),
    ("matmul", ("gemm", "cutlass", "xmma", "sm90", "cublas", "matmul", "_mm", "addmm", "linear")),
    ("copies", ("memcpy", "memset", "copy", "cat", "clone", "contiguous")),
    ("elementwise/norm", ("",)),
)


def kernel_class(name: str) -> str:
    """The class a kernel's name falls in: attention, matmul, copies, or elementwise/norm (everything else)."""
    lowered = name.lower()
    return next(kind for kind, marks in KERNEL_CLASSES if any(mark in lowered for mark in marks))


def profile_step(step, repeats: int = 3) -> dict:
    """One step's device time by kernel class, and the wall time the device sat idle (launch gaps), in ms; the
    mean of ``repeats`` profiled steps after a warm-up."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()
    _synchronize()
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        _synchronize()
        wall_ms = 1000 * (time.perf_counter() - start) / repeats
    classes: dict[str, float] = {kind: 0.0 for kind, _ in KERNEL_CLASSES}
    for event in prof.events():
        is_kernel = event.device_type.name == "CUDA" if cuda else event.cpu_parent is None
        if is_kernel:
            us = event.device_time if cuda else event.cpu_time_total
            classes[kernel_class(event.name)] += us / 1000 / repeats
    busy = sum(classes.values())
    return {"wall_ms": round(wall_ms, 2), "by_class_ms": {k: round(v, 2) for k, v in classes.items()},
            "launch_gaps_ms": round(max(wall_ms - busy, 0.0), 2) if cuda else None}


def _levels(a, b) -> int:
    return int((a.astype(int) - b.astype(int)).__abs__().max())


def run(sizes: list[int], batches: list[int], steps: int, text_tokens: int, repeats: int, num_layers: int,
        variants: list[str], profile_sizes: list[int], save=lambda report: None, deadline: float = float("inf")
        ) -> dict:
    """Every variant's figures; ``save(report)`` is called as each phase ends (diffusers, each of ours, the VAE),
    and a phase that would start after ``deadline`` (``time.monotonic``) is skipped and named in
    ``report["skipped"]``. ``configs``: the models' config folder (the tiny checkpoint's for a rehearsal)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

    from omni_ray.records import DenoiseParams, Latents, PromptEmbeds
    from omni_ray.runners.attention import use_real_rope
    from omni_ray.runners.denoise import DenoiseRunner, compile_blocks
    from omni_ray.runners.quantization import quantize_fp8
    from omni_ray.runners.vae import VaeRunner

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only to try the script at a few layers
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = next((tflops for key, tflops in PEAK_BF16_TFLOPS.items() if key in name), None)
    start = time.perf_counter()
    transformer, vae = build(device, num_layers)
    report = {
        "device": name, "torch": torch.__version__, "peak_bf16_tflops": peak, "steps": steps,
        "text_tokens": text_tokens, "build_s": round(time.perf_counter() - start, 1),
        "params": {"transformer": sum(p.numel() for p in transformer.parameters()),
                   "vae": sum(p.numel() for p in vae.parameters())},
        "num_layers": num_layers, "variants": variants, "sizes": [], "compile_s": None, "distance": {},
        "fp8_skipped": None, "skipped": [],
        "attention_backend": None, "profile": {},
        "weights_gib": round(torch.cuda.memory_allocated() / 2**30, 2) if device == "cuda" else None,
    }
    print(f"{name}: built in {report['build_s']} s, {report['weights_gib']} GiB of weights", flush=True)
    generator = torch.Generator().manual_seed(0)
    embeds = [PromptEmbeds(torch.randn(text_tokens, TEXT_HIDDEN, generator=generator)) for _ in range(2 * max(batches))]
    entries = {side: {"size": side, "dit": {v: [] for v in variants}} for side in sizes}
    decoder = VaeRunner(vae)
    latents_of = {side: Latents(torch.randn(image_tokens(side, side), LATENT_CHANNELS, generator=generator), side, side)
                  for side in sizes}

    def states_for(runner, side, b):
        params = [DenoiseParams(side, side, 1000, seed=i, true_cfg_scale=4.0, true_cfg=True) for i in range(b)]
        return [runner.prepare(p, embeds[2 * i], embeds[2 * i + 1]) for i, p in enumerate(params)]

    def one_step_latents(runner, side):  # [1, tokens, 64] after one step from the seed-0 noise
        (state,) = states_for(runner, side, 1)
        runner.step([state])
        return state.latents.float()

    def phase_ends() -> None:
        report["sizes"] = list(entries.values())
        save(report)

    def in_time(phase: str) -> bool:
        if time.monotonic() < deadline:
            return True
        report["skipped"].append(phase)
        print(f"{phase} skipped: the command's time is up", flush=True)
        return False

    # 1. diffusers' own loop, its own attention processor
    if "diffusers" in variants and in_time("diffusers"):
        transformer.set_attn_processor(QwenDoubleStreamAttnProcessor2_0())
        pipe = QwenImagePipeline(FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), vae, None, None, transformer)
        pipe.set_progress_bar_config(disable=True)
        for side in sizes:
            def loop():
                pipe(prompt_embeds=embeds[0].embeds[None].to(device, torch.bfloat16),
                     prompt_embeds_mask=torch.ones(1, text_tokens, dtype=torch.long, device=device),
                     negative_prompt_embeds=embeds[1].embeds[None].to(device, torch.bfloat16),
                     negative_prompt_embeds_mask=torch.ones(1, text_tokens, dtype=torch.long, device=device),
                     true_cfg_scale=4.0, height=side, width=side, num_inference_steps=steps,
                     generator=torch.Generator("cpu").manual_seed(0), output_type="latent")

            _reset_peak()
            seconds = timed(loop, 1) / steps
            entries[side]["dit"]["diffusers"].append(_dit_row(1, seconds, side, text_tokens, num_layers, peak))
            unpacked = latents_of[side].latents[None].to(device)
            unpacked = unpacked.view(1, side // 16, side // 16, 16, 2, 2).permute(0, 3, 1, 4, 2, 5)
            unpacked = unpacked.reshape(1, 16, 1, side // 8, side // 8).to(torch.bfloat16)
            with torch.inference_mode():
                entries[side]["vae_decode_diffusers_s"] = round(timed(lambda: vae.decode(unpacked), repeats), 4)
            print(f"{side}: diffusers {1000 * seconds:.0f} ms a step, VAE decode "
                  f"{1000 * entries[side]['vae_decode_diffusers_s']:.0f} ms", flush=True)
        phase_ends()
        use_real_rope(transformer)
    runner = DenoiseRunner(transformer, SCHEDULER_CONFIG)
    if device == "cuda":
        report["attention_backend"] = attention_backend(transformer, text_tokens + image_tokens(1024, 1024))

    # 2. ours: eager, then compiled, then FP8 on top (each changes the transformer in place)
    reference = {side: one_step_latents(runner, side) for side in sizes}
    for variant in [v for v in ("eager", "compiled", "fp8") if v in variants]:
        if not in_time(variant):
            continue
        if variant == "compiled":
            compile_blocks(transformer)  # as dit.compile does
            report["compile_s"] = round(runner.warm_up(sizes[0], sizes[0], text_tokens), 1)
        if variant == "fp8":
            try:
                quantize_fp8(transformer)  # the compiled blocks compile again for the float8 weights
            except RuntimeError as err:  # no float8 tensor cores, or no torchao: say so and go on
                report["fp8_skipped"] = str(err)
                print(f"fp8 skipped: {err}", flush=True)
                continue
            runner.warm_up(sizes[0], sizes[0], text_tokens)
        if variant != "eager":
            report["distance"][variant] = {}
            for side in sizes:
                got = one_step_latents(runner, side)
                pixels = decoder.decode([Latents(got[0].cpu(), side, side)])
                expected = decoder.decode([Latents(reference[side][0].cpu(), side, side)])
                report["distance"][variant][side] = {
                    "latents_max_abs": float((got - reference[side]).abs().max()),
                    "latents_rel_l2": float((got - reference[side]).norm() / reference[side].norm()),
                    "pixels_max_levels": _levels(pixels, expected)}
        for side in sizes:
            for b in batches:
                _reset_peak()
                states = states_for(runner, side, b)
                seconds = timed(lambda: runner.step(states), repeats)
                entries[side]["dit"][variant].append(_dit_row(b, seconds, side, text_tokens, num_layers, peak))
                print(f"{side}: {variant} step at b={b}: {1000 * seconds:.0f} ms "
                      f"({entries[side]['dit'][variant][-1]['tflops']} TFLOP/s)", flush=True)
            if variant == "eager" and side in profile_sizes:
                states = states_for(runner, side, 1)
                report["profile"][side] = profile_step(lambda: runner.step(states))
                print(f"{side}: profile {report['profile'][side]}", flush=True)
        phase_ends()

    # 3. the VAE
    for side in sizes if in_time("vae") else []:
        _reset_peak()
        entries[side]["vae_decode_s"] = round(timed(lambda: decoder.decode([latents_of[side]]), repeats), 4)
        entries[side]["vae_peak_memory_gib"] = _peak_gib()
        print(f"{side}: VAE decode {1000 * entries[side]['vae_decode_s']:.0f} ms", flush=True)
    phase_ends()
    return report


def _dit_row(batch: int, seconds: float, side: int, text_tokens: int, num_layers: int, peak: float | None) -> dict:
    flops = batch * dit_flops(side, side, text_tokens, passes=2) * num_layers / FULL_LAYERS
    return {"batch": batch, "step_s": round(seconds, 4), "step_s_per_image": round(seconds / batch, 4),
            "tflops": round(flops / seconds / 1e12, 1),
            "share_of_peak": round(flops / seconds / 1e12 / peak, 3) if peak else None,
            "peak_memory_gib": _peak_gib()}


def attention_backend(transformer, tokens: int) -> str:
    """The kernel ``scaled_dot_product_attention`` picks for the joint attention's shapes on this GPU (cuDNN, flash,
    memory-efficient or math), as PyTorch decides it: checked, not assumed."""
    import torch
    from torch.nn.attention import SDPBackend

    heads = transformer.config.num_attention_heads
    head_dim = transformer.config.attention_head_dim
    q = torch.empty(1, heads, tokens, head_dim, device="cuda", dtype=torch.bfloat16)
    choice = torch._fused_sdp_choice(q, q, q)
    return SDPBackend(choice).name


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"diffusers": "s--", "eager": "o:", "compiled": "o-", "fp8": "^-"}
    for entry in report["sizes"]:
        for variant, rows in entry["dit"].items():
            if not rows:
                continue
            label = f"{entry['size']} {variant}"
            left.plot([r["batch"] for r in rows], [r["step_s_per_image"] * 1000 for r in rows], styles[variant],
                      label=label)
            right.plot([r["batch"] for r in rows], [r["tflops"] for r in rows], styles[variant], label=label)
    left.set(xlabel="requests per DiT step", ylabel="ms per image per step (true CFG)", xscale="log", yscale="log")
    right.set(xlabel="requests per DiT step", ylabel="achieved TFLOP/s", xscale="log")
    if report["peak_bf16_tflops"]:
        right.axhline(report["peak_bf16_tflops"], ls="--", c="grey", label="bf16 peak")
    batches = sorted({row["batch"] for entry in report["sizes"] for rows in entry["dit"].values() for row in rows})
    for ax in (left, right):
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle(f"Qwen-Image DiT at full size, random bf16 weights: {report['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


SHARED_PRESET = "stage_configs/qwen_image_shared.yaml"


def counts() -> dict:
    """The full-size models built on the meta device from the shipped configs: parameter counts against the
    published ones (``params`` Qwen-Image's; ``params_by_configs`` each published configs folder's, which
    share Qwen-Image's shapes but qwen-image-2.1's, another architecture); and the shared-GPU preset's placement
    check, stage by stage (any machine, seconds)."""
    from dataclasses import asdict

    from omni_ray.config import load_config
    from omni_ray.placement import stage_memory

    by_configs = {configs: parameter_counts(configs) for configs in published_configs()}
    params = by_configs[BASE_CONFIGS]
    shared = load_config(pathlib.Path(__file__).resolve().parent.parent / SHARED_PRESET)  # raises if it cannot fit
    return {"params": params, "params_by_configs": by_configs, "published_params": PUBLISHED_PARAMS,
            "params_off_published": {name: round(params[name] / PUBLISHED_PARAMS[name] - 1, 5) for name in params},
            "placement": {"preset": SHARED_PRESET, "gpu_memory_gib": shared.gpu_memory_gib,
                          "stages": [{**asdict(estimate), "fits": estimate.fits}
                                     for estimate in stage_memory(shared, shared.gpu_memory_gib)]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[512, 1024, 1328])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=20, help="steps of the end-to-end requests")
    parser.add_argument("--text-tokens", type=int, default=64, help="prompt length after the template")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=60, help="transformer blocks (60 is Qwen-Image; fewer to try)")
    parser.add_argument("--out", default="benchmarks/results/gpu.json")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--profile", action="store_true", help="break one eager step down by kernel class")
    parser.add_argument("--profile-sizes", nargs="+", type=int, default=[1024, 1328])
    parser.add_argument("--counts", action="store_true",
                        help="no GPU: build the full-size models on the meta device and write their sizes")
    args = parser.parse_args()
    if args.counts:
        report = counts()
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report, indent=1))
        return
    report = run(args.sizes, args.batches, args.steps, args.text_tokens, args.repeats, args.layers, args.variants,
                 args.profile_sizes if args.profile else [])
    write_report(report, args.out, plot)


if __name__ == "__main__":
    main()
