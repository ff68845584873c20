"""A 4-bit AWQ text encoder (``Qwen/Qwen2.5-VL-7B-Instruct-AWQ``'s layout, written by ``omni_ray.checkpoints.awq``)
under the encoder stage's vLLM engine core, on vLLM's CPU AWQ path: the embeddings are the checkpoint's.

The reference is the same checkpoint run by transformers, on the dequantized weights: transformers' own AWQ loader
needs gptqmodel, whose only release for this Python is a source package that needs torch >= 2.14.1 and transformers
>= 5.20.2 (we pin 2.13 and 5.19), and autoawq needs triton; neither runs here. So ``awq.write_dequantized`` writes each
quantized Linear back as the float32 weight its 4-bit values, zero points and float16 scales stand for, and diffusers'
``QwenImagePipeline.encode_prompt`` runs transformers' ``Qwen2_5_VLForConditionalGeneration`` on them in float32:
exactly what the checkpoint defines.

The tolerance comes from the kernel's compute dtype. vLLM's CPU AWQ kernel (``CPUWNA16LinearKernel``, ``vec`` ISA
here, W4A16) dequantizes each weight to the activation dtype (its float16 scales rounded to it on load), sums the
products in float32, and rounds its output to the activation dtype; everything around it (norms, attention, the
residual stream) runs in that dtype too. Measured on this tiny model (2026-11, 2-core AMD EPYC, group size 32): one
Linear's output equals that emulation bit for bit in bfloat16 and float16; the prompt embeddings are 1.6 to 2.4
bfloat16 epsilons (2**-7) of their largest magnitude from the float32 reference (0.047 to 0.071 at 3.3 to 3.8; the
whole sequence's last hidden states up to 3.6), as transformers' own bfloat16 run of the dequantized weights is (2.3);
in float16, 2.4 of its epsilons (0.008). CPUs with AMX take the kernel's ``amx`` ISA instead, not measured here. The
bound is ``AWQ_EPSILONS`` (8) epsilons of the activation dtype. The
quantization itself moves the embeddings by 29 to 36% of that magnitude (the full-precision checkpoint against its
4-bit copy: 4.6 to 5.8 bounds; the test asks for 3), and a wrong packing order or group by more than that.
"""

import json
import pathlib
import shutil

import pytest
import torch
from conftest import REPO, encode_all
from diffusers import QwenImagePipeline

from omni_ray.checkpoints import awq, gptq
from omni_ray.config import load_config
from omni_ray.engine.builders import build_encoder_core
from omni_ray.families.qwen_image.facts import PUBLISHED_PARAMS, QUANTIZABLE_PARAMS
from omni_ray.placement import GIB, encoder_weights, stage_memory
from omni_ray.records import EncodeRequest

pytestmark = pytest.mark.vllm

GROUP_SIZE = 32  # divides the tiny language model's 64- and 128-wide inputs; the CPU kernel wants inputs and outputs
# in multiples of 32, which the tiny widths are (no widening needed)
DTYPE = "bfloat16"  # what a preset of the AWQ encoder sets (vLLM's AWQ takes bfloat16 or float16 activations)
AWQ_EPSILONS = 8
PROMPTS = ["a red cat", "an oil painting of a lighthouse on a cliff at sunset, waves crashing"]


@pytest.fixture(scope="module")
def awq_dir(tiny_dir, tmp_path_factory) -> pathlib.Path:
    """The tiny checkpoint with an AWQ text encoder, written by the command users run."""
    out = tmp_path_factory.mktemp("awq") / "tiny-awq"
    awq.main([str(tiny_dir), str(out), "--group-size", str(GROUP_SIZE)])
    return out


def dequantized_pipeline(checkpoint: pathlib.Path, out: pathlib.Path, dequantized=None) -> QwenImagePipeline:
    """diffusers' pipeline (its text encoder and tokenizer) on ``checkpoint`` with its text encoder dequantized to
    float32 (``dequantized``: the format's ``dequantized_state``, AWQ's by default)."""
    awq.link_parts(checkpoint, out)
    awq.write_dequantized(checkpoint / "text_encoder", out / "text_encoder", dequantized)
    return QwenImagePipeline.from_pretrained(out, transformer=None, vae=None)


@pytest.fixture(scope="module")
def reference(awq_dir, tmp_path_factory):
    return dequantized_pipeline(awq_dir, tmp_path_factory.mktemp("awq") / "dequantized")


def awq_config(model, dtype: str = DTYPE, quantization: str = "awq"):
    return load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(model),
                       overrides={"encoder": {"dtype": dtype, "kv_cache_memory_bytes": 32 << 20,
                                              "quantization": quantization}})


@pytest.fixture(scope="module")
def core(awq_dir):
    core = build_encoder_core(awq_config(awq_dir))
    yield core
    core.shutdown()


def test_the_layout_is_awq_s(awq_dir):
    """Eight columns an int32 in AWQ's nibble order, and a round trip within half a step of each group."""
    levels = torch.arange(8, dtype=torch.int32).reshape(1, 8)
    assert awq.pack(levels).item() == 0x75316420  # nibbles low to high: columns 0, 2, 4, 6, 1, 3, 5, 7
    assert torch.equal(awq.unpack(awq.pack(levels)), levels)
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    qweight, qzeros, scales = awq.quantize(weight, GROUP_SIZE)
    assert (qweight.shape, qzeros.shape, scales.shape) == ((128, 8), (4, 8), (4, 64)) and scales.dtype == torch.float16
    step = scales.float().t().repeat_interleave(GROUP_SIZE, dim=1)  # [out, in]
    assert ((awq.dequantize(qweight, qzeros, scales) - weight).abs() <= step / 2 + 1e-6).all()
    config = json.loads((awq_dir / "text_encoder" / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": GROUP_SIZE,
                                             "zero_point": True, "version": "gemm",
                                             "modules_to_not_convert": ["visual"]}


def test_an_awq_folder_is_linked_as_the_text_encoder(awq_dir, tiny_dir, tmp_path):
    """``--text-encoder``, as users lay out the published AWQ folder beside Qwen-Image's parts: linked once checked; a
    full-precision folder refused."""
    out = tmp_path / "linked"
    awq.main([str(tiny_dir), str(out), "--text-encoder", str(awq_dir / "text_encoder")])
    assert (out / "text_encoder").resolve() == (awq_dir / "text_encoder").resolve()
    assert (out / "transformer").resolve() == (tiny_dir / "transformer").resolve()
    with pytest.raises(ValueError, match="declares no AWQ quantization_config"):
        awq.write(tiny_dir, tmp_path / "refused", text_encoder=tiny_dir / "text_encoder")


def assert_embeddings_are_the_checkpoint_s(core, reference, original: QwenImagePipeline) -> None:
    """Prompts through the encoder engine core ``core`` within AWQ_EPSILONS bfloat16 epsilons of ``reference`` (the
    dequantized checkpoint in float32), and far from ``original``, the full-precision checkpoint it was quantized
    from."""
    requests = [EncodeRequest(f"q{i}", prompt, "blurry" if i else None) for i, prompt in enumerate(PROMPTS)]
    results, _ = encode_all(core, requests)
    epsilon = torch.finfo(getattr(torch, DTYPE)).eps
    for request in requests:
        for text, got in ((request.prompt, results[request.request_id].prompt),
                          (request.negative_prompt, results[request.request_id].negative)):
            if text is None:
                assert got is None
                continue
            expected = reference.encode_prompt(text, device="cpu")[0][0]
            assert got.embeds.shape == expected.shape
            bound = AWQ_EPSILONS * epsilon * expected.abs().max().item()
            difference = (got.embeds.float() - expected).abs().max().item()
            assert difference <= bound, f"{text!r}: {difference:.3g} from the checkpoint, over {bound:.3g}"
            unquantized = original.encode_prompt(text, device="cpu")[0][0]
            assert (unquantized - expected).abs().max().item() > 3 * bound  # the test sees the 4-bit values


@pytest.fixture(scope="module")
def original(tiny_dir):
    return QwenImagePipeline.from_pretrained(tiny_dir, transformer=None, vae=None)


def test_embeddings_are_the_checkpoint_s(core, reference, original):
    assert_embeddings_are_the_checkpoint_s(core, reference, original)


def test_a_gptq_encoder_s_embeddings_are_the_checkpoint_s(tiny_dir, original, tmp_path):
    """GPTQ (symmetric, ``omni_ray.checkpoints.gptq``) on vLLM's CPU GPTQ path: the same kernel as AWQ's (W4A16),
    the same bound (measured: 2.0 to 3.2 bfloat16 epsilons; the quantization itself 4.8 to 6.2 bounds)."""
    checkpoint = gptq.write(tiny_dir, tmp_path / "tiny-gptq", GROUP_SIZE)
    core = build_encoder_core(awq_config(checkpoint, quantization="gptq"))
    try:
        reference = dequantized_pipeline(checkpoint, tmp_path / "dequantized", gptq.dequantized_state)
        assert_embeddings_are_the_checkpoint_s(core, reference, original)
    finally:
        core.shutdown()


def test_one_linear_is_dequantized_to_the_activation_dtype_with_float32_sums(core, awq_dir):
    """The kernel's compute dtype: one quantized Linear of the loaded engine against the float32 product of the
    dequantized weight. Rounding the weights (and their float16 scales) to bfloat16, summing in float32 and rounding
    the output once bounds the difference by one unit roundoff (2**-8) of |x| @ |W| and one of the output (measured:
    half the bound at most). vLLM's W4A8 path (int8 activations, on CPUs with AMX) is off in the encoder."""
    model = core.encoder.core.model_executor.driver_worker.worker.model_runner.model
    layer = dict(model.named_modules())["language_model.model.layers.0.mlp.down_proj"]
    assert type(layer.quant_method.kernel).__name__ == "CPUWNA16LinearKernel" and not layer.use_w4a8
    from safetensors.torch import load_file

    stored = load_file(awq_dir / "text_encoder" / "model.safetensors")
    prefix = "model.layers.0.mlp.down_proj."
    weight = awq.dequantize(*(stored[prefix + suffix] for suffix in awq.QUANTIZED_SUFFIXES))  # [out, in], float32
    x = torch.randn(37, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(getattr(torch, DTYPE))
    with torch.no_grad():
        got = layer.quant_method.apply(layer, x)
    assert got.dtype == x.dtype
    exact = x.float() @ weight.t()
    unit = torch.finfo(x.dtype).eps / 2
    bound = unit * (x.float().abs() @ weight.abs().t()) + unit * exact.abs() + 1e-6
    assert ((got.float() - exact).abs() <= bound).all()


def test_a_float32_awq_encoder_is_refused_naming_encoder_dtype(awq_dir):
    with pytest.raises(ValueError, match=r"encoder.dtype: float32, .* awq-quantized .*(bfloat16|float16)"):
        build_encoder_core(awq_config(awq_dir, dtype="float32"))


def test_encoder_quantization_must_be_the_checkpoint_s_and_on_vllm(awq_dir, tiny_dir):
    """``encoder.quantization`` (what the placement check counts) against the checkpoint: an AWQ one declared GPTQ,
    a full-precision one declared AWQ, and AWQ on the transformers runner, each refused naming the field."""
    with pytest.raises(ValueError, match=r"encoder.quantization: gptq, but the text encoder in .* is awq"):
        build_encoder_core(awq_config(awq_dir, quantization="gptq"))
    with pytest.raises(ValueError, match=r"encoder.quantization: awq, but the text encoder in .* is not quantized"):
        build_encoder_core(awq_config(tiny_dir))
    with pytest.raises(ValueError, match=r"encoder.quantization: awq weights load on vLLM's kernels"):
        load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir),
                    overrides={"encoder": {"runner": "transformers", "quantization": "awq"}})


@pytest.mark.parametrize("damage", ["group_size", "truncated"])
def test_a_damaged_awq_checkpoint_fails_at_start(awq_dir, tmp_path, damage):
    """A config.json whose group size is not the tensors', or a weights file cut short: refused before vLLM starts,
    naming the tensor or the file (vLLM's loader would meet a bare assertion or a header error)."""
    for entry in awq_dir.iterdir():
        if entry.name != "text_encoder":
            (tmp_path / entry.name).symlink_to(entry.resolve())
    folder = shutil.copytree(awq_dir / "text_encoder", tmp_path / "text_encoder")
    if damage == "group_size":
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"]["group_size"] = 2 * GROUP_SIZE
        (folder / "config.json").write_text(json.dumps(config))
        expected = r"layers\.0\.\S+\.qzeros: I32 \[\d+, \d+\], but .* groups of 64 .* needs I32"
    else:
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-1000])
        expected = r"model\.safetensors: not a whole safetensors file"
    with pytest.raises(ValueError, match=expected):
        build_encoder_core(awq_config(tmp_path))


def test_placement_counts_an_awq_encoder_at_its_quantized_bytes(tmp_path):
    """A GPU preset whose checkpoint's text encoder declares AWQ: the decoder layers' Linears at 4.16 bits, the rest
    in the encoder's dtype; with the vision tower, the published AWQ checkpoint's 6.9 GB. The Linears' count is the
    full-size Qwen2.5-VL-7B's."""
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    from omni_ray.checkpoints.full_size import CONFIG_DIR

    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(AutoConfig.from_pretrained(CONFIG_DIR / "text_encoder"))
    assert sum(p.numel() for n, p in model.named_parameters() if awq.QUANTIZED.match(n)) == QUANTIZABLE_PARAMS
    quantization = awq.quantization_config(128)
    weights, kind = encoder_weights(PUBLISHED_PARAMS["text_encoder"], "bfloat16", quantization)
    assert kind == "4-bit AWQ and bfloat16" and 6.8e9 < weights < 7.0e9

    (tmp_path / "text_encoder").mkdir()
    (tmp_path / "text_encoder" / "config.json").write_text(json.dumps({"quantization_config": quantization}))
    config = load_config(REPO / "stage_configs/qwen_image_24gb.yaml")
    full, quantized = (next(e for e in stage_memory(c, config.gpu_memory_gib) if e.stage == "encoder")
                       for c in (config, config.model_copy(update={"model": str(tmp_path)})))
    saved = QUANTIZABLE_PARAMS * (2 - awq.bytes_per_weight(quantization)) / GIB
    assert abs(full.need_gib - quantized.need_gib - saved) <= 0.1 and "4-bit AWQ" in quantized.detail
    declared = load_config(REPO / "stage_configs/qwen_image_24gb.yaml", overrides={"encoder": {"quantization": "awq"}})
    assert next(e for e in stage_memory(declared, declared.gpu_memory_gib) if e.stage == "encoder") == quantized
