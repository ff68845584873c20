"""The DiT from a GGUF file (``dit.weights_file``, issue 50): tiny checkpoints written as the published files are
(``omni_ray.checkpoints.gguf``), in Q8_0 and Q4_0 (the ``gguf`` package writes no K-quant). Images and edits through
the engines within one level of diffusers' pipelines running the same file through diffusers' own GGUF loader; a
step batch mixing GGUF rows with an adapter and without, with a cache and an edit, each row as it runs alone; and
every file that cannot be served refused at start, naming the setting."""

from __future__ import annotations

import asyncio
import io
import pathlib

import numpy as np
import pytest
import torch
from conftest import REPO
from diffusers import GGUFQuantizationConfig, QwenImagePipeline, QwenImageTransformer2DModel

from omni_ray.api.images import load_input_images
from omni_ray.checkpoints import gguf as gguf_file
from omni_ray.config import CacheSettings, ParallelSettings, load_config
from omni_ray.engine.builders import build_dit_core
from omni_ray.pipeline import Pipeline
from omni_ray.records import DenoiseParams, Latents, LoraRef
from omni_ray.runners import gguf_weights
from omni_ray.runners.denoise import DenoiseRunner
from omni_ray.runners.lora import read_lora
from testing.gang import run_gang
from testing.lora_files import make_adapter
from testing.numerics import assert_reordered
from testing.parallel import denoise_mix
from testing.reference import PromptEncoder, load_reference, reference_edit, source_image


@pytest.fixture(scope="module")
def files(tiny_dir, edit_dir, tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("gguf")
    return {"Q8_0": gguf_file.write(tiny_dir, root / "tiny-Q8_0.gguf", "Q8_0"),
            "Q4_0": gguf_file.write(tiny_dir, root / "tiny-Q4_0.gguf", "Q4_0"),
            "edit-Q4_0": gguf_file.write(edit_dir, root / "edit-Q4_0.gguf", "Q4_0")}


def diffusers_transformer(path: pathlib.Path, checkpoint) -> QwenImageTransformer2DModel:
    """The file as diffusers' own docs load one."""
    return QwenImageTransformer2DModel.from_single_file(
        str(path), config=str(checkpoint), subfolder="transformer", torch_dtype=torch.float32,
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32))


def test_the_file_is_quantized_as_the_published_ones_are(files, tiny_dir):
    import gguf

    reader = gguf.GGUFReader(files["Q4_0"])
    kinds = {tensor.name: tensor.tensor_type.name for tensor in reader.tensors}
    assert kinds["transformer_blocks.0.attn.to_q.weight"] == "Q4_0" and kinds["img_in.weight"] == "F32"
    assert kinds["transformer_blocks.0.attn.to_q.bias"] == "F32"
    summary = gguf_weights.check(files["Q4_0"], QwenImageTransformer2DModel.load_config(tiny_dir, subfolder="transformer"))
    assert summary.architecture == "qwen_image" and set(summary.quant_types) == {"F32", "Q4_0"}
    assert summary.bytes < files["Q8_0"].stat().st_size  # Q4 is the smaller
    runner = DenoiseRunner.load(str(tiny_dir), weights_file=str(files["Q4_0"]))
    linear = runner.transformer.transformer_blocks[0].attn.to_q
    assert linear.weight.dtype == torch.uint8 and linear.compute_dtype == torch.float32  # dequantized per forward


@pytest.mark.vllm
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0"])
def test_images_through_the_engines_are_diffusers_with_the_same_gguf_file(files, tiny_dir, quant):
    config = load_config(REPO / "stage_configs/qwen_image_tiny.yaml", model=str(tiny_dir),
                         overrides={"dit": {"weights_file": str(files[quant])}})
    reference = QwenImagePipeline.from_pretrained(tiny_dir, transformer=diffusers_transformer(files[quant], tiny_dir))
    plain = QwenImagePipeline.from_pretrained(tiny_dir)
    pipeline = Pipeline(config)
    bodies = [{"prompt": "a red cat", "negative_prompt": "blurry", "size": "64x96", "num_inference_steps": 4,
               "seed": 3, "true_cfg_scale": 4.0}, {"prompt": "a lighthouse", "size": "64x64", "seed": 5,
                                                   "num_inference_steps": 3}]
    try:
        results = asyncio.run(_generate_all(pipeline, bodies))
    finally:
        pipeline.shutdown()
    for body, (result,) in zip(bodies, results):
        width, height = (int(side) for side in body["size"].split("x"))
        kwargs = {"prompt": body["prompt"], "negative_prompt": body.get("negative_prompt"), "height": height,
                  "width": width, "num_inference_steps": body["num_inference_steps"],
                  "true_cfg_scale": body.get("true_cfg_scale", 4.0), "output_type": "np"}
        expected = _pixels(reference(generator=torch.Generator("cpu").manual_seed(body["seed"]), **kwargs))
        unquantized = _pixels(plain(generator=torch.Generator("cpu").manual_seed(body["seed"]), **kwargs))
        assert result.pixels.shape == expected.shape and expected.std() > 10
        assert np.abs(result.pixels.astype(int) - expected.astype(int)).max() <= 1, quant
        assert (unquantized != expected).any()  # the file's weights took effect (Q8_0 moves few pixels at this size)


async def _generate_all(pipeline, bodies, image=None):
    return await asyncio.gather(*(pipeline.generate(body, image) if image is not None else pipeline.generate(body)
                                  for body in bodies))


def _pixels(output) -> np.ndarray:
    return (output.images[0] * 255).round().astype(np.uint8)


@pytest.mark.vllm
def test_an_edit_with_a_gguf_dit_is_diffusers_edit_with_the_same_file(files, edit_dir):
    config = load_config(REPO / "stage_configs/qwen_image_edit_tiny.yaml", model=str(edit_dir),
                         overrides={"dit": {"weights_file": str(files["edit-Q4_0"])}})
    reference = load_reference(edit_dir)
    reference.transformer = diffusers_transformer(files["edit-Q4_0"], edit_dir)
    buffer = io.BytesIO()
    source_image(180, 100, 3).save(buffer, format="PNG")
    image = load_input_images([buffer.getvalue()], config).vae[0]
    pipeline = Pipeline(config)
    body = {"prompt": "make the disc blue", "negative_prompt": "blurry", "num_inference_steps": 3, "seed": 11,
            "true_cfg_scale": 4.0}
    try:
        ((result,),) = asyncio.run(_generate_all(pipeline, [body], image))
    finally:
        pipeline.shutdown()
    expected = reference_edit(reference, config.edit.image_area, source_image(180, 100, 3), seed=11,
                              prompt=body["prompt"], negative_prompt="blurry", true_cfg_scale=4.0, num_inference_steps=3)
    assert result.pixels.shape == expected.shape
    assert np.abs(result.pixels.astype(int) - expected.astype(int)).max() <= 1


def test_a_step_of_gguf_rows_with_and_without_an_adapter_a_cache_and_an_edit_gives_each_row_alone(
        files, tiny_dir, tmp_path):
    """Text-to-image rows share one step batch (plain, an adapter's, a stack of two adapters', a first-block
    cache's), edit rows another (their image tokens make another batch key): each row's latents are its own run
    alone's."""
    runner = DenoiseRunner.load(str(tiny_dir), weights_file=str(files["Q4_0"]))
    adapter = str(make_adapter(tiny_dir, tmp_path / "A", rank=4, alpha=8, seed=1))
    other = str(make_adapter(tiny_dir, tmp_path / "B", rank=2, seed=2, targets=("to_q", "to_v", "img_mlp.net.2")))
    runner.add_lora(("A", adapter), read_lora(adapter, runner.lora_shapes))
    runner.add_lora(("B", other), read_lora(other, runner.lora_shapes))
    prompt, negative = PromptEncoder(str(tiny_dir)).encode(["a red cat", "blurry"])
    image = (Latents(torch.randn(16, 64, generator=torch.Generator().manual_seed(9)), 64, 64),)
    lora, cache = LoraRef("A", adapter, 0.8), CacheSettings(kind="first_block", threshold=2.0)

    def params(seed, **more):
        return DenoiseParams(64, 64, 5, seed=seed, true_cfg_scale=4.0, true_cfg=True, **more)

    def run(rows):
        states = [runner.prepare(row_params, prompt, negative, images=images) for row_params, images in rows]
        while not states[0].is_finished:
            runner.step(states)
        return [runner.finish(state).latents for state in states], states

    stack = (LoraRef("B", other, 1.5), lora)
    texts = [(params(1), ()), (params(2, loras=(lora,)), ()), (params(3, cache=cache), ()),
             (params(2, loras=stack), ())]
    edits = [(params(4), image), (params(5, loras=(lora,)), image), (params(5, loras=stack), image)]
    for rows in (texts, edits):
        together, _ = run(rows)
        for i, row in enumerate(rows):
            assert_reordered(together[i], run([row])[0][0], i)
        assert (together[0] - together[1]).abs().max() > 1e-2  # the adapter took effect
        assert (together[1] - together[-1]).abs().max() > 1e-2  # and the stack's second one
    assert sum(c.reused for c in run(texts)[1][2].caches) > 0, "the cached row never reused"


def test_a_gang_denoises_a_gguf_dit_as_one_rank_does(files, tiny_dir, tiny_adapters):
    """Ulysses over two ranks, each holding the whole file, with the adapters and caches of the parallel tests' mix."""
    one = denoise_mix(None, str(tiny_dir), tiny_adapters, 4, "sequence", False, str(files["Q4_0"]))[0]
    for latents, _ in run_gang(denoise_mix, ParallelSettings(ulysses=2), str(tiny_dir), tiny_adapters, 4, "sequence",
                               False, str(files["Q4_0"])):
        assert latents.keys() == one.keys()
        for request_id, expected in one.items():
            assert_reordered(latents[request_id], expected, request_id)


def _write_raw(path: pathlib.Path, tensors: dict, arch: str = "qwen_image", raw=None) -> pathlib.Path:
    import gguf

    writer = gguf.GGUFWriter(path=None, arch=arch)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    for name, (data, kind) in (raw or {}).items():  # ``data``: the quantized bytes, a row of blocks per row
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_file_that_cannot_be_served_is_refused_at_start_naming_the_setting(files, tiny_dir, tmp_path):
    import gguf

    preset = REPO / "stage_configs/qwen_image_tiny.yaml"

    def config_with(path):
        return load_config(preset, model=str(tiny_dir), overrides={"dit": {"weights_file": str(path)}})

    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip, not a GGUF")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(files["Q8_0"].read_bytes()[: files["Q8_0"].stat().st_size // 2])
    another_model = _write_raw(tmp_path / "llama.gguf", {"blk.0.attn_q.weight": np.ones((64, 64), np.float32)},
                               arch="llama")
    edit_variant = tmp_path / "narrower.gguf"  # one tensor of another shape: another variant of the model
    narrower = {name: np.zeros(tuple(tensor.shape)[::-1], np.float32) for name, tensor in (
        (t.name, t) for t in gguf.GGUFReader(files["Q8_0"]).tensors)}
    narrower["img_in.weight"] = np.zeros((64, 32), np.float32)
    _write_raw(edit_variant, narrower)
    unreadable = dict(narrower)
    unreadable["img_in.weight"] = np.zeros((64, 64), np.float32)
    del unreadable["transformer_blocks.0.attn.to_q.weight"]
    iq = tmp_path / "iq4.gguf"
    _write_raw(iq, unreadable, raw={"transformer_blocks.0.attn.to_q.weight": (
        np.zeros((64, 64 // 32 * 18), np.uint8), gguf.GGMLQuantizationType.IQ4_NL)})
    for path, says in ((tmp_path / "missing.gguf", "is not a file"), (not_gguf, "is not a GGUF file"),
                       (truncated, "is not a whole GGUF file"), (another_model, "is not a Qwen-Image transformer"),
                       (edit_variant, "is another variant of the model"),
                       (iq, "as IQ4_NL, a type diffusers cannot dequantize")):
        config = config_with(path)  # a GGUF file: the preset loads; the DiT refuses it as it starts
        with pytest.raises(ValueError, match=f"dit.weights_file: .*{says}"):
            build_dit_core(config)
    with pytest.raises(ValueError, match="weights_file: a GGUF file is quantized already"):
        load_config(preset, model=str(tiny_dir), overrides={"dit": {"weights_file": str(files["Q8_0"]),
                                                                     "quantization": "fp8"}})
