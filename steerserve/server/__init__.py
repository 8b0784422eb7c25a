"""The OpenAI-compatible HTTP server: FastAPI on vLLM's AsyncLLM with per-request steering.

``create_app(ServerSettings(...))`` builds the app; ``steerserve serve`` runs it with uvicorn.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServerSettings", "create_app"]


def __getattr__(name: str) -> Any:  # lazy: importing the package must not import vLLM
    if name in __all__:
        from steerserve.server import app

        return getattr(app, name)
    raise AttributeError(name)
