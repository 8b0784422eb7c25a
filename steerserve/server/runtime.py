"""The settings a server runs with: ``steerserve serve``'s (settings.py, declared once) plus what
only a start knows. Apart from settings.py so that reading the options imports no engine."""

from __future__ import annotations

from typing import Any

from pydantic import InstanceOf

from steerserve.engine.api import EngineConfig
from steerserve.server.defaults import REQUEST_TIMEOUT_SECONDS
from steerserve.server.settings import ServeSettings


class ServerSettings(ServeSettings):
    """What the server runs with: ``steerserve serve``'s settings, declared once (settings.py) and
    validated alike for every start (CLI, tests, benches), plus the engine's config the start
    derived and the limits only code sets. Read from its arguments only, never the environment."""

    engine: InstanceOf[EngineConfig]
    exit_on_failure: bool = False  # the CLI: a server whose engine failed or died must not idle
    max_body_bytes: int = 1 << 20
    request_timeout_seconds: float = REQUEST_TIMEOUT_SECONDS  # a request arrives in full by then

    @classmethod
    def settings_customise_sources(cls, settings_cls: Any, init_settings: Any, **_: Any) -> Any:
        return (init_settings,)

    @property
    def api_keys(self) -> tuple[str, ...]:
        return tuple(k for k in self.api_key if k)

    @property
    def admin_keys(self) -> tuple[str, ...]:
        return tuple(k for k in self.admin_key if k)

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return tuple(n for n in self.served_model_name if n)
