"""What Qwen-Image's stages take on one GPU, for the simulated model runners (``runner: simulated``).

A load-testing tool, not a model of any GPU: it lets the deployments, engines and schedulers run at Qwen-Image's
real sizes on a machine without one, with stage times of the right order and the right shape (batching gains at
small images and little at large ones; true CFG doubles the DiT's work). Every constant below comes from a published
figure or a formula, named where it is defined.

- DiT, one forward pass over N tokens (image tokens ``(H/16)*(W/16)`` plus text tokens):
  ``2 * 6.79e9 * N`` FLOPs for the linear layers (two per weight per token) plus ``4 * 60 * 3072 * N^2`` for joint
  attention (60 blocks, 24 heads of 128 = 3072 wide, QK^T and AV at two FLOPs per multiply-add), from the
  transformer's published shapes (``omni_ray/families/qwen_image/configs/qwen-image``). A step costs a fixed overhead plus its
  passes (two per request with true CFG) at an effective throughput; both are solved from two published H200 timings:
  0.243 s per step at 1024x1024 with CFG, batch 1 (SGLang issue 22183), and 2.17 s for 20 steps at 512x512 with CFG
  (vLLM-Omni issue 3266). That gives about 796 TFLOP/s and 70 ms per step.
- DiT on a gang's N sequence ranks (``ranks``; Ulysses): each pass's FLOPs split over the ranks while the fixed
  overhead is not (every rank launches every kernel), plus four all-to-alls a block (Q, K and V before attention, its
  output after), each rank sending ``(N-1)/N`` of its ``1/N`` of the step's ``[rows x passes x tokens, 3072]`` bf16
  activations over NVLink at ``NVLINK_BYTES_PER_S``, each collective also costing ``ALL_TO_ALL_LATENCY_S``. At
  1024x1024 with CFG on 4 ranks the all-to-alls are 8% of the step; at 512x512 the fixed overhead leaves Ulysses 4
  only 1.3x faster than one GPU. Against vLLM-Omni's published Ulysses scaling (H800, 2048x2048, 50 steps:
  diffusers 112.5 s, Ulysses 2 / 4 / 8 65.2 / 39.6 / 30.8 s: a parallel efficiency of 0.86 / 0.71 / 0.46, end to
  end) this gives 0.89 / 0.78 / 0.64 per step: it is kind to sequence parallelism, the more so the more ranks.
- Encoder (Qwen2.5-VL-7B's language model, 7.07e9 weights a token passes through): ``2 * 7.07e9`` FLOPs per token at
  the DiT's effective throughput, plus a fixed cost per engine step solved from 0.035 s for one 512x512 request
  (vLLM-Omni issue 3266; its prompt and negative prompt, about 2 x 40 tokens after the template).
- VAE: decoding is convolutions over every pixel, linear in pixels with nothing to gain from batching: 0.017 s per
  512x512 image (vLLM-Omni issue 3266). Encoding an edit's input image has no published figure; it is taken as
  decoding's.
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_ray.families.qwen_image.facts import TEXT_TO_IMAGE, image_tokens

DIT_BLOCKS = 60
DIT_ATTENTION_WIDTH = 3072  # 24 heads of 128


def dit_pass_flops(tokens: int) -> float:
    """FLOPs of one Qwen-Image transformer pass over ``tokens`` image plus text tokens."""
    return 2 * 6.79e9 * tokens + 4 * DIT_BLOCKS * DIT_ATTENTION_WIDTH * tokens**2


# The published timings the constants are solved from: (height, width, seconds per step, CFG), batch 1.
DIT_STEP_1024_CFG = (1024, 1024, 0.243)  # SGLang issue 22183, H200
DIT_STEP_512_CFG = (512, 512, 2.17 / 20)  # vLLM-Omni issue 3266, H200, 20 steps
CALIBRATION_TEXT_TOKENS = 50  # a short prompt's embeddings, template dropped
ENCODER_512 = 0.035  # vLLM-Omni issue 3266: the encoder's time for one request
ENCODER_WEIGHTS = 7.07e9
ENCODER_CALIBRATION_TOKENS = 2 * (40 + TEXT_TO_IMAGE.drop)
VAE_DECODE_512 = 0.017  # vLLM-Omni issue 3266
NVLINK_BYTES_PER_S = 360e9  # H200's NVLink 4: 450 GB/s each way per GPU, of which NCCL's all-to-all reaches ~80%
ALL_TO_ALL_LATENCY_S = 15e-6  # one NCCL all-to-all inside an NVLink node, besides its bytes: tens of microseconds


def _solve_dit() -> tuple[float, float]:
    """(effective FLOP/s, fixed seconds per step) through the two published CFG step times."""
    (h1, w1, t1), (h2, w2, t2) = DIT_STEP_1024_CFG, DIT_STEP_512_CFG
    work1 = 2 * dit_pass_flops(image_tokens(h1, w1) + CALIBRATION_TEXT_TOKENS)
    work2 = 2 * dit_pass_flops(image_tokens(h2, w2) + CALIBRATION_TEXT_TOKENS)
    flops_per_s = (work1 - work2) / (t1 - t2)
    return flops_per_s, t1 - work1 / flops_per_s


@dataclass(frozen=True)
class GpuCosts:
    """Seconds each stage's engine step takes on the GPU the constants were measured on (an H200)."""

    dit_flops_per_s: float
    dit_step_overhead_s: float
    encoder_step_overhead_s: float
    vae_s_per_pixel: float

    @classmethod
    def h200(cls) -> GpuCosts:
        flops_per_s, overhead = _solve_dit()
        encoder_compute = 2 * ENCODER_WEIGHTS * ENCODER_CALIBRATION_TOKENS / flops_per_s
        return cls(flops_per_s, overhead, ENCODER_512 - encoder_compute, VAE_DECODE_512 / (512 * 512))

    def dit_step(self, batch: int, height: int, width: int, text_tokens: int, true_cfg: bool,
                 extra_image_tokens: int = 0, ranks: int = 1) -> float:
        """One denoising step of ``batch`` same-size requests; text is padded to ``text_tokens`` (the batch's
        longest), and an edit's input image adds ``extra_image_tokens`` to every pass. ``ranks`` > 1: every row's
        tokens split over that many GPUs (Ulysses), the all-to-alls included."""
        tokens = image_tokens(height, width) + extra_image_tokens + text_tokens
        return self.dit_forward(batch * (2 if true_cfg else 1), tokens, ranks)

    def dit_forward(self, passes: int, tokens: int, ranks: int = 1) -> float:
        """One step's forward over ``passes`` passes of ``tokens`` tokens each, split over ``ranks`` GPUs."""
        compute = passes * dit_pass_flops(tokens) / self.dit_flops_per_s
        return self.dit_step_overhead_s + compute / ranks + self.all_to_alls(passes * tokens, ranks)

    @staticmethod
    def all_to_alls(tokens: int, ranks: int) -> float:
        """Seconds a step's Ulysses all-to-alls take over ``tokens`` tokens (every pass's) split on ``ranks``."""
        if ranks == 1:
            return 0.0
        sent = tokens * DIT_ATTENTION_WIDTH * 2 * (ranks - 1) / ranks**2  # bf16 bytes each rank sends, per tensor
        return 4 * DIT_BLOCKS * (ALL_TO_ALL_LATENCY_S + sent / NVLINK_BYTES_PER_S)

    def encoder_step(self, tokens: int) -> float:
        """One encoder step over sequences of ``tokens`` tokens in all (vLLM batches them in one pass)."""
        return self.encoder_step_overhead_s + 2 * ENCODER_WEIGHTS * tokens / self.dit_flops_per_s

    def vae_step(self, pixels: int) -> float:
        """One VAE call over images of ``pixels`` pixels in all (decode or encode)."""
        return self.vae_s_per_pixel * pixels
