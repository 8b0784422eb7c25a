"""``steerserve serve``'s settings (settings.py) as the server's: checked, and the process prepared."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from steerserve.server.runtime import ServerSettings
from steerserve.server.settings import ENGINE_SETTINGS, FIELDS, ServeSettings, env_var, flag, flags

logger = logging.getLogger(__name__)

#: Settings whose values may hold a secret (a key, a password in a URL): never echoed in errors.
SECRETS = ("api_key", "admin_key", "ab_store")


class OptionError(ValueError):
    """A setting the server cannot start with, and the option (``param``) that says it (None:
    the message names it)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


#: Engine fields steerserve sets from its own settings or needs for steering: refused as
#: pass-through flags (the message names the serve option to use instead).
OWN_ENGINE_FIELDS = {name: flags(name) for name in ENGINE_SETTINGS} | {
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
        raise OptionError(_unknown(unknown[0]), unknown[0].split("=")[0])
    out = {k: v for k, v in vars(given).items() if v != defaults.get(k)}
    for field, instead in OWN_ENGINE_FIELDS.items():
        if field in out:
            flag = "--" + field.replace("_", "-")
            raise OptionError(f"set by steerserve: use {instead}", flag)
    return out


#: ``vllm serve``'s server options ``steerserve serve`` does not take, and what to use instead
#: (those it takes under vLLM's name are settings: --ssl-*, --root-path, --allowed-*, ...).
SERVER_FLAGS_INSTEAD = {
    "uvicorn_log_level": "--log-level (it sets uvicorn's level too)",
    "disable_uvicorn_access_log": "--log-level warning (one 'request' line per request is "
    "logged at info)",
    "enable_request_id_headers": "nothing: X-Request-Id is always echoed when a client sends one",
    "enable_server_load_tracking": "nothing: /load always counts requests in flight",
    "disable_fastapi_docs": "nothing: no docs pages are served (/openapi.json only)",
    "lora_modules": "--preset NAME=SPEC (steering presets are served as model ids; LoRA is not)",
    "uds": "--host and --port (a Unix socket is not served)",
    "middleware": "a proxy in front (no application code is loaded from the command line)",
}


def _unknown(arg: str) -> str:
    """Why ``arg`` is refused: a ``vllm serve`` server option said with what to use instead."""
    from vllm.entrypoints.launchers.cli_args import FrontendArgs

    name = arg.split("=")[0].lstrip("-").replace("-", "_")
    frontend = {f.name for f in dataclasses.fields(FrontendArgs)}
    if name in SERVER_FLAGS_INSTEAD:
        return f"a vllm serve server option steerserve serve does not take: use {SERVER_FLAGS_INSTEAD[name]}"
    if name in frontend:
        return (
            "a vllm serve server option steerserve serve does not take (its own are listed "
            "by 'steerserve serve --help')"
        )
    return f"not an option of steerserve serve or of vLLM's engine: {arg}"


def check_presets(
    presets: tuple[str, ...], ab_preset: str | None, arms: tuple[str, ...] = ()
) -> None:
    """Each ``--preset NAME=SPEC`` a steering value the API accepts (its vectors are checked once
    the artifacts are loaded), and each preset an experiment's arm names one, before the engine
    starts."""
    from steerserve.server.errors import ApiError
    from steerserve.server.presets import DEFAULTS, check_name, parse_option
    from steerserve.server.steering import parse_steering

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
    from steerserve.server.ab.design import parse_arm

    for text in arms:  # parsed already (check_experiment): only the preset's name is new here
        arm = parse_arm(text)
        if arm.preset is not None and arm.preset not in names:
            raise OptionError(
                f"{arm.name}=preset:{arm.preset}: no such preset (presets: {sorted(names)})",
                "--ab-arm",
            )
    if ab_preset is None:
        return
    try:
        check_name(ab_preset)
    except ValueError as e:
        raise OptionError(str(e), "--ab-preset") from None
    if ab_preset not in names:
        raise OptionError(f"no preset {ab_preset!r} (presets: {sorted(names)})", "--ab-preset")


def check_experiment(s: ServeSettings) -> tuple[Any, dict[str, float]] | None:
    """Refuse a bad experiment (arms, allocation, split), an unwritable log or an unusable
    experiment store (a bad URL, an unreachable host, a newer schema: the store is opened and
    migrated) before the engine starts, naming the option; the experiment's (design,
    allocation), or None."""
    from steerserve.server.ab import service
    from steerserve.server.ab.experiment import DecisionLog

    try:
        got = service.design_of(
            s.ab_split, s.ab_name, tuple(s.ab_arm), tuple(s.ab_allocation), s.ab_control,
            s.ab_preset, s.steering,
        )  # fmt: skip
        if got is not None:
            service.check_arms(got[0])
        DecisionLog(s.ab_log).close()
    except ValueError as e:
        option = getattr(e, "param", None) or str(e).split(":", 1)[0]
        raise OptionError(getattr(e, "reason", None) or str(e).split(": ", 1)[-1], option) from None
    if s.ab_store:
        from steerserve.server.ab.store import open_store

        try:
            open_store(s.ab_store).close()
        except ValueError as e:
            raise OptionError(str(e), "--ab-store") from None
    return got


def register_experiment(s: ServeSettings, got: tuple[Any, dict[str, float]] | None) -> None:
    """With a store, create or join the experiment there before the engine starts: other arms
    than a running replica's, or a ramp that would move a subject between treatments, refuse
    the start in one line (nothing written)."""
    if not s.ab_store or got is None:
        return
    from steerserve.server.ab import service
    from steerserve.server.ab.store import experiments, open_store

    store = open_store(s.ab_store)
    try:
        experiments.ensure(store, got[0], got[1], s.ab_note or "", service.by())
    except experiments.Conflict as e:
        raise OptionError(str(e), "--ab-arm") from None
    except ValueError as e:  # DesignError: names its flag
        raise OptionError(getattr(e, "reason", str(e)), getattr(e, "param", "--ab-arm")) from None
    except Exception as e:  # the store went away meanwhile: said in one line
        raise OptionError(f"cannot use the experiment store: {e}", "--ab-store") from None
    finally:
        store.close()


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


def read(given: Mapping[str, Any] | None = None) -> ServeSettings:
    """The settings: ``given`` (the command line's) over ``STEERSERVE_*`` variables over the
    defaults, each parsed and bounded by the model; a bad one is an OptionError naming its flag."""
    try:
        return ServeSettings(**(given or {}))
    except ValidationError as e:
        err = e.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else ""
        where = "" if name in (given or {}) else f" (from {env_var(name)})"
        param = flag(name) if name in FIELDS else None
        given_as = "" if name in SECRETS else f", not {err['input']!r}"  # a key is never echoed
        raise OptionError(f"{err['msg']}{given_as}{where}", param) from None


def check_engine_config(cfg: Any) -> None:  # cfg: EngineConfig (lazy)
    """vLLM's config built from ``cfg`` as the engine will build it, so that what vLLM refuses
    (a ``--quantization`` this platform, checkpoint or dtype cannot run) stops the start with
    vLLM's reason instead of failing the engine's load."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from steerserve.engine.api import ModelShape, engine_kwargs

    try:
        AsyncEngineArgs(**engine_kwargs(cfg, ModelShape.read(cfg.model))).create_engine_config()
    except ValidationError as e:  # vLLM's config classes are pydantic models
        why = str(e.errors()[0]["msg"]).removeprefix("Value error, ")
        raise OptionError(f"vLLM refuses the engine's configuration: {why}", None) from None
    except ValueError as e:
        raise OptionError(f"vLLM refuses the engine's configuration: {e}", None) from None


def settings(s: ServeSettings, engine_args: Sequence[str] = ()) -> ServerSettings:
    """The settings of a server started from ``s`` and vLLM engine flags ``engine_args``, after
    checking them, configuring logging and binding vLLM's CPU threads to every core (the
    environment is changed: this prepares the process it runs in). The server exits on an
    engine failure."""
    from steerserve.artifacts import default_vectors_dir

    if s.vectors_dir is not None and not Path(s.vectors_dir).is_dir():  # else no preset serves
        raise OptionError(f"{s.vectors_dir}: no such folder", "--vectors-dir")
    experiment = check_experiment(s)
    check_seqs_per_request(s.max_seqs_per_request, s.max_num_seqs)
    logging.basicConfig(
        level=s.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    passed = vllm_engine_args(engine_args)  # before the model: a typo costs nothing
    check_presets(tuple(s.preset), s.ab_preset, tuple(s.ab_arm))
    register_experiment(s, experiment)
    if s.tool_call_parser not in ("auto", "none"):
        from steerserve.server.generate.hosted import tool_parser_for

        try:
            tool_parser_for(None, s.tool_call_parser)
        except ValueError as e:
            raise OptionError(str(e).split(": ", 1)[-1], "--tool-call-parser") from None
    engine = _engine_config(s, _model_dir(s.model))
    engine.extra.update(passed)
    if "quantization" in passed:  # vLLM's to accept or refuse, before the engine starts
        check_engine_config(engine)
    # the 4-bit checkpoint's folder is named w4: serve it under its model's name
    names = list(s.served_model_name) or [n for n in [_w4_name(Path(engine.model))] if n]
    return ServerSettings(
        **s.model_dump()
        | {
            "engine": engine,
            "vectors_dir": s.vectors_dir or default_vectors_dir(),
            "served_model_name": names,
            "exit_on_failure": True,
        }
    )


def _engine_config(s: ServeSettings, model_dir: Path):  # noqa: ANN202 (EngineConfig: lazy)
    """The engine's config: dtype ``auto`` is float32 on a CPU without native bfloat16, eager on
    CPU and compiled on GPU unless told, the KV cache as the engine sizes it unless given, and
    every core bound for the CPU ranks."""
    import torch

    from steerserve.engine.api import EngineConfig
    from steerserve.engine.cpu import W4_DTYPES, bind_all_cores, serve_dtype, w4_kernel

    on_gpu = torch.cuda.is_available()
    enforce_eager = (not on_gpu) if s.enforce_eager is None else s.enforce_eager
    if (chosen := serve_dtype(s.dtype, on_gpu)) != s.dtype:
        logger.info("dtype auto: %s (no native bfloat16 on this CPU)", chosen)
    w4 = _w4_dir(s, model_dir, on_gpu)
    if w4 is not None:
        model_dir = w4
        if chosen not in W4_DTYPES:  # only auto gets here: an explicit float32 was refused
            chosen = "bfloat16"
        kernel = "vLLM's GPU choice" if on_gpu else w4_kernel(chosen)
        logger.info("serving 4-bit weights: %s, computed in %s, kernel %s", w4, chosen, kernel)
    ranks = s.tensor_parallel_size * s.pipeline_parallel_size
    if bound := bind_all_cores(os.environ, on_gpu, ranks):
        logger.info("VLLM_CPU_OMP_THREADS_BIND=%s (every core)", bound)
    return EngineConfig(
        model=str(model_dir),
        dtype=chosen,
        max_model_len=s.max_model_len,
        max_num_seqs=s.max_num_seqs,
        kv_cache_memory_bytes=s.kv_cache_memory_bytes,  # None: engine_kwargs' rule
        gpu_memory_utilization=s.gpu_memory_utilization,
        tensor_parallel_size=s.tensor_parallel_size,
        pipeline_parallel_size=s.pipeline_parallel_size,
        distributed_executor_backend=s.distributed_executor_backend,
        enforce_eager=enforce_eager,
        ops_per_layer=s.ops_per_layer,
    )


def _w4_name(model: Path) -> str | None:
    """A 4-bit checkpoint (``<model>/w4``) is served under its model's name."""
    from steerserve.models import w4_dir

    return model.parent.name if w4_dir(model.parent) == model else None


def _w4_dir(s: ServeSettings, model_dir: Path, on_gpu: bool) -> Path | None:
    """The 4-bit checkpoint to serve, or None for ``model_dir`` itself. ``w4`` that cannot be
    honoured is an OptionError naming why; ``auto`` falls back to full precision, saying why."""
    from steerserve.engine.cpu import W4_DTYPES, serve_w4, w4_missing
    from steerserve.models import w4_dir

    choice = s.embedded_quantization
    if not serve_w4(choice, on_gpu):
        return None
    # The dtype first: w4_dir writes the sibling on first use (minutes), not to be refused after.
    why, w4 = None, None
    if missing := w4_missing(on_gpu):
        why = missing
    elif s.dtype not in ("auto", *W4_DTYPES):
        why = f"4-bit weights compute in {' or '.join(W4_DTYPES)}, not --dtype {s.dtype}"
    elif (w4 := w4_dir(model_dir)) is None:
        why = f"{model_dir} has no 4-bit checkpoint (written for the embedded chat model)"
    if why and choice == "w4":
        raise OptionError(why, "--embedded-quantization")
    if why:
        logger.info("embedded quantization auto: full precision, %s", why)
        return None
    return w4
