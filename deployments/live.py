"""Serve's ``reconfigure``, as every deployment of the app takes it: the deployment's ``user_config`` (in the Serve
config's ``deployments`` entry) read as its live settings (``omni_ray.live_settings``) and applied in place.

It never raises. Ray Serve 2.60 stops a replica whose ``reconfigure`` raises (``DeploymentState``'s startup check
treats a failed reconfigure as a failed start), and a replica it starts with that ``user_config`` fails the same
way: one mistyped key would take the whole stage down. A ``user_config`` that cannot be applied is refused whole
instead: logged as an error, said in the deployment's ``stats()`` (``user_config_refused``) and counted
(``omni_user_config_refusals_total``), while the replica serves on with the settings it had. ``python -m
deployments.check CONFIG`` finds such a key before the deploy.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from deployments import metrics
from omni_ray.config import PipelineConfig
from omni_ray.live_settings import LiveSettings, LiveSettingsError

logger = logging.getLogger("ray.serve")


class LiveDeployment:
    """A deployment whose ``user_config`` changes settings while its replicas run."""

    live_settings: ClassVar[type[LiveSettings]]
    stage = ""  # the metrics' stage label

    def _start_live(self, config: PipelineConfig) -> None:
        """The live settings lie over what the replica started with: its section of ``config`` (``preset``)."""
        self.preset = self.live_settings.start(config)
        self.live: LiveSettings = self.live_settings()
        self.user_config_refused: str | None = None

    async def reconfigure(self, user_config: Any) -> None:
        """Serve calls it when the replica starts with a ``user_config`` and whenever a deploy changes it (an empty
        mapping gives every setting the preset's value back; Serve does not call it when ``user_config`` is
        removed). On the replica's event loop, where its requests run: it does not wait for the engine's step."""
        try:
            live = self.live_settings.parse(user_config, self.preset)
            self._apply(live)
        except LiveSettingsError as err:
            self.user_config_refused = str(err)
            metrics.user_config_refusals.inc(tags={"stage": self.stage})
            logger.error("%s. This replica keeps its live settings: %s", err, self.live.set_fields() or "the preset's")
            return
        self.live, self.user_config_refused = live, None
        logger.info("%s: live settings %s", self.live_settings.deployment, live.set_fields() or "the preset's")

    def _apply(self, live: LiveSettings) -> None:
        """Puts ``live`` into effect (LiveSettingsError where it cannot, before changing anything)."""
        raise NotImplementedError

    def live_stats(self) -> dict:
        """For ``stats()``: the live settings in effect, and the last ``user_config`` refused (None: none since the
        last one applied)."""
        return {"live_settings": self.live.set_fields(), "user_config_refused": self.user_config_refused}
