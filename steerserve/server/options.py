"""``steerserve serve``'s options as the server's settings: checked, and the process prepared.

Why here and not in the CLI: which dtype a CPU gets, eager vs compiled, the KV cache sizing rule,
binding every core and the refusal of a bad A/B experiment before the engine starts are server
decisions; a supervisor or a test that starts the server in-process builds the same settings
with :func:`settings`. A bad option is an :class:`OptionError` naming it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steerserve.engine.spec import DEFAULT_OPS_PER_LAYER, DEFAULT_ROWS_PER_REQUEST
from steerserve.server.defaults import DRAIN_SECONDS, KEEP_ALIVE_SECONDS
from steerserve.server.state import ServerSettings
from steerserve.server.steering import DEFAULT_MODE, MODES

logger = logging.getLogger(__name__)


class OptionError(ValueError):
    """A setting the server cannot start with, and the option (``param``) that says it (None:
    the message names it)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ServeOptions:
    """``steerserve serve``'s options as given (see cli.py for their help)."""

    model: str = "default"
    vectors_dir: str | None = None  # None: vectors/ of the source tree or image
    host: str = "127.0.0.1"
    dtype: str = "auto"
    max_model_len: int = 2048
    kv_cache_bytes: int = 1 << 30  # 0: vLLM sizes it from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    enforce_eager: bool | None = None  # None: eager on CPU, compiled on GPU
    api_key: str | None = None
    steering: str = DEFAULT_MODE
    served_model_name: str | None = None
    log_level: str = "info"
    drain_seconds: int = DRAIN_SECONDS
    keep_alive_seconds: int = KEEP_ALIVE_SECONDS
    open_admin: bool = False
    ab_split: float = 0.0
    ab_name: str = "default"
    ab_log: str | None = None
    ab_log_content: bool = False
    max_seqs_per_request: int | None = None  # None: half of max_num_seqs (defaults.py)
    ops_per_layer: int = DEFAULT_OPS_PER_LAYER
    quantization: str = "auto"  # engine.cpu.QUANTIZATIONS
    tool_call_parser: str | None = "auto"
    enable_auto_tool_choice: bool | None = None
    chat_template: str | None = None
    engine_args: tuple[str, ...] = ()  # any other `vllm serve` engine flag (vllm_engine_args)
    presets: tuple[str, ...] = ()  # NAME=SPEC (presets.py)
    ab_preset: str | None = None
    ab_store: str | None = None  # sqlite:///PATH or postgresql://... (server/ab_store)
    ab_store_spill: str | None = None
    max_prompt_tokens_per_request: int | None = None  # None: capacity.budget's
    max_scored_tokens_per_request: int | None = None


#: Engine fields steerserve sets from its own options or needs for steering: refused as
#: pass-through flags (the message names the serve option to use instead).
OWN_ENGINE_FIELDS = {
    "model": "--model",
    "dtype": "--dtype",
    "max_model_len": "--max-model-len",
    "max_num_seqs": "--max-num-seqs",
    "kv_cache_memory_bytes": "--kv-cache-bytes",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "tensor_parallel_size": "--tensor-parallel-size",
    "pipeline_parallel_size": "--pipeline-parallel-size",
    "distributed_executor_backend": "--distributed-executor-backend",
    "enforce_eager": "--enforce-eager/--compile",
    "served_model_name": "--served-model-name",
    "hf_overrides": "nothing (the steered architecture is set through it)",
    "additional_config": "nothing (the steering plugin's settings are kept in it)",
    "worker_extension_cls": "nothing (the steering worker extension)",
}


def vllm_engine_args(args: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``vllm serve``'s engine flags given to ``steerserve serve`` (``--max-num-batched-tokens
    512``, ``--enable-chunked-prefill``, ``--seed 3`` …), parsed by vLLM's own parser, so a vLLM
    command line carries over: the ``EngineArgs`` fields given, and their values."""
    if not args:
        return {}
    import argparse

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(exit_on_error=False, add_help=False)
    AsyncEngineArgs.add_cli_args(parser)
    defaults = vars(parser.parse_args([]))
    try:
        given, unknown = parser.parse_known_args(list(args))
    except argparse.ArgumentError as e:
        raise OptionError(str(e), e.argument_name) from None
    if unknown:
        raise OptionError(
            f"not an option of steerserve serve or of vLLM's engine: {' '.join(unknown)}",
            unknown[0],
        )
    out = {k: v for k, v in vars(given).items() if v != defaults.get(k)}
    for field, instead in OWN_ENGINE_FIELDS.items():
        if field in out:
            flag = "--" + field.replace("_", "-")
            raise OptionError(f"set by steerserve: use {instead}", flag)
    return out


def check_presets(presets: tuple[str, ...], ab_preset: str | None) -> None:
    """Each ``--preset NAME=SPEC`` a steering value the API accepts (its vectors are checked once
    the artifacts are loaded), before the engine starts."""
    from steerserve.server.errors import ApiError
    from steerserve.server.presets import DEFAULTS, check_name, parse_option
    from steerserve.server.protocol import parse_steering

    names = set(DEFAULTS)
    for text in presets:
        try:
            name, raw = parse_option(text)
            parse_steering(raw)
        except ValueError as e:
            raise OptionError(str(e), "--preset") from None
        except ApiError as e:
            raise OptionError(f"{text}: {e.message}", "--preset") from None
        if name in names:
            raise OptionError(f"{name}: the name is taken (presets: {sorted(names)})", "--preset")
        names.add(name)
    if ab_preset is None:
        return
    try:
        check_name(ab_preset)
    except ValueError as e:
        raise OptionError(str(e), "--ab-preset") from None
    if ab_preset not in names:
        raise OptionError(f"no preset {ab_preset!r} (presets: {sorted(names)})", "--ab-preset")


def check_experiment(split: float, name: str, log: str | None, store: str | None = None) -> None:
    """Refuse a bad split, an unwritable log or an unusable experiment store (a bad URL, an
    unreachable host, a newer schema: the store is opened and migrated) before the engine
    starts, naming the option."""
    from steerserve.server.experiment import DecisionLog, Experiment

    try:
        Experiment(name, split)
        DecisionLog(log).close()
    except ValueError as e:
        option = str(e).split(":", 1)[0]
        raise OptionError(str(e).split(": ", 1)[-1], option) from None
    if store:
        from steerserve.server.ab_store import open_store

        try:
            open_store(store).close()
        except ValueError as e:
            raise OptionError(str(e), "--ab-store") from None


def _positive(value: int | None, option: str) -> int | None:
    if value is not None and value < 1:
        raise OptionError(f"must be at least 1, not {value}", option)
    return value


def check_seqs_per_request(cap: int | None, max_num_seqs: int) -> None:
    """A cap from 1 to the engine's seats: above it, one request could hold every seat and
    everyone behind it would wait for all of it."""
    if cap is not None and not 1 <= cap <= max_num_seqs:
        raise OptionError(
            f"must be between 1 and --max-num-seqs ({max_num_seqs}), not {cap}",
            "--max-seqs-per-request",
        )


def _model_dir(model: str) -> Path:
    from steerserve.models import resolve_model

    try:
        return Path(resolve_model(model))
    except ValueError as e:
        raise OptionError(str(e), "--model") from None


def settings(opts: ServeOptions) -> ServerSettings:
    """The settings of a server started from ``opts``, after checking them, configuring logging
    at ``log_level`` and binding vLLM's CPU threads to every core (the environment is changed:
    this prepares the process it runs in). The server exits on an engine failure."""
    from steerserve.artifacts import default_vectors_dir

    if opts.steering not in MODES:
        raise OptionError(f"--steering must be off, on or auto, not {opts.steering!r}", None)
    check_experiment(opts.ab_split, opts.ab_name, opts.ab_log, opts.ab_store)
    check_seqs_per_request(opts.max_seqs_per_request, opts.max_num_seqs)
    if not 0 <= opts.ops_per_layer <= DEFAULT_ROWS_PER_REQUEST:  # a request holds no more
        raise OptionError(
            f"--ops-per-layer must be between 0 and {DEFAULT_ROWS_PER_REQUEST}, "
            f"not {opts.ops_per_layer}",
            "--ops-per-layer",
        )
    logging.basicConfig(
        level=opts.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    passed = vllm_engine_args(opts.engine_args)  # before the model: a typo costs nothing
    check_presets(opts.presets, opts.ab_preset)
    if opts.tool_call_parser not in ("auto", "none", None):
        from steerserve.server.hosted import tool_parser_for

        try:
            tool_parser_for(None, opts.tool_call_parser)
        except ValueError as e:
            raise OptionError(str(e).split(": ", 1)[-1], "--tool-call-parser") from None
    engine = _engine_config(opts, _model_dir(opts.model))
    engine.extra.update(passed)
    return ServerSettings(
        engine=engine,
        vectors_dir=opts.vectors_dir or default_vectors_dir(),
        # the 4-bit checkpoint's folder is named w4: serve it under its model's name
        served_model_name=opts.served_model_name or _w4_name(Path(engine.model)),
        api_key=opts.api_key or None,
        steering=opts.steering,
        max_seqs_per_request=opts.max_seqs_per_request,
        drain_seconds=opts.drain_seconds,
        keep_alive_seconds=opts.keep_alive_seconds,
        host=opts.host,
        open_admin=opts.open_admin,
        exit_on_failure=True,
        ab_split=opts.ab_split,
        ab_name=opts.ab_name,
        ab_log=opts.ab_log,
        ab_log_content=opts.ab_log_content,
        ab_store=opts.ab_store or None,
        ab_store_spill=opts.ab_store_spill or None,
        max_prompt_tokens_per_request=_positive(
            opts.max_prompt_tokens_per_request, "--max-prompt-tokens-per-request"
        ),
        max_scored_tokens_per_request=_positive(
            opts.max_scored_tokens_per_request, "--max-scored-tokens-per-request"
        ),
        tool_call_parser=opts.tool_call_parser,
        enable_auto_tool_choice=opts.enable_auto_tool_choice,
        chat_template=opts.chat_template,
        presets=tuple(opts.presets),
        ab_preset=opts.ab_preset,
    )


def _engine_config(opts: ServeOptions, model_dir: Path):  # noqa: ANN202 (EngineConfig: lazy)
    """The engine's config: dtype ``auto`` is float32 on a CPU without native bfloat16, eager on
    CPU and compiled on GPU unless told, and every core bound for the CPU ranks."""
    import torch

    from steerserve.engine.api import EngineConfig
    from steerserve.engine.cpu import W4_DTYPES, bind_all_cores, serve_dtype, w4_kernel

    on_gpu = torch.cuda.is_available()
    enforce_eager = (not on_gpu) if opts.enforce_eager is None else opts.enforce_eager
    if (chosen := serve_dtype(opts.dtype, on_gpu)) != opts.dtype:
        logger.info("dtype auto: %s (no native bfloat16 on this CPU)", chosen)
    w4 = _w4_dir(opts, model_dir, on_gpu)
    if w4 is not None:
        model_dir = w4
        if chosen not in W4_DTYPES:  # only auto gets here: an explicit float32 was refused
            chosen = "bfloat16"
        kernel = "vLLM's GPU choice" if on_gpu else w4_kernel(chosen)
        logger.info("serving 4-bit weights: %s, computed in %s, kernel %s", w4, chosen, kernel)
    ranks = opts.tensor_parallel_size * opts.pipeline_parallel_size
    if bound := bind_all_cores(os.environ, on_gpu, ranks):
        logger.info("VLLM_CPU_OMP_THREADS_BIND=%s (every core)", bound)
    kv = opts.kv_cache_bytes
    return EngineConfig(
        model=str(model_dir),
        dtype=chosen,
        max_model_len=opts.max_model_len,
        max_num_seqs=opts.max_num_seqs,
        kv_cache_memory_bytes=kv or None,
        gpu_memory_utilization=None if kv else opts.gpu_memory_utilization,
        tensor_parallel_size=opts.tensor_parallel_size,
        pipeline_parallel_size=opts.pipeline_parallel_size,
        distributed_executor_backend=opts.distributed_executor_backend,
        enforce_eager=enforce_eager,
        ops_per_layer=opts.ops_per_layer,
    )


def _w4_name(model: Path) -> str | None:
    """A 4-bit checkpoint (``<model>/w4``) is served under its model's name."""
    from steerserve.models import w4_dir

    return model.parent.name if w4_dir(model.parent) == model else None


def _w4_dir(opts: ServeOptions, model_dir: Path, on_gpu: bool) -> Path | None:
    """The 4-bit checkpoint to serve, or None for ``model_dir`` itself. ``w4`` that cannot be
    honoured is an OptionError naming why; ``auto`` falls back to full precision, saying why."""
    from steerserve.engine.cpu import QUANTIZATIONS, W4_DTYPES, serve_w4
    from steerserve.models import w4_dir

    if opts.quantization not in QUANTIZATIONS:
        raise OptionError(
            f"must be one of {', '.join(QUANTIZATIONS)}, not {opts.quantization!r}",
            "--quantization",
        )
    if not serve_w4(opts.quantization, on_gpu):
        return None
    w4 = w4_dir(model_dir)
    why = None
    if w4 is None:
        why = f"{model_dir} has no 4-bit checkpoint (written for the embedded chat model)"
    elif opts.dtype not in ("auto", *W4_DTYPES):
        why = f"4-bit weights compute in {' or '.join(W4_DTYPES)}, not --dtype {opts.dtype}"
    if why and opts.quantization == "w4":
        raise OptionError(why, "--quantization")
    if why:
        logger.info("quantization auto: full precision, %s", why)
        return None
    return w4
