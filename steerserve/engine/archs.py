"""Steerable subclasses of vLLM's stock models: ``Steered<Arch>``.

Selected per engine with ``hf_overrides={"architectures": ["Steered<Arch>"]}``: no fork, no renamed
weights (the subclass adds only non-persistent buffers and forward hooks), no edit of the config on
disk. Classes are built lazily on first lookup, so importing this module costs nothing.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

from steerserve.engine.spec import DEFAULT_OPS_PER_LAYER, DEFAULT_ROWS_PER_REQUEST

logger = logging.getLogger(__name__)

#: stock architecture -> "module:Class" in vLLM
SUPPORTED: dict[str, str] = {
    "LlamaForCausalLM": "vllm.model_executor.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "vllm.model_executor.models.mistral:MistralForCausalLM",
    "Qwen2ForCausalLM": "vllm.model_executor.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "vllm.model_executor.models.qwen3:Qwen3ForCausalLM",
    "Gemma3ForCausalLM": "vllm.model_executor.models.gemma3:Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration": "vllm.model_executor.models.gemma3_mm:Gemma3ForConditionalGeneration",
}
PREFIX = "Steered"


def steered_name(arch: str) -> str:
    return PREFIX + arch


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The inner module holding ``layers`` and the pipeline-parallel ``start_layer/end_layer``."""
    for path in ("model", "language_model.model", "language_model"):
        m: Any = model
        for part in path.split("."):
            m = getattr(m, part, None)
        if m is not None and hasattr(m, "layers") and hasattr(m, "start_layer"):
            return m
    raise TypeError(f"{type(model).__name__}: cannot find the decoder layers to steer")


class SteeringMixin:
    """Allocates the steering buffers and hooks the owned decoder layers at construction, i.e.
    before profiling, compilation and graph capture, under the target device."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        from steerserve.engine.buffers import SteeringState
        from steerserve.engine.runner import check_config, install_v1_seam
        from steerserve.engine.seeds import install_cpu_seed_rewind
        from steerserve.engine.signals import ignore_group_signals_in_worker

        check_config(vllm_config)
        opts = (vllm_config.additional_config or {}).get("steerserve") or {}
        sched = vllm_config.scheduler_config
        hf = vllm_config.model_config.hf_text_config
        decoder = _decoder(self)
        num_layers = int(hf.num_hidden_layers)
        wanted = opts.get("layers")
        owned = [
            i
            for i in range(decoder.start_layer, decoder.end_layer)
            if wanted is None or i in set(wanted)
        ]
        device = next(self.parameters()).device
        self.steering = SteeringState(
            num_layers=num_layers,
            hidden_size=int(hf.hidden_size),
            max_num_seqs=int(sched.max_num_seqs),
            max_num_tokens=int(sched.max_num_batched_tokens) + int(sched.max_num_seqs),
            rows_per_request=int(opts.get("rows_per_request", DEFAULT_ROWS_PER_REQUEST)),
            device=device,
            # CPU has no graphs (eager hooks skip, compiled ops are gated); on GPU only eager mode
            # is safe (graphs would capture a skip).
            skip_idle=device.type == "cpu" or bool(vllm_config.model_config.enforce_eager),
            ops_per_layer=int(opts.get("ops_per_layer", DEFAULT_OPS_PER_LAYER)),
        )
        self.steering.attach(decoder.layers, owned)
        if not vllm_config.use_v2_model_runner:
            install_v1_seam()
            if device.type == "cpu":
                install_cpu_seed_rewind()
        ignore_group_signals_in_worker()
        logger.info("steerserve: steering layers %s of %d", owned, num_layers)

    def compute_logits(self, hidden_states: torch.Tensor, *args: Any, **kw: Any) -> Any:
        """The stock logits; the steered rows' states checked on the way (``degenerate.py``)."""
        logits = super().compute_logits(hidden_states, *args, **kw)  # type: ignore[misc]
        self.steering.check_sampled(hidden_states)
        return logits

    @staticmethod
    def get_model_state_cls() -> type:
        from steerserve.engine.runner import steering_model_state_cls

        return steering_model_state_cls()


_classes: dict[str, type] = {}


def build(arch: str) -> type:
    if arch not in SUPPORTED:
        raise ValueError(
            f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED)}"
        )
    if arch not in _classes:
        mod, cls = SUPPORTED[arch].split(":")
        base = getattr(importlib.import_module(mod), cls)
        _classes[arch] = type(steered_name(arch), (SteeringMixin, base), {"__module__": __name__})
    return _classes[arch]


def __getattr__(name: str) -> type:
    if name.startswith(PREFIX) and name[len(PREFIX) :] in SUPPORTED:
        return build(name[len(PREFIX) :])
    raise AttributeError(name)
