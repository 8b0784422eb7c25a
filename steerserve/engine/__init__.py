"""Everything that runs inside vLLM, and the Python API to build an engine with it.

Heavy imports (vLLM, torch) happen only when an engine is built, so ``import steerserve.engine`` is
cheap in every process.
"""

from steerserve.engine.spec import POSITIONS, SteeringEntry

__all__ = [
    "POSITIONS",
    "Admission",
    "EngineConfig",
    "ModelShape",
    "SteerEngine",
    "SteeringEntry",
]


def __getattr__(name: str):  # lazy: keep plugin loading cheap
    if name in {"Admission", "EngineConfig", "ModelShape", "SteerEngine"}:
        from steerserve.engine import api

        return getattr(api, name)
    raise AttributeError(name)
