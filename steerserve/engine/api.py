"""Python API: build a vLLM engine with the steering plugin, register vectors, run requests.

``Admission`` is the front-end half (validation, wire encoding, prefix-cache key) shared by the
offline :class:`SteerEngine` here and the server's async engine.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from steerserve import __version__
from steerserve.engine import defaults, plugin, prefix, spec
from steerserve.engine.archs import SUPPORTED, steered_name
from steerserve.engine.registry import RegisteredVector, VectorRegistry
from steerserve.engine.spec import DEFAULT_OPS_PER_LAYER, DEFAULT_ROWS_PER_REQUEST

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "steerserve.engine.worker.SteerWorkerExtension"
#: vLLM's structured-outputs config in a steerserve engine, unless one is given.
STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}


@dataclass
class EngineConfig:
    """What an engine is built from. ``extra`` passes any other vLLM ``EngineArgs`` field."""

    model: str
    tokenizer: str | None = None
    # the name vLLM's own metrics label the model with (None: the model's path)
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = defaults.MAX_MODEL_LEN
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    max_num_batched_tokens: int | None = None
    # None: defaults.CPU_KV_CACHE_MEMORY_BYTES on a CPU; on a GPU gpu_memory_utilization sizes it
    kv_cache_memory_bytes: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: vLLM's default (mp); "ray" multi-node
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    seed: int = 0
    steering: bool = True  # False: a stock engine without the plugin (for comparisons)
    steerable_layers: list[int] | None = None
    rows_per_request: int = DEFAULT_ROWS_PER_REQUEST
    # non-additive entries (ablate, replace, interp) one request may stack on a layer; 0 keeps
    # their kernel out of the engine (additive steering only)
    ops_per_layer: int = DEFAULT_OPS_PER_LAYER
    max_abs_scale: float = spec.DEFAULT_MAX_ABS_SCALE
    max_entries: int = spec.DEFAULT_MAX_ENTRIES
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelShape:
    architecture: str
    num_layers: int
    hidden_size: int

    @classmethod
    def read(cls, model: str) -> ModelShape:
        path = Path(model) / "config.json"
        if not path.is_file():
            raise ValueError(
                f"model {model!r}: no config.json (steerserve loads local checkpoints)"
            )
        cfg = json.loads(path.read_text())
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError(f"model {model!r}: config.json names no architecture")
        text = cfg.get("text_config") or cfg
        return cls(archs[0], int(text["num_hidden_layers"]), int(text["hidden_size"]))


def engine_kwargs(cfg: EngineConfig, shape: ModelShape) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` / ``AsyncEngineArgs``."""
    kw: dict[str, Any] = dict(
        model=cfg.model,
        tokenizer=cfg.tokenizer,
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        tensor_parallel_size=cfg.tensor_parallel_size,
        pipeline_parallel_size=cfg.pipeline_parallel_size,
        enforce_eager=cfg.enforce_eager,
        enable_prefix_caching=cfg.enable_prefix_caching,
        seed=cfg.seed,
    )
    # Compact JSON (vLLM lets the grammar allow any whitespace): steered answers spent their
    # max_tokens on grammar-legal whitespace (36 of 66 cut before the JSON closed). A given
    # structured_outputs_config (cfg.extra) replaces this whole.
    kw["structured_outputs_config"] = dict(STRUCTURED_OUTPUTS)
    if cfg.served_model_name is not None:
        kw["served_model_name"] = cfg.served_model_name
    if cfg.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    if cfg.distributed_executor_backend is not None:
        kw["distributed_executor_backend"] = cfg.distributed_executor_backend
    if cfg.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    kv = cfg.kv_cache_memory_bytes
    if kv is None and not torch.cuda.is_available():  # vLLM cannot size it from a CPU's memory
        kv = defaults.CPU_KV_CACHE_MEMORY_BYTES
    if kv is not None:
        kw["kv_cache_memory_bytes"] = kv
    if cfg.steering:
        if shape.architecture not in SUPPORTED:
            raise ValueError(
                f"architecture {shape.architecture!r} cannot be steered; supported: "
                f"{', '.join(SUPPORTED)}"
            )
        kw["hf_overrides"] = {"architectures": [steered_name(shape.architecture)]}
        # Part of vLLM's config hash: a compile cache built without the op is never reused.
        kw["additional_config"] = {
            "steerserve": {
                "version": __version__,
                "rows_per_request": cfg.rows_per_request,
                "ops_per_layer": cfg.ops_per_layer,
                "layers": cfg.steerable_layers,
            }
        }
        kw["worker_extension_cls"] = WORKER_EXTENSION
    kw.update(cfg.extra)
    return kw


@dataclass(frozen=True)
class Prepared:
    """A request's admitted steering: what the engine gets."""

    entries: tuple[spec.SteeringEntry, ...]
    extra_args: dict[str, str]

    @property
    def steered(self) -> bool:
        return bool(self.entries)


UNSTEERED = Prepared((), {})


class Admission:
    """Front-end validation of steering against the engine's model and registered vectors."""

    def __init__(self, cfg: EngineConfig, shape: ModelShape) -> None:
        self.cfg = cfg
        self.shape = shape
        self.registry = VectorRegistry(shape.hidden_size)
        self.steerable = None if cfg.steerable_layers is None else frozenset(cfg.steerable_layers)

    def prepare(self, steering: Iterable[Any] | None, *, field: str = "steering") -> Prepared:
        """Validate entries (:class:`spec.SteeringError` naming the field under ``field``) and
        encode them for vLLM, with the prefix-cache key that shares the blocks before the first
        steered token (``engine/prefix.py``)."""
        if steering is None:
            return UNSTEERED
        if not self.cfg.steering:
            raise spec.SteeringError(field, "this engine was built without the steering plugin")
        entries = spec.validate(
            steering,
            num_layers=self.shape.num_layers,
            vectors=self.registry,
            steerable_layers=self.steerable,
            max_abs_scale=self.cfg.max_abs_scale,
            max_entries=self.cfg.max_entries,
            rows_per_request=self.cfg.rows_per_request,
            ops_per_layer=self.cfg.ops_per_layer,
            field=field,
        )
        if not entries:
            return UNSTEERED
        extra = {
            spec.EXTRA_ARGS_KEY: spec.encode(entries),
            prefix.KEY: prefix.key(entries, self.registry.digests()),
        }
        return Prepared(entries, extra)


def with_steering(sampling_params: Any, prepared: Prepared) -> Any:
    """A copy of ``sampling_params`` carrying the steering (the caller's object is untouched)."""
    if not prepared.steered:
        return sampling_params
    sp = copy.copy(sampling_params)
    sp.extra_args = {**(sampling_params.extra_args or {}), **prepared.extra_args}
    return sp


def make_prompt(prompt: str | Sequence[int] | dict) -> dict:
    """vLLM's prompt dict for text, token ids or a dict (copied: a client's ``cache_salt`` in it
    stays the client's; steering keys the cache through ``extra_args``)."""
    if isinstance(prompt, dict):
        return dict(prompt)
    return {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": list(prompt)}


def vector_payload(rv: RegisteredVector) -> tuple[str, bytes, str]:
    return rv.name, rv.tensor.numpy().astype("<f4").tobytes(), rv.sha256


def check_workers(infos: list[dict], cfg: EngineConfig) -> None:
    """Fail loudly if a worker has no hooked layers (a plugin that silently failed to load)."""
    for rank, info in enumerate(infos):
        if not info.get("hooked_layers") and cfg.pipeline_parallel_size == 1:
            raise RuntimeError(
                f"steerserve: worker {rank} has no steered layers; plugin not active"
            )


class SteerEngine:
    """Offline engine (``vllm.LLM``) with the steering plugin.

    >>> eng = SteerEngine(EngineConfig(model="path/to/model"))
    >>> eng.register_vector("recall", v)
    >>> eng.generate(["Q: ..."], params, steering=[[{"vector": "recall", "layer": 5, "scale": 4}]])
    """

    def __init__(self, cfg: EngineConfig) -> None:
        from vllm import LLM

        plugin.activate()
        self.cfg = cfg
        self.shape = ModelShape.read(cfg.model)
        self.admission = Admission(cfg, self.shape)
        self.llm = LLM(**engine_kwargs(cfg, self.shape))
        if cfg.steering:
            check_workers(self.llm.collective_rpc("steer_info"), cfg)

    @property
    def registry(self) -> VectorRegistry:
        return self.admission.registry

    def register_vector(
        self, name: str, tensor: torch.Tensor, source: str | None = None
    ) -> RegisteredVector:
        """Register a vector in the front end and in every worker (idempotent per content)."""
        if not self.cfg.steering:
            raise ValueError("this engine was built without the steering plugin")
        rv = self.registry.add(name, tensor, source)
        self.llm.collective_rpc("steer_register", args=vector_payload(rv))
        return rv

    def worker_info(self) -> list[dict]:
        return self.llm.collective_rpc("steer_info")

    def generate(
        self,
        prompts: Sequence[str | Sequence[int] | dict],
        sampling_params: Any,
        steering: Sequence[Iterable[Any] | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[Any]:
        """Like ``LLM.generate``; ``steering[i]`` is prompt i's entries (or None). All requests
        are admitted before any is submitted, so one bad entry fails the call, not the batch."""
        n = len(prompts)
        steering = [None] * n if steering is None else list(steering)
        if len(steering) != n:
            raise ValueError(f"steering: {len(steering)} items for {n} prompts")
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        prepared = [self.admission.prepare(s) for s in steering]
        return self.llm.generate(
            [make_prompt(p) for p in prompts],
            [with_steering(sp, pr) for sp, pr in zip(sps, prepared, strict=True)],
            use_tqdm=use_tqdm,
        )

    def shutdown(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            if engine is not None and hasattr(engine, "engine_core"):
                engine.engine_core.shutdown()
            self.llm = None

    def __enter__(self) -> SteerEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
