"""Worker extension (``worker_extension_cls``): vector registration and a self-check, reached from
the front end with ``collective_rpc`` on every TP/PP rank."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class SteerWorkerExtension:
    def _steering(self) -> Any:
        st = getattr(self.model_runner.get_model(), "steering", None)  # type: ignore[attr-defined]
        if st is None:
            raise RuntimeError("steerserve: the loaded model is not a Steered<Arch> model")
        return st

    def steer_register(self, name: str, data: bytes, digest: str) -> str:
        """Register a float32 vector (raw little-endian bytes) under ``name``."""
        t = torch.from_numpy(np.frombuffer(data, dtype="<f4").copy())
        self._steering().register_vector(name, t, digest)
        return digest

    def steer_info(self) -> dict:
        return self._steering().info()
