"""One request on several ranks (issue 37): the DiT's step split over a gang of CPU processes joined over gloo gives
the latents one process gives.

Tolerance: the gang computes the same arithmetic in another grouping: a CFG rank's forward holds only its passes
(text padded to another length, sub-batches of other sizes), a sequence rank's blocks see a chunk of the tokens
and its attention merges partial softmaxes or gathers heads, a tensor rank's Linears sum partial products in an
all-reduce. Float32 sums in another order differ by a few ulps per operation, which four denoising steps carry
into the latents (about 1 here, up to 4): 1e-4 absolute is that with a margin, and two orders of magnitude under
what one level of an 8-bit image is after the VAE.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import QwenImageTransformer2DModel

from omni_ray.config import ParallelSettings
from omni_ray.records import Latents
from omni_ray.runners.vae import VaeRunner
from testing.gang import run_gang
from testing.lora_files import make_adapter
from testing.parallel import denoise_mix, diffusers_image, mix_requests
from testing.serving import within_one_level

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def one_rank(tiny_dir, tiny_adapters) -> dict[str, torch.Tensor]:
    return denoise_mix(None, str(tiny_dir), tiny_adapters)[0]


GANGS = {  # name: (the gang, the steps' split, compiled blocks)
    "cfg2": (ParallelSettings(cfg=2), "sequence"),
    "ulysses2": (ParallelSettings(ulysses=2), "sequence"),
    "ring2": (ParallelSettings(ring=2), "sequence"),
    "ulysses2-rows": (ParallelSettings(ulysses=2), "rows"),
    "tensor2": (ParallelSettings(tensor=2), "sequence"),
    "ulysses2xcfg2": (ParallelSettings(ulysses=2, cfg=2), "sequence"),
    "tensor2xcfg2": (ParallelSettings(tensor=2, cfg=2), "sequence"),
    "ulysses2-compiled": (ParallelSettings(ulysses=2), "sequence", True),
}


@pytest.mark.parametrize("gang", GANGS)
def test_a_gang_denoises_what_one_rank_does(gang, tiny_dir, tiny_adapters, one_rank):
    settings, split, *compiled = GANGS[gang]
    results = run_gang(denoise_mix, settings, str(tiny_dir), tiny_adapters, 4, split, *compiled)
    for rank, (latents, _) in enumerate(results):
        assert latents.keys() == one_rank.keys()
        for rid, expected in one_rank.items():
            difference = (latents[rid] - expected).abs().max().item()
            assert difference <= TOLERANCE, f"rank {rank}, {rid}: {difference}"


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    from omni_ray.checkpoints.tiny import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "small", seed=0, size="small")


@pytest.mark.parametrize("checkpoint, settings", [
    ("tiny", ParallelSettings(ulysses=2, cfg=2)),
    ("small", ParallelSettings(ulysses=2, tensor=2)),
], ids=["tiny-ulysses2xcfg2", "small-ulysses2xtensor2"])
def test_a_gangs_images_are_diffusers_within_one_level(checkpoint, settings, request, tmp_path):
    """The gang's latents of the mix's requests without an adapter or a cache, decoded, against diffusers'
    pipeline from the same embeddings and seeds."""
    model = str(request.getfixturevalue(f"{checkpoint}_dir"))
    adapters = {"A": str(make_adapter(model, tmp_path / "A", rank=4, seed=1)),
                "B": str(make_adapter(model, tmp_path / "B", rank=4, seed=2))}
    latents = run_gang(denoise_mix, settings, model, adapters)[0][0]
    vae = VaeRunner.load(model)
    dim = QwenImageTransformer2DModel.load_config(model, subfolder="transformer")["joint_attention_dim"]
    plain = [r for group in mix_requests(dim, adapters) for r in group if r.request_id in ("base", "cfg-plain")]
    assert len(plain) == 2
    for mixed in plain:
        ours = vae.decode([Latents(latents[mixed.request_id], mixed.params.height, mixed.params.width)])[0]
        theirs = diffusers_image(model, mixed)
        assert within_one_level(ours, theirs), (mixed.request_id, abs(ours.astype(int) - theirs.astype(int)).max())
