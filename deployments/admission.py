"""What the coordinator promises a request: admitted, it finishes within its deadline, given the load it was admitted
into; what cannot be promised is refused at once (503, ``Retry-After``).

A request's time is the DiT's share, which the DiT replica it will reach estimates (``DiTLoad``: the work that will
run ahead of it, requests admitted but not yet there included), and the rest: its prompt's encoding, its image
encodes and decodes, the queues in front of them, and the hops between the stages. ``Admission`` learns the rest from
the requests it saw finish (each image's time to done less its DiT time, the largest of the last ``MEMORY`` of each
kind), and gives the DiT a budget: the deadline less that, less a margin for what neither can know (a step slower
than measured, a late wake-up): ``margin`` of the DiT's share and ``margin_s`` on top.
"""

from __future__ import annotations

from collections import deque

from omni_ray.api.planning import GenerationPlan

MEMORY = 32  # images of each kind whose time outside the DiT is remembered
UNKNOWN_OUTSIDE_S = 1.0  # outside the DiT, before any request of any kind finished


class Admission:
    """The coordinator's side of early refusal: the budget a request's DiT share must fit."""

    def __init__(self, margin: float = 0.1, margin_s: float = 0.5):
        self.margin = margin
        self.margin_s = margin_s
        self.outside: dict[tuple, deque[float]] = {}  # kind -> seconds outside the DiT of its last images

    def budget_s(self, plan: GenerationPlan) -> float:
        """Seconds the DiT may take for the plan's images (its estimate, the work ahead included) for the request to
        finish within its deadline."""
        return (plan.timeout_s - self.outside_s(plan) - self.margin_s) / (1 + self.margin)

    def outside_s(self, plan: GenerationPlan) -> float:
        """The most that the last images of the plan's kind spent outside the DiT (of any kind, before one of its
        own finished)."""
        seen = self.outside.get(_kind(plan))
        if seen:
            return max(seen)
        return max((max(times) for times in self.outside.values()), default=UNKNOWN_OUTSIDE_S)

    def observe(self, plan: GenerationPlan, image_s: float, dit_s: float) -> None:
        """An image of the plan was done ``image_s`` after its request started, ``dit_s`` of them at the DiT
        (queued included)."""
        self.outside.setdefault(_kind(plan), deque(maxlen=MEMORY)).append(max(0.0, image_s - dit_s))


def _kind(plan: GenerationPlan) -> tuple:
    """What the time outside the DiT depends on: the image's size (its decode), the input images (their encodes),
    the images per request (decoded side by side) and the prompt's caption (Layered)."""
    inputs = len(plan.inputs.vae) if plan.inputs is not None else 0
    return plan.height, plan.width, inputs, len(plan.control_images), plan.request.n, plan.layers, plan.caption
