"""One small card: the DiT's step with its blocks streamed (``dit.offload``), modelled from published figures, not
measured (no such card here; the GPU plan's ``small_card`` command measures it on an H100 capped to 24 and 16 GiB).

    python -m benchmarks.small_card [--out benchmarks/results/small_card.json]

The model. A step of ``b`` true-CFG images computes ``b * compute_s`` (a card that one image already fills: our H200
runs 1024x1024 at 267 ms a step alone and 259 per image at eight, benchmarks/results/gpu.json), spread evenly over
the 60 blocks. A streamed block's copy (its share of the GGUF file over the host link) is issued one block ahead, so
it hides behind the block computing when it is the shorter, and the step waits for it when it is the longer:
``step = kept * c + streamed * max(c, t)`` for ``c`` a block's compute and ``t`` its copy, ``kept`` blocks on the card
(``blocks_on_gpu``, the first always) and the rest streamed. So a batch pays for streaming: ``c`` grows with the rows
and ``t`` does not.

The figures: the DiT at Q4_K on an RTX 4090, 1.19 s a 1024x1024 step (edge-dit.cpp's docs/performance-4090.md, its
ggml kernels, not ours), 4.6 times less at 512x512 (the tokens' ratio, 4,096 to 1,024, less the attention's share);
an RTX 4080 at 0.59 of a 4090 (their dense bf16 rates, 97.5 and 165 TFLOP/s by the vendor); the host link at 25 GB/s
(PCIe 4.0 x16 in practice); the published Q4_K_M file, 13.1 GB. Beside them, what the peers publish for 1024x1024 and
30 steps on a 4090 (edge-dit.cpp: whole runs, the encoder and the VAE included): edge-dit.cpp Q4_K on the card
36.3 s; diffusers int8 with full offload 72.3 s; diffusers bf16 with sequential offload 387.6 s.
"""

from __future__ import annotations

import argparse
import pathlib

from benchmarks import write_report
from omni_ray.families.qwen_image.facts import GGUF_BYTES, NUM_BLOCKS

HOST_LINK_BPS = 25e9
CARDS = {  # name: (memory GiB, compute seconds of one 1024x1024 true-CFG Q4_K step)
    "RTX 4090 (24 GB)": (24, 1.19),
    "RTX 4080 (16 GB)": (16, 1.19 / 0.59),
}
SIZES = {1024: 1.0, 512: 1 / 4.6}  # side: a step's compute against 1024's
PEERS_1024_30_STEPS_4090 = {"edge-dit.cpp Q4_K, on the card": 36.3, "diffusers int8 + full offload": 72.3,
                            "diffusers bf16 + sequential offload": 387.6}
STEPS = 30


def step_seconds(compute_s: float, batch: int, kept: int, file_bytes: float = GGUF_BYTES["Q4_K_M"],
                 link_bps: float = HOST_LINK_BPS) -> float:
    """One step of ``batch`` images, ``kept`` of the 60 blocks on the card and the others streamed one ahead."""
    kept = min(max(kept, 1), NUM_BLOCKS)
    c = batch * compute_s / NUM_BLOCKS
    t = file_bytes / NUM_BLOCKS / link_bps
    return kept * c + (NUM_BLOCKS - kept) * max(c, t)


def run() -> dict:
    rows = []
    for card, (memory_gib, compute_1024) in CARDS.items():
        for side, share in SIZES.items():
            compute_s = compute_1024 * share
            for kept in (1, 15, 30, 45, NUM_BLOCKS):
                for batch in (1, 2, 4, 8):
                    step = step_seconds(compute_s, batch, kept)
                    rows.append({"card": card, "side": side, "blocks_on_gpu": kept, "batch": batch,
                                 "step_s": round(step, 4), "s_per_image_step": round(step / batch, 4),
                                 "dit_s_per_image": round(STEPS * step / batch, 2),
                                 "over_unstreamed": round(step / (batch * compute_s), 3)})
    return {"model": "modelled from published figures (the module's docstring), not measured",
            "host_link_gbps": HOST_LINK_BPS / 1e9, "file_bytes": GGUF_BYTES["Q4_K_M"], "steps": STEPS,
            "peers_1024_30_steps_4090_s": PEERS_1024_30_STEPS_4090, "rows": rows}


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, side in zip(axes, SIZES):
        for kept in (1, 30, NUM_BLOCKS):
            rows = [r for r in report["rows"] if r["card"] == "RTX 4090 (24 GB)" and r["side"] == side
                    and r["blocks_on_gpu"] == kept]
            ax.plot([r["batch"] for r in rows], [r["s_per_image_step"] for r in rows], marker="o",
                    label=f"{kept} of 60 blocks on the card")
        ax.set_title(f"RTX 4090, Q4_K_M, {side}x{side} (modelled)")
        ax.set_xlabel("images in a step")
        ax.set_ylabel("seconds per image-step")
        ax.set_xscale("log", base=2)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/small_card.json")
    args = parser.parse_args()
    report = run()
    write_report(report, args.out, plot)
    for row in report["rows"]:
        if row["card"].startswith("RTX 4090") and row["batch"] in (1, 4) and row["blocks_on_gpu"] in (1, 60):
            print(f"{row['side']}: {row['blocks_on_gpu']:2d} blocks kept, b={row['batch']}: "
                  f"{row['s_per_image_step']:.3f} s per image-step, x{row['over_unstreamed']} of unstreamed")


if __name__ == "__main__":
    main()
