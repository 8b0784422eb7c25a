"""Per-request seeds on CPU: rewind a discarded draw by restoring the generator's state."""

from __future__ import annotations

import functools
from typing import Any


def _discarded_cpu_generators(runner: Any) -> dict[int, Any]:
    """The CPU generators of this step's requests whose sampled token will be discarded."""
    batch = runner.input_batch
    gens = batch.generators
    if not gens:
        return {}
    mask = runner.discard_request_mask.np[: batch.num_reqs]
    return {i: g for i, g in gens.items() if i < len(mask) and mask[i] and g.device.type == "cpu"}


def install_cpu_seed_rewind() -> None:
    """Patch ``GPUModelRunner`` (``CPUModelRunner`` inherits it) once; idempotent."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as R

    if getattr(R, "_steerserve_seed_rewind", False):
        return
    orig_sample, orig_bookkeeping = R._sample, R._bookkeeping_sync

    @functools.wraps(orig_sample)
    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        saved = {i: g.get_state() for i, g in _discarded_cpu_generators(self).items()}
        try:
            return orig_sample(self, *args, **kwargs)
        finally:
            for i, state in saved.items():
                self.input_batch.generators[i].set_state(state)

    @functools.wraps(orig_bookkeeping)
    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        batch = self.input_batch
        gens = batch.generators
        cpu = {i for i, g in gens.items() if g.device.type == "cpu"}
        if not cpu:
            return orig_bookkeeping(self, *args, **kwargs)
        batch.generators = {i: g for i, g in gens.items() if i not in cpu}  # already rewound
        try:
            return orig_bookkeeping(self, *args, **kwargs)
        finally:
            batch.generators = gens

    R._sample = _sample
    R._bookkeeping_sync = _bookkeeping_sync
    R._steerserve_seed_rewind = True
