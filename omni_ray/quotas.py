"""Per-key quotas: what each API key (by its name, ``key0``, ``key1``; never the key) may use, and the ledger that
counts it.

Four limits, each optional: requests per minute (``rpm``), images per minute (``ipm``: ``n``, and each of a Layered
request's layers counts as an image), requests running at once (``concurrent``) and DiT work per minute (``work``,
in DiT token-steps: the plan's work tokens per step, two passes with true CFG, times its steps and its ``n``: the
figure the DiT's load model multiplies by its measured seconds per token to get cost-seconds; counted in tokens
so that a key's quota means the same on every replica and under any load). Per-minute limits are sliding windows
over the last 60 s of admitted requests; a refused request is not counted.

The ledger is plain Python with one clock: the app keeps one for all coordinator replicas (a detached actor,
``deployments.http.quotas``), and tests drive it with a fake clock.
"""

from __future__ import annotations

import enum
import json
import math
import re
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, ValidationError

WINDOW_S = 60.0  # the per-minute limits' sliding window
DEFAULT = "default"  # the entry every key takes its unset limits from
KEY_NAME = re.compile(r"key\d+")


class Limit(enum.Enum):
    """The limits a key may have, by the name the settings use."""

    RPM = "rpm"
    IPM = "ipm"
    CONCURRENT = "concurrent"
    WORK = "work"

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self]

    @property
    def error_type(self) -> str:
        """OpenAI's error ``type`` for a refusal by this limit: ``tokens`` for work, else ``requests``."""
        return "tokens" if self is Limit.WORK else "requests"


_DESCRIPTIONS = {Limit.RPM: "requests per minute (RPM)", Limit.IPM: "images per minute (IPM)",
                 Limit.CONCURRENT: "concurrent requests", Limit.WORK: "DiT work tokens per minute (TPM)"}


class KeyLimits(BaseModel):
    """One key's limits; an unset one does not apply."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rpm: int | None = Field(None, gt=0, description="Requests per minute (a sliding 60 s window).")
    ipm: int | None = Field(None, gt=0, description="Images per minute: each request's n, times a Layered request's "
                            "layers.")
    concurrent: int | None = Field(None, gt=0, description="Requests running at once; one is released when its "
                                   "response ends (JSON, stream, client gone, error) or, at the latest, at its "
                                   "deadline.")
    work: float | None = Field(None, gt=0, description="DiT token-steps per minute: work tokens per step (two "
                               "passes with true CFG) x steps x n.")

    def over(self, base: KeyLimits) -> KeyLimits:
        """These limits, with ``base``'s where these leave one unset."""
        return base.model_copy(update=self.model_dump(exclude_none=True))

    def value(self, limit: Limit) -> float | None:
        return getattr(self, limit.value)

    @property
    def is_empty(self) -> bool:
        return all(self.value(limit) is None for limit in Limit)


class QuotaSettings(BaseModel):
    """Every key's limits: ``default`` for each key, and per key name the limits that differ."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    default: KeyLimits = Field(KeyLimits(), description="The limits of every key that names none of its own.")
    keys: dict[str, KeyLimits] = Field({}, description="Per key name (key0, key1: its place in OMNI_RAY_API_KEY's "
                                       "list), the limits that differ from the default.")

    @classmethod
    def parse(cls, text: str, num_keys: int | None = None) -> QuotaSettings:
        """Settings from JSON (``{"default": {"rpm": 60}, "key1": {"ipm": 10}}``) or lines (or ``;``-separated
        entries) of ``name: rpm=60, ipm=10`` (``#`` starts a comment). With ``num_keys``, a name past the keys the
        server has is an error (a typo would otherwise leave that key unlimited). ValueError naming the entry."""
        entries = _json_entries(text) if text.lstrip().startswith("{") else _line_entries(text)
        for name in entries:
            if name != DEFAULT and not KEY_NAME.fullmatch(name):
                raise ValueError(f"key limits: {name!r} is neither 'default' nor a key's name (key0, key1, ...)")
            if name != DEFAULT and num_keys is not None and int(name[3:]) >= num_keys:
                raise ValueError(f"key limits: {name!r} names no key: OMNI_RAY_API_KEY has {num_keys} key(s), "
                                 f"key0..key{num_keys - 1}")
        limits = {}
        for name, values in entries.items():
            try:
                limits[name] = KeyLimits.model_validate(values)
            except ValidationError as err:
                first = err.errors()[0]
                where = ".".join(map(str, first["loc"]))
                raise ValueError(f"key limits: {name}.{where}: {first['msg']}") from None
        return cls(default=limits.pop(DEFAULT, KeyLimits()), keys=limits)

    def for_key(self, name: str) -> KeyLimits:
        return self.keys.get(name, KeyLimits()).over(self.default)

    @property
    def is_empty(self) -> bool:
        return self.default.is_empty and all(limits.is_empty for limits in self.keys.values())


def _json_entries(text: str) -> dict[str, dict]:
    try:
        entries = json.loads(text)
    except ValueError as err:
        raise ValueError(f"key limits: not valid JSON: {err}") from None
    if not isinstance(entries, dict) or not all(isinstance(value, dict) for value in entries.values()):
        raise ValueError("key limits: JSON must be an object of objects, {\"default\": {\"rpm\": 60}, ...}")
    return entries


def _line_entries(text: str) -> dict[str, dict]:
    entries: dict[str, dict] = {}
    for raw in re.split(r"[;\n]", text):
        entry = raw.split("#", 1)[0].strip()
        if not entry:
            continue
        name, colon, rest = entry.partition(":")
        name = name.strip()
        if not colon or not name:
            raise ValueError(f"key limits: {entry!r}: expected 'name: rpm=60, ipm=10, concurrent=2, work=1e6'")
        if name in entries:
            raise ValueError(f"key limits: {name!r} given more than once")
        values = {}
        for pair in filter(None, (part.strip() for part in rest.split(","))):
            limit, equals, value = (part.strip() for part in pair.partition("="))
            if not equals:
                raise ValueError(f"key limits: {name}: {pair!r} is not 'limit=value'")
            try:
                values[limit] = float(value) if limit == Limit.WORK.value else int(value)
            except ValueError:
                raise ValueError(f"key limits: {name}.{limit}: {value!r} is not a number") from None
        entries[name] = values
    return entries


@dataclass(frozen=True, slots=True)
class Charge:
    """What one request takes of its key's limits."""

    images: int  # n, times a Layered request's layers
    work: float  # DiT token-steps
    requests: int = 1

    def amount(self, limit: Limit) -> float:
        return {Limit.RPM: self.requests, Limit.IPM: self.images, Limit.WORK: self.work,
                Limit.CONCURRENT: self.requests}[limit]


@dataclass(frozen=True, slots=True)
class Decision:
    """The ledger's answer: a lease to release when the request ends, or the limit it would pass and when it would
    fit (``retry_after_s``; ``math.inf`` when it never fits: it asks for more than the limit itself)."""

    lease: str | None = None
    limit: Limit | None = None
    retry_after_s: float = 0.0
    used: float = 0.0  # what the limit counts now (refused: the refusing limit's; else nothing)
    allowed: float = 0.0

    @property
    def admitted(self) -> bool:
        return self.lease is not None


WINDOWED = (Limit.RPM, Limit.IPM, Limit.WORK)


@dataclass(slots=True)
class _KeyUse:
    """One key's use: admitted requests' charges in the window (oldest first) with their totals, and its leases."""

    spent: deque[tuple[float, Charge]] = field(default_factory=deque)  # (admitted at, charge)
    totals: dict[Limit, float] = field(default_factory=lambda: dict.fromkeys(WINDOWED, 0.0))
    leases: dict[str, float] = field(default_factory=dict)  # lease -> when it lapses unreleased

    def expire(self, now: float) -> None:
        while self.spent and self.spent[0][0] <= now - WINDOW_S:
            _, charge = self.spent.popleft()
            for limit in WINDOWED:
                self.totals[limit] -= charge.amount(limit)
        for lease in [lease for lease, lapses in self.leases.items() if lapses <= now]:
            del self.leases[lease]

    def used(self, limit: Limit) -> float:
        return len(self.leases) if limit is Limit.CONCURRENT else self.totals[limit]

    def wait(self, limit: Limit, allowed: float, amount: float, now: float) -> float:
        """Seconds until ``amount`` more fits under ``allowed``: 0 when it fits now, inf when it never can."""
        excess = self.used(limit) + amount - allowed
        if excess <= 1e-9:
            return 0.0
        if amount > allowed:
            return math.inf
        if limit is Limit.CONCURRENT:
            return 1.0  # when a running request ends, which nobody can tell
        for admitted_at, charge in self.spent:  # the oldest leave the window first
            excess -= charge.amount(limit)
            if excess <= 1e-9:
                return admitted_at + WINDOW_S - now
        raise AssertionError("the window's totals disagree with its entries")


class QuotaLedger:
    """Every key's use, against the limits each call brings (so that replicas on a changed config apply theirs).
    Holds only admitted requests of the last minute and running leases: nothing grows with time."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.keys: dict[str, _KeyUse] = {}

    def acquire(self, key: str, limits: KeyLimits, charge: Charge, lease_s: float) -> Decision:
        """Admits the request (a lease that lapses after ``lease_s`` unless released first: a coordinator replica
        that died holding it frees it then) or refuses it by the limit it waits longest for."""
        now = self.clock()
        use = self.keys.setdefault(key, _KeyUse())
        use.expire(now)
        refusal = Decision()
        for limit in Limit:
            allowed = limits.value(limit)
            if allowed is None:
                continue
            wait = use.wait(limit, allowed, charge.amount(limit), now)
            if wait > refusal.retry_after_s:
                refusal = Decision(limit=limit, retry_after_s=wait, used=use.used(limit), allowed=allowed)
        if refusal.limit is not None:
            return refusal
        use.spent.append((now, charge))
        for limit in WINDOWED:
            use.totals[limit] += charge.amount(limit)
        lease = uuid.uuid4().hex
        use.leases[lease] = now + lease_s
        return Decision(lease=lease)

    def release(self, key: str, lease: str) -> None:
        """Ends a request's lease (again: nothing)."""
        if (use := self.keys.get(key)) is not None:
            use.leases.pop(lease, None)

    def usage(self, key: str) -> dict[str, float]:
        """What each limit counts now for ``key``: the window's totals and the running requests."""
        use = self.keys.get(key, _KeyUse())
        use.expire(self.clock())
        return {limit.value: use.used(limit) for limit in Limit}
