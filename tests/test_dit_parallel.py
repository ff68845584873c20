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

from omni_ray.config import ParallelSettings
from testing.gang import run_gang
from testing.lora_files import make_adapter
from testing.parallel import denoise_mix

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def adapters(tiny_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {"A": str(make_adapter(tiny_dir, root / "A", rank=4, alpha=8, seed=1)),
            "B": str(make_adapter(tiny_dir, root / "B", rank=8, seed=2))}


@pytest.fixture(scope="module")
def one_rank(tiny_dir, adapters) -> dict[str, torch.Tensor]:
    return denoise_mix(None, str(tiny_dir), adapters)[0]


GANGS = {
    "cfg2": (ParallelSettings(cfg=2), "sequence"),
    "ulysses2": (ParallelSettings(ulysses=2), "sequence"),
    "ring2": (ParallelSettings(ring=2), "sequence"),
    "ulysses2-rows": (ParallelSettings(ulysses=2), "rows"),
    "ulysses2xcfg2": (ParallelSettings(ulysses=2, cfg=2), "sequence"),
}


@pytest.mark.parametrize("gang", GANGS)
def test_a_gang_denoises_what_one_rank_does(gang, tiny_dir, adapters, one_rank):
    settings, split = GANGS[gang]
    results = run_gang(denoise_mix, settings, str(tiny_dir), adapters, 4, split)
    for rank, (latents, _) in enumerate(results):
        assert latents.keys() == one_rank.keys()
        for rid, expected in one_rank.items():
            difference = (latents[rid] - expected).abs().max().item()
            assert difference <= TOLERANCE, f"rank {rank}, {rid}: {difference}"
