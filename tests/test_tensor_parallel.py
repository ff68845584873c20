"""Tensor parallelism (issue 37): a DiT sharded over gloo ranks gives the unsharded model's forward, LoRA rows
included, holding 1/T of the sharded Linears' weights and sending the bytes ``tensor_bytes_per_forward`` says."""

from __future__ import annotations

import pytest
import torch
from diffusers import QwenImageTransformer2DModel

from omni_ray.config import ParallelSettings
from omni_ray.records import LoraRef
from omni_ray.runners.denoise import DenoiseRunner, pad_text
from omni_ray.runners.dit_cache import cached_forward
from omni_ray.runners.lora import read_lora
from omni_ray.runners.parallel.mesh import Mesh
from omni_ray.runners.parallel.tensor import planned_linears, shard_transformer, tensor_bytes_per_forward
from testing.gang import run_gang
from testing.lora_files import make_adapter

# Float32 sums of the same products in another order: each rowwise Linear's output is the sum of T partial sums (and
# its bias added after them rather than inside the matmul), a few ulps per block that the next blocks carry on
# (measured: 2e-6 to 3e-6 on outputs up to 10, at T = 2 and 4).
TOLERANCE = 2e-5
SIDE = 4  # latent patches per side: a 64x64 image, 16 image tokens
TEXT_TOKENS = 7


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    from omni_ray.checkpoints.tiny import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "small", seed=0, size="small")


def adapters_for(checkpoint, root) -> dict[str, str]:
    """Two adapters: one on every planned Linear (rank 4), one on a few colwise, rowwise and replicated ones
    (rank 8, the modulation Linear among them)."""
    return {
        "A": str(make_adapter(checkpoint, root / "A", rank=4, alpha=8, seed=1)),
        "B": str(make_adapter(checkpoint, root / "B", rank=8, seed=2, targets=(
            "to_k", "add_v_proj", "to_add_out", "img_mlp.net.2", "txt_mlp.net.0.proj", "img_mod.1"))),
    }


def forward_inputs(config: dict) -> dict:
    """Three rows, the second's text two tokens shorter (padded)."""
    generator = torch.Generator().manual_seed(3)
    rows = 3
    texts = [torch.randn(n, config["joint_attention_dim"], generator=generator)
             for n in (TEXT_TOKENS, TEXT_TOKENS - 2, TEXT_TOKENS)]
    embeds, mask = pad_text(texts)
    return {
        "latents": torch.randn(rows, SIDE * SIDE, config["in_channels"], generator=generator),
        "timestep": torch.tensor([0.9, 0.5, 0.2]),
        "embeds": embeds,
        "mask": mask,
        "img_shapes": [[(1, SIDE, SIDE)]] * rows,
    }


def loras(adapters: dict[str, str]) -> list[tuple[LoraRef, ...]]:
    """Each row's adapters: A at 0.8, none, and a stack of B at 1.2 with A at 0.5."""
    a, b = adapters["A"], adapters["B"]
    return [(LoraRef("A", a, 0.8),), (), (LoraRef("B", b, 1.2), LoraRef("A", a, 0.5))]


def sharded_forward(mesh: Mesh, checkpoint: str, rows: list[tuple[LoraRef, ...]], inputs: dict) -> dict:
    """On one rank: the checkpoint's transformer sharded over ``mesh.tensor``, in a runner with the rows' adapters
    resident, through one forward of ``inputs``."""
    transformer = QwenImageTransformer2DModel.from_pretrained(checkpoint, subfolder="transformer")
    shard_transformer(transformer, mesh)
    parameters = sum(p.numel() for p in transformer.parameters())
    runner = DenoiseRunner(transformer, scheduler_config={})
    for ref in {ref for stack in rows for ref in stack}:
        runner.add_lora(ref.key, read_lora(ref.path, runner.lora_shapes))  # checked at the whole shapes
    sent = mesh.sent["all_reduce"]
    with torch.inference_mode():
        out, _ = cached_forward(runner.transformer, **inputs, caches=[None] * len(rows), steps=[(0, 1)] * len(rows),
                                teacache_coefficients=(1.0,), lora=runner.loras.rows(rows))
    return {
        "out": out,
        "sent": mesh.sent["all_reduce"] - sent,
        "parameters": parameters,
        "lora_shapes": runner.lora_shapes,
        # module -> the resident adapters' A [slots, rank, in] and B [slots, out, rank] as this rank holds them
        "slots": {name: (tuple(layer.a.shape), tuple(layer.b.shape)) for name, layer in runner.loras.layers.items()},
    }


@pytest.mark.parametrize("size,tensor", [("tiny", 2), ("small", 2), ("small", 4)])
def test_a_sharded_forward_with_adapters_equals_the_whole_model(size, tensor, request, tmp_path):
    """Tiny: 2 heads of 32 over 2 ranks; small: 4 heads over 2 and 4 ranks (each rank's own heads)."""
    checkpoint = str(request.getfixturevalue("tiny_dir" if size == "tiny" else "small_dir"))
    whole = QwenImageTransformer2DModel.from_pretrained(checkpoint, subfolder="transformer")
    config = whole.config
    inputs = forward_inputs(dict(config))
    rows = loras(adapters_for(checkpoint, tmp_path))
    reference = sharded_forward(Mesh.single(), checkpoint, rows, inputs)

    ranks = run_gang(sharded_forward, ParallelSettings(tensor=tensor), checkpoint, rows, inputs)

    # 1. Every rank's forward is the whole model's, adapter rows and the row without one alike.
    for rank in ranks:
        torch.testing.assert_close(rank["out"], reference["out"], rtol=0, atol=TOLERANCE)
    # 2. Each rank holds 1/T of the planned Linears (weights, colwise biases), and the rest whole.
    planned = planned_linears(whole)
    sharded = sum(whole.get_submodule(name).weight.numel() for name in planned)
    sharded += sum(whole.get_submodule(name).bias.numel() for name, style in planned.items() if style == "colwise")
    assert reference["parameters"] == sum(p.numel() for p in whole.parameters())
    assert all(rank["parameters"] == reference["parameters"] - sharded + sharded // tensor for rank in ranks)
    # 3. The bytes each rank sent: four all-reduces of [rows, tokens, dim] per block.
    dim = config.num_attention_heads * config.attention_head_dim
    expected = tensor_bytes_per_forward(config.num_layers, dim, rows=3, image_tokens=SIDE * SIDE,
                                        text_tokens=TEXT_TOKENS, tensor=tensor, element_size=4)
    assert expected > 0 and all(rank["sent"] == expected for rank in ranks)
    # 4. Adapters are checked at the whole Linears' shapes and sharded as the weights are.
    assert all(rank["lora_shapes"] == reference["lora_shapes"] for rank in ranks)
    for name, (a, b) in reference["slots"].items():
        style = planned.get(name)  # colwise: B's rows; rowwise: A's columns; unplanned (img_mod.1): whole
        a = (*a[:2], a[2] // tensor) if style == "rowwise" else a
        b = (b[0], b[1] // tensor, b[2]) if style == "colwise" else b
        assert all(rank["slots"][name] == (a, b) for rank in ranks), name
    assert {"rowwise", "colwise", None} <= {planned.get(name) for name in reference["slots"]}


def test_adapters_change_the_rows_that_carry_them(tiny_dir, tmp_path):
    """The adapters' effect is far above the tolerance above, so a sharded update lost or added twice would show."""
    inputs = forward_inputs(QwenImageTransformer2DModel.load_config(tiny_dir, subfolder="transformer"))
    rows = loras(adapters_for(tiny_dir, tmp_path))
    adapted = sharded_forward(Mesh.single(), str(tiny_dir), rows, inputs)["out"]
    base = sharded_forward(Mesh.single(), str(tiny_dir), [()] * len(rows), inputs)["out"]
    change = (adapted - base).abs().amax(dim=(1, 2)).tolist()
    assert change[0] > 100 * TOLERANCE and change[1] == 0 and change[2] > 100 * TOLERANCE


def test_a_degree_that_does_not_divide_the_heads_is_refused(tiny_dir):
    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_dir, subfolder="transformer")
    with pytest.raises(ValueError, match=r"dit\.parallel\.tensor: 3 does not divide .* 2 attention heads"):
        shard_transformer(transformer, Mesh(ParallelSettings(tensor=3), 0, {}))
