"""The offline checkpoint: deterministic, in diffusers' layout, loadable by diffusers and by vLLM."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from omni_ray.checkpoints.tiny import IMAGE_PROCESSOR_CONFIG, SCHEDULER_CONFIG, write_checkpoint
from omni_ray.families.qwen_image.facts import EDIT, EDIT_PLUS, TEXT_TO_IMAGE

LAYOUT = {"model_index.json", "scheduler", "text_encoder", "tokenizer", "transformer", "vae"}


def digests(root) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def test_same_seed_same_bytes_other_seed_other_weights(tiny_dir, tmp_path):
    again = digests(write_checkpoint(tmp_path / "again", seed=0))
    first = digests(tiny_dir)
    assert again == first
    weights = [name for name in first if name.endswith(".safetensors")]
    assert len(weights) == 3
    other = digests(write_checkpoint(tmp_path / "other", seed=1))
    assert all(other[name] != first[name] for name in weights)


def test_layout_and_configs(tiny_dir):
    assert {p.name for p in tiny_dir.iterdir()} == LAYOUT
    index = json.loads((tiny_dir / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    assert index["text_encoder"] == ["transformers", "Qwen2_5_VLForConditionalGeneration"]
    scheduler = json.loads((tiny_dir / "scheduler/scheduler_config.json").read_text())
    assert {k: scheduler[k] for k in SCHEDULER_CONFIG} == SCHEDULER_CONFIG
    assert scheduler["use_dynamic_shifting"] and scheduler["time_shift_type"] == "exponential"
    assert scheduler["shift_terminal"] == 0.02
    vae = json.loads((tiny_dir / "vae/config.json").read_text())
    assert len(vae["latents_mean"]) == vae["z_dim"] == 16
    assert len(set(vae["latents_mean"])) == 16 and all(m != 0 for m in vae["latents_mean"])
    assert len(set(vae["latents_std"])) == 16 and all(s != 1 for s in vae["latents_std"])
    text = json.loads((tiny_dir / "text_encoder/config.json").read_text())["text_config"]
    assert text["hidden_size"] // text["num_attention_heads"] >= 32


@pytest.mark.parametrize("template", [TEXT_TO_IMAGE, EDIT, EDIT_PLUS], ids=["text-to-image", "edit", "edit-plus"])
def test_template_prefix_is_as_many_tokens_as_diffusers_drops(tiny_dir, template):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    prefix = tokenizer(template.dropped_text).input_ids
    assert len(prefix) == template.drop == {TEXT_TO_IMAGE: 34, EDIT: 64, EDIT_PLUS: 64}[template]
    # A templated prompt starts with the same tokens whatever the prompt, so dropping them drops the system turn.
    full = tokenizer(template.format("a red cat", num_images=1)).input_ids
    assert full[: template.drop] == prefix and len(full) > template.drop


def test_edit_checkpoint_has_qwen_image_edit_layout_and_is_deterministic(edit_dir, tiny_dir, tmp_path):
    assert {p.name for p in edit_dir.iterdir()} == LAYOUT | {"processor"}
    index = json.loads((edit_dir / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPipeline"
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    processor = json.loads((edit_dir / "processor/processor_config.json").read_text())["image_processor"]
    assert {k: processor[k] for k in IMAGE_PROCESSOR_CONFIG} == IMAGE_PROCESSOR_CONFIG
    # The same weights as the text-to-image checkpoint of the same seed; only the pipeline around them differs.
    edit, plain = digests(edit_dir), digests(tiny_dir)
    assert all(edit[name] == plain[name] for name in plain if name.endswith(".safetensors"))
    assert digests(write_checkpoint(tmp_path / "again", seed=0, edit=True)) == edit


def test_edit_checkpoint_loads_in_diffusers_and_edits(edit_dir):
    from diffusers import QwenImageEditPipeline
    from PIL import Image

    pipe = QwenImageEditPipeline.from_pretrained(edit_dir)
    source = Image.fromarray((torch.rand(48, 80, 3, generator=torch.Generator().manual_seed(0)) * 255).byte().numpy())
    image = pipe(image=source, prompt="make it red", height=64, width=96, num_inference_steps=2, output_type="np",
                 generator=torch.Generator("cpu").manual_seed(0)).images
    assert image.shape == (1, 64, 96, 3) and image.std() > 0.05


def test_edit_plus_checkpoint_is_the_edit_one_under_qwen_image_edit_plus_pipeline(edit_plus_dir, edit_dir):
    """Qwen-Image-Edit-2509/2511's pipeline takes Qwen-Image-Edit's components: the files are the edit checkpoint's
    but for the class named in model_index.json, and diffusers edits with several input images on it."""
    from diffusers import QwenImageEditPlusPipeline
    from PIL import Image

    assert {p.name for p in edit_plus_dir.iterdir()} == LAYOUT | {"processor"}
    index = json.loads((edit_plus_dir / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPlusPipeline"
    assert index == {**json.loads((edit_dir / "model_index.json").read_text()), "_class_name": index["_class_name"]}
    plus, edit = digests(edit_plus_dir), digests(edit_dir)
    assert plus.keys() == edit.keys()
    assert all(plus[name] == edit[name] for name in edit if name != "model_index.json")

    pipe = QwenImageEditPlusPipeline.from_pretrained(edit_plus_dir)
    generator = torch.Generator().manual_seed(0)
    sources = [Image.fromarray((torch.rand(h, w, 3, generator=generator) * 255).byte().numpy())
               for h, w in ((48, 80), (64, 64))]
    image = pipe(image=sources, prompt="put the two together", height=64, width=96, num_inference_steps=2,
                 output_type="np", generator=torch.Generator("cpu").manual_seed(0)).images
    assert image.shape == (1, 64, 96, 3) and image.std() > 0.05


def test_small_size_is_wider_and_deeper(tmp_path):
    small = write_checkpoint(tmp_path / "small", seed=0, size="small")
    config = json.loads((small / "transformer/config.json").read_text())
    assert (config["num_layers"], config["num_attention_heads"] * config["attention_head_dim"]) == (4, 128)


def test_loads_in_diffusers_and_draws_an_image(tiny_dir):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(tiny_dir)
    image = pipe("a red cat", height=64, width=64, num_inference_steps=2, output_type="np",
                 generator=torch.Generator("cpu").manual_seed(0)).images
    assert image.shape == (1, 64, 64, 3)
    assert image.std() > 0.05  # a random model still draws something, not a flat image


VLLM_LOAD = textwrap.dedent(
    """
    import sys, time, torch
    from vllm.config import PoolerConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.pooling_params import PoolingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    ckpt, ids, out = sys.argv[1], [int(i) for i in sys.argv[2].split(",")], sys.argv[3]
    config = EngineArgs(
        model=ckpt + "/text_encoder", tokenizer=ckpt + "/tokenizer", dtype="float32", max_model_len=256,
        max_num_seqs=2, enforce_eager=True, distributed_executor_backend="uni", kv_cache_memory_bytes=16 << 20,
        language_model_only=True, runner="pooling", convert="embed",
        pooler_config=PoolerConfig(task="token_embed", tok_pooling_type="ALL", use_activation=False),
    ).create_engine_config()
    core = EngineCore(config, UniProcExecutor, log_stats=False)
    params = PoolingParams(task="token_embed", use_activation=False)
    params.verify(config.model_config)
    request = EngineCoreRequest(request_id="r", prompt_token_ids=ids, mm_features=None, sampling_params=None,
                                pooling_params=params, arrival_time=time.time(), lora_request=None,
                                cache_salt=None, data_parallel_rank=None)
    core.add_request(*core.preprocess_add_request(request))
    while True:
        outputs, _ = core.step()
        done = [o for batch in outputs.values() for o in batch.outputs if o.finished]
        if done:
            torch.save(done[0].pooling_output, out)
            break
    core.shutdown()
    """
)


def test_text_encoder_loads_in_vllm(tiny_dir, tmp_path):
    """vLLM (its own process: it binds threads for the whole process) loads text_encoder/ and agrees with transformers."""
    from omni_ray.tokenizer import PromptTokenizer
    from testing.reference import TransformersTextEncoder

    tokenizer = PromptTokenizer(str(tiny_dir))
    ids = tokenizer.tokenize("a red cat on a wooden table")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    out = tmp_path / "hidden.pt"
    result = subprocess.run(
        [sys.executable, "-c", VLLM_LOAD, str(tiny_dir), ",".join(map(str, ids)), str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    vllm_hidden = torch.load(out)
    reference = TransformersTextEncoder(str(tiny_dir))([ids], tokenizer.pad_token_id)[0]
    assert vllm_hidden.shape == reference.shape == (len(ids), 64)
    assert (vllm_hidden - reference).abs().max().item() < 1e-4
