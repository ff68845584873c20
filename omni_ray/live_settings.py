"""What each deployment of the app may change while its replicas run: its ``user_config`` in the Serve config, which
Serve hands to the deployment's ``reconfigure`` in place (``serve deploy``, KubeRay's ``serveConfigV2``), no replica
replaced.

A deployment's live settings lie over what the preset gave it at start: a key set takes its value, a key left out
(or the whole ``user_config`` removed) gives the preset's back. A stage's batch limits may be lowered, not raised past
the preset's: a replica was sized at start for those (the DiT's compiled shapes and warm-up, vLLM's scheduler).
Anything else changes through the app's ``args`` (``overrides``), which replaces every replica, one at a time.
``parse`` raises ``LiveSettingsError`` naming the key and saying which way it can change.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveInt, ValidationError

from omni_ray.config import DiTConfig, PipelineConfig
from omni_ray.quotas import QuotaSettings

ARGS = "change it through the app's args.overrides instead (every replica replaced)"


class LiveSettingsError(ValueError):
    """A ``user_config`` a deployment cannot apply while it runs; the message names the key."""


class LiveSettings(BaseModel):
    """One deployment's live settings; a field left unset keeps the preset's value."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    deployment: ClassVar[str]  # its name in the Serve config
    section: ClassVar[str | None] = None  # the preset's section the settings lie over (None: none)
    lowered_only: ClassVar[tuple[str, ...]] = ()  # limits the replica was sized for at start: never raised live

    @classmethod
    def start(cls, config: PipelineConfig) -> Any:
        """What the deployment starts with: its section of the preset."""
        return getattr(config, cls.section) if cls.section is not None else None

    @classmethod
    def parse(cls, user_config: Any, start: Any = None) -> LiveSettings:
        """The settings ``user_config`` (Serve's, None for none) sets, checked against what the deployment started
        with (``start``: its stage's section of the preset); LiveSettingsError naming the key otherwise."""
        if user_config is None:
            user_config = {}
        if not isinstance(user_config, dict):
            raise LiveSettingsError(f"{cls.deployment}: user_config must be a mapping of {cls._keys()}, not "
                                    f"{type(user_config).__name__}")
        unknown = sorted(set(user_config) - set(cls.model_fields))
        if unknown:
            raise LiveSettingsError(f"{cls.deployment}: user_config {', '.join(map(repr, unknown))} cannot change "
                                    f"while the replicas run ({cls._keys()} can); {ARGS}")
        try:
            settings = cls.model_validate(user_config)
        except ValidationError as err:
            raise _error(cls.deployment, err) from None
        settings.check(start)
        return settings

    def check(self, start: Any) -> None:
        """Raises LiveSettingsError where a value does not fit what the deployment started with: a limit of
        ``lowered_only`` above the preset's."""
        for key in self.lowered_only:
            value, preset = getattr(self, key), getattr(start, key)
            if value is not None and preset is not None and value > preset:
                raise LiveSettingsError(
                    f"{self.deployment}: user_config {key} {value} is above the preset's {self.section}.{key} "
                    f"({preset}), which the replicas were sized for at start: it may only be lowered live; to raise "
                    f"it, {ARGS}")

    @classmethod
    def _keys(cls) -> str:
        return ", ".join(cls.model_fields) or "nothing"

    def set_fields(self) -> dict[str, Any]:
        """The keys set, with their values (a key set to null keeps the preset's value, as one left out)."""
        return self.model_dump(exclude_none=True)


def _error(deployment: str, err: ValidationError) -> LiveSettingsError:
    first = err.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return LiveSettingsError(f"{deployment}: user_config {where}{': ' if where else ''}{first['msg']}")


class DiTLive(LiveSettings):
    """The DiT's step limits and scheduling knobs, applied between two steps."""

    deployment: ClassVar[str] = "DiT"
    section: ClassVar[str] = "dit"
    lowered_only: ClassVar[tuple[str, ...]] = ("max_batch_size", "max_batch_tokens")
    max_batch_size: PositiveInt | None = Field(None, description="dit.max_batch_size, at most the preset's.")
    max_batch_tokens: PositiveInt | None = Field(None, description="dit.max_batch_tokens, at most the preset's.")
    max_wait_steps: PositiveInt | None = Field(None, description="dit.max_wait_steps.")
    max_paused: NonNegativeInt | None = Field(None, description="dit.max_paused.")
    priority_aging_s: float | None = Field(None, description="dit.priority_aging_s.")

    def check(self, start: DiTConfig) -> None:
        self.applied_to(start)

    def applied_to(self, start: DiTConfig) -> DiTConfig:
        """The DiT section the replica runs on: the preset's with these laid over, checked as a preset is."""
        super().check(start)
        fields = self.set_fields()
        if start.scheduling == "fifo" and set(fields) & {"max_batch_tokens", "max_paused", "priority_aging_s"}:
            raise LiveSettingsError(f"{self.deployment}: user_config {sorted(set(fields) - {'max_batch_size'})} "
                                    "are priority scheduling's, and this DiT schedules fifo (dit.scheduling)")
        try:
            return DiTConfig.model_validate({**start.model_dump(), **fields})
        except ValidationError as err:
            raise _error(self.deployment, err) from None


class VAELive(LiveSettings):
    deployment: ClassVar[str] = "VAE"
    section: ClassVar[str] = "vae"
    lowered_only: ClassVar[tuple[str, ...]] = ("max_batch_size",)
    max_batch_size: PositiveInt | None = Field(None, description="vae.max_batch_size (frames a call decodes), at "
                                               "most the preset's.")


class EncoderLive(LiveSettings):
    deployment: ClassVar[str] = "Encoder"
    section: ClassVar[str] = "encoder"
    lowered_only: ClassVar[tuple[str, ...]] = ("max_num_seqs",)
    max_num_seqs: PositiveInt | None = Field(None, description="encoder.max_num_seqs (prompts vLLM runs at once), "
                                             "at most the preset's.")


class CoordinatorLive(LiveSettings):
    """The coordinator's admission margins and the API keys' quotas."""

    deployment: ClassVar[str] = "Coordinator"
    key_limits: dict[str, Any] | str | None = Field(
        None, description="Per-key quotas in OMNI_RAY_KEY_LIMITS' form (a mapping, or its text), in place of that "
        "variable's; an empty mapping turns them off.")
    admission_margin: NonNegativeFloat | None = Field(
        None, description="Share of the DiT's estimate kept in reserve when admitting a request (0.1 unset).")
    admission_margin_s: NonNegativeFloat | None = Field(
        None, description="Seconds kept in reserve on top when admitting a request (0.5 unset).")

    def check(self, start: Any = None) -> None:
        self.quota_settings()

    def quota_settings(self, num_keys: int | None = None) -> QuotaSettings | None:
        """The quotas ``key_limits`` sets (for a server of ``num_keys`` API keys), None where it sets none."""
        if self.key_limits is None:
            return None
        text = self.key_limits if isinstance(self.key_limits, str) else json.dumps(self.key_limits)
        try:
            return QuotaSettings.parse(text, num_keys) if text.strip() not in ("", "{}") else QuotaSettings()
        except ValueError as err:
            raise LiveSettingsError(f"{self.deployment}: user_config key_limits: {err}") from None


LIVE_SETTINGS: dict[str, type[LiveSettings]] = {
    cls.deployment: cls for cls in (CoordinatorLive, EncoderLive, DiTLive, VAELive)}
