"""``steerserve serve``'s settings, each declared once: type, default, bounds, variable and help.

The command line (``cli.py``), the server's checks (``options.py``), the deploy contract test and
``docs/configuration.md`` all derive from :class:`ServeSettings`. Regenerate the page with
``python -m steerserve.server.settings > docs/configuration.md`` (a test compares them).
"""

from __future__ import annotations

import inspect
import json
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BeforeValidator, Field
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from steerserve.engine import defaults as engine
from steerserve.engine.spec import DEFAULT_OPS_PER_LAYER, DEFAULT_ROWS_PER_REQUEST
from steerserve.server.steering import DEFAULT_MODE

ENV_PREFIX = "STEERSERVE_"

#: Settings that are also ``vllm serve`` engine flags under the same name, with vLLM's meaning.
ENGINE_SETTINGS = (
    "model",
    "dtype",
    "max_model_len",
    "max_num_seqs",
    "kv_cache_memory_bytes",
    "gpu_memory_utilization",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "distributed_executor_backend",
    "enforce_eager",
    "served_model_name",
)


def _listed(one: bool) -> BeforeValidator:
    """A variable's text as a list: a JSON list, else comma-separated (``one``: a single value,
    as a steering spec has commas of its own)."""

    def read(value: Any) -> Any:
        if not isinstance(value, str):
            return value
        if value.lstrip().startswith("["):
            return json.loads(value)
        return [value] if one else [v.strip() for v in value.split(",") if v.strip()]

    return BeforeValidator(read)


Names = Annotated[list[str], NoDecode, _listed(one=False)]  # names, keys, origins
Specs = Annotated[list[str], NoDecode, _listed(one=True)]  # NAME=SPEC each


def _flag(flags: str) -> dict[str, Any]:
    """A flag spelled otherwise than ``--field-name`` (``--on/--off`` pairs)."""
    return {"flag": flags}


class ServeSettings(BaseSettings):
    """Everything ``steerserve serve`` is configured by (its own options; vLLM's other engine
    flags pass through to the engine as given)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_ignore_empty=True, extra="forbid", frozen=True
    )

    model: str = Field(
        "default",
        description="A local Hugging Face checkpoint folder, or an embedded model: "
        "'qwen2.5-coder-1.5b-instruct' (chat; also 'default') or 'gemma-3-270m' (base). "
        "Also the command's first argument, as in 'vllm serve MODEL'.",
    )
    served_model_name: Names = Field(
        [],
        description="The names clients pass as 'model' (repeatable): the first is the one "
        "reported, the others are accepted as aliases. Default: the model folder's name.",
    )
    vectors_dir: str | None = Field(
        None,
        description="Folder of steering artifacts; those made for this model are loaded at "
        "start. Default: vectors/ of the installed package or source tree.",
    )
    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8000, ge=0, le=65535, description="Port to bind.")
    api_key: Names = Field(
        [],
        description="Require 'Authorization: Bearer KEY' on /v1/* (repeatable: any of the keys "
        "is accepted). Default: no authentication.",
    )
    admin_key: Names = Field(
        [],
        description="Keys for the admin endpoints (POST /v1/steering/vectors, the experiment's "
        "pages and data; repeatable): once set, an --api-key no longer opens them, and an admin "
        "key is accepted wherever an --api-key is. Default: any --api-key opens them.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Logging level."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Weights and activations dtype. auto: float32 on a CPU without native "
        "bfloat16 (avx512_bf16 or amx_bf16), else vLLM's choice.",
    )
    max_model_len: int = Field(
        engine.MAX_MODEL_LEN, ge=1, description="Longest prompt + completion, in tokens."
    )
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=1,
        description=f"KV cache size in bytes. Default: {engine.CPU_KV_CACHE_MEMORY_BYTES} on CPU; "
        "on GPU unset, so that --gpu-memory-utilization sizes it, as in vLLM.",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Share of each GPU's memory vLLM may take; sizes the KV cache unless "
        "--kv-cache-memory-bytes is given.",
    )
    max_num_seqs: int = Field(
        engine.MAX_NUM_SEQS, ge=1, description="Most sequences batched at once."
    )
    embedded_quantization: Literal["auto", "none", "w4"] = Field(
        "auto",
        description="Which checkpoint of an embedded model to serve: w4, its 4-bit weight-only "
        "one (computed in bfloat16, about 1.5 GB less memory), or none, its full-precision one. "
        "auto: w4 only on a CPU kind where it serves faster (none so far). vLLM's own "
        "--quantization passes through to the engine.",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per model replica (TP).")
    pipeline_parallel_size: int = Field(1, ge=1, description="Pipeline stages (PP).")
    distributed_executor_backend: Literal["mp", "ray"] | None = Field(
        None, description="vLLM's executor: mp (vLLM's default) or ray (multi-node)."
    )
    enforce_eager: bool | None = Field(
        None,
        description="Eager PyTorch, or torch.compile and graphs. Default: eager on CPU, "
        "compiled on GPU.",
        json_schema_extra=_flag("--enforce-eager/--compile"),
    )
    ops_per_layer: int = Field(
        DEFAULT_OPS_PER_LAYER,
        ge=0,
        le=DEFAULT_ROWS_PER_REQUEST,
        description="Non-additive steering entries (ablate, replace, interp) one request may "
        "stack on one layer. 0 serves additive steering only and keeps their kernel out of "
        "compiled graphs (GPU), where it otherwise runs on every steerable layer at every step.",
    )
    max_seqs_per_request: int | None = Field(
        None,
        ge=1,
        description="Most sequences one request may run (prompts x n, the A/B endpoint's two "
        "arms counted twice), at most --max-num-seqs; more is refused (400). Default: half of "
        "--max-num-seqs, so that one request never holds every seat.",
    )
    max_prompt_tokens_per_request: int | None = Field(
        None,
        ge=1,
        description="Most prompt tokens one request may send (all its prompts, A/B arms "
        "twice); more is refused (400): a request's prefill delays every request behind it. "
        "Default: 8 x --max-model-len.",
    )
    max_scored_tokens_per_request: int | None = Field(
        None,
        ge=1,
        description="Most prompt tokens one request may score (echo with logprobs, "
        "prompt_logprobs); more is refused (400): each costs a vocabulary of logits. "
        "Default: 2^28 / the vocabulary size.",
    )
    steering: Literal["off", "on", "auto"] = Field(
        DEFAULT_MODE,
        description="Steering for requests that do not choose: off, on, or auto (on for "
        "non-English prompts).",
    )
    preset: Specs = Field(
        [],
        description="NAME=SPEC (repeatable): serve the steering SPEC (any 'steering' value, as "
        "JSON, or on/off/auto) as the model id <model>:NAME, chosen by 'model' alone. The "
        "served artifact gives <model>:steering-on and <model>:steering-auto. As a variable: "
        "one NAME=SPEC, or a JSON list of them.",
    )
    tool_call_parser: str = Field(
        "auto",
        description="vLLM's tool-call parser (hermes, llama3_json, mistral, ...). auto: hermes "
        "for a chat template that writes <tool_call> tags (the default model's); none: no tools.",
    )
    enable_auto_tool_choice: bool | None = Field(
        None,
        description="Let the model decide to call tools (tool_choice auto). Default: on "
        "whenever a tool-call parser is in use.",
        json_schema_extra=_flag("--enable-auto-tool-choice/--no-auto-tool-choice"),
    )
    chat_template: str | None = Field(
        None, description="A chat template (a file or inline Jinja) instead of the model's own."
    )
    drain_seconds: int = Field(
        300,
        ge=0,
        description="On SIGTERM/SIGINT (to the server or its process group): how long requests "
        "in flight may finish; a second signal stops at once.",
    )
    # Above a proxy's idle timeout and a busy client's lag (uvicorn's 5 s: 298 client ReadErrors
    # in 3 min of bench/load.py at load 10; 75 s: none).
    keep_alive_seconds: int = Field(
        75,
        ge=1,
        description="How long an idle HTTP connection is kept open. Keep it above the idle "
        "timeout of any proxy or load balancer in front (often 60 s), so that the server never "
        "closes a connection the proxy is reusing.",
    )
    stream_send_timeout_seconds: float = Field(
        60.0,
        gt=0,
        description="How long one write of a streamed answer may wait for a client that does "
        "not read; past it the stream is cancelled and counted "
        "(steerserve_stream_stalls_total). Engine seats never wait for the client: they are "
        "given back when the engine's part ends.",
    )
    forwarded_allow_ips: Names = Field(
        [],
        description="Proxies (addresses, or *) trusted to name the client in X-Forwarded-For "
        "(repeatable), as uvicorn's option: the client address then counts in the per-client "
        "share of engine seats and in the logs. Default: none; the header is ignored.",
    )
    ssl_keyfile: str | None = Field(None, description="TLS: the private key file (uvicorn's).")
    ssl_certfile: str | None = Field(
        None, description="TLS: the certificate file; with --ssl-keyfile the server speaks HTTPS."
    )
    ssl_ca_certs: str | None = Field(
        None, description="TLS: CA certificates to verify client certificates with."
    )
    ssl_cert_reqs: int = Field(
        0,
        ge=0,
        le=2,
        description="TLS: whether a client certificate is required (Python's ssl.CERT_NONE 0, "
        "CERT_OPTIONAL 1, CERT_REQUIRED 2).",
    )
    root_path: str = Field(
        "",
        description="The path prefix a proxy serves the app under (ASGI root_path), as vLLM's.",
    )
    allowed_origins: Names = Field(
        [],
        description="CORS: origins whose browser pages may call the API (repeatable, or *). "
        "Default: none (vLLM allows every origin; here a page on another origin reads nothing).",
    )
    allowed_methods: Names = Field(
        ["*"], description="CORS: the methods allowed to --allowed-origins."
    )
    allowed_headers: Names = Field(
        ["*"], description="CORS: the request headers allowed to --allowed-origins."
    )
    allow_credentials: bool = Field(
        False, description="CORS: let --allowed-origins send cookies and HTTP authentication."
    )
    open_admin: bool = Field(
        False,
        description="Allow POST /v1/steering/vectors without --api-key on a non-loopback --host "
        "(refused by default: anyone reaching the port could change every client's steering), "
        "and on loopback under any Host name (by default loopback names only: DNS rebinding).",
    )
    ab_split: float = Field(
        0.0,
        ge=0,
        le=1,
        description="A/B experiment of two arms: the share of users (the 'user' field, else "
        "the x-steerserve-subject header) steered, the same users every time; requests with "
        "'steering' keep theirs. 0: no experiment. Shorthand for --ab-arm unsteered=off "
        "--ab-arm steered=auto --ab-allocation steered=F.",
    )
    ab_arm: Specs = Field(
        [],
        description="An arm of the A/B experiment, NAME=SPEC (repeatable, two or more): SPEC "
        "is off, on, auto, a 'steering' value as JSON, or preset:NAME. The first arm is the "
        "control unless --ab-control says.",
    )
    ab_allocation: Names = Field(
        [],
        description="The share of users per arm, NAME=SHARE (repeatable or comma-separated; "
        "summing to 1). A different allocation under the same --ab-name starts a new phase "
        "(a ramp: a user moves only from the control into a treatment that grows). Default: "
        "equal shares.",
    )
    ab_control: str | None = Field(
        None, description="The arm every other arm is compared with. Default: the first arm."
    )
    ab_note: str | None = Field(
        None, description="The experiment's owner note (who runs it and why), shown on the page."
    )
    ab_name: str = Field(
        "default",
        description="A/B experiment name: part of the assignment hash (a new name reshuffles "
        "users); its arms, allocation and phases are recorded under it in --ab-store or "
        "--ab-log.",
    )
    ab_preset: str | None = Field(
        None,
        description="The preset the A/B experiment's steered arm serves. Default: auto, or on "
        "with --steering on.",
    )
    ab_log: str | None = Field(
        None,
        description="A/B decision log (JSONL, appended): one line per answered enrolled "
        "request, and the scores POST /v1/steering/feedback joins to them. Read it with "
        "'steerserve ab-report'.",
    )
    ab_log_content: bool = Field(
        False,
        description="Also log prompts and replies, in the log and the store (off by default: "
        "they may be personal data).",
    )
    ab_store: str | None = Field(
        None,
        description="A/B experiment store every replica shares: sqlite:///PATH (one host) or "
        "postgresql://USER@HOST:PORT/DB (many hosts; the password from the URL or libpq's "
        "PGPASSWORD/~/.pgpass, never logged). Created and migrated at start; 'steerserve "
        "ab-report URL' reads it; --ab-log then is an export.",
    )
    ab_store_spill: str | None = Field(
        None,
        description="Folder where records still queued for an unreachable store are kept at "
        "shutdown and written at the next start. Default: PATH-spill beside a SQLite store, "
        "else ~/.local/state/steerserve/ab-spill.",
    )


FIELDS: dict[str, FieldInfo] = ServeSettings.model_fields


def env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


def flags(name: str) -> str:
    """The option's spelling on the command line (``--a/--b`` for a switch pair)."""
    extra = FIELDS[name].json_schema_extra
    if isinstance(extra, dict) and "flag" in extra:
        return str(extra["flag"])
    return "--" + name.replace("_", "-")


def flag(name: str) -> str:
    """The option's first flag, as an error names it."""
    return flags(name).split("/")[0]


def env_vars() -> list[str]:
    return [env_var(n) for n in FIELDS]


def _choices(annotation: Any) -> tuple[str, ...]:
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) is Literal:
        return tuple(get_args(annotation))
    return next((c for a in args if (c := _choices(a))), ())


def _default_text(name: str) -> str:
    default = FIELDS[name].default
    if default is None or default == [] or default == "":
        return ""
    if isinstance(default, list):
        return ",".join(default)
    if isinstance(default, bool):
        return "on" if default else "off"
    return str(default)


def typer_parameters() -> list[inspect.Parameter]:
    """``serve``'s typer options, one per field (for ``serve.__signature__``). Their default and
    variable are only shown in the help: the command passes on what the command line gives, and
    the model reads the rest from the environment, so each is parsed and bounded once, here."""
    import typer

    params = []
    for name, field in FIELDS.items():
        annotation: Any = field.annotation
        choices = _choices(annotation)
        if choices:
            annotation = str | None
        elif get_origin(annotation) is not list and type(None) not in get_args(annotation):
            annotation = annotation | None  # unset unless the command line gives it
        shown = _default_text(name)
        note = f"[env var: {env_var(name)}]" + (f" [default: {shown}]" if shown else "")
        is_list = get_origin(field.annotation) is list
        option = typer.Option(
            [] if is_list else None,
            flags(name),
            help=f"{field.description} {note}",
            metavar=f"[{'|'.join(choices)}]" if choices else "<str>" if is_list else None,
            show_default=False,
        )
        params.append(
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option,
                              annotation=annotation)
        )  # fmt: skip
    return params


def reference() -> str:
    """docs/configuration.md: every setting with its flag, variable, default and help."""
    lines = [
        "# Configuration",
        "",
        "<!-- Generated from steerserve/server/settings.py: "
        "python -m steerserve.server.settings > docs/configuration.md -->",
        "",
        "`steerserve serve [MODEL]` takes each setting as a command-line option or a "
        f"`{ENV_PREFIX}*` environment variable (the option wins). A repeatable option's "
        "variable takes comma-separated values or a JSON list. An empty variable counts as "
        "unset.",
        "",
        "| option | variable | default | what it does |",
        "|---|---|---|---|",
    ]
    for name, field in FIELDS.items():
        choices = _choices(field.annotation)
        kind = " (" + ", ".join(f"`{c}`" for c in choices) + ")" if choices else ""
        default = _default_text(name)
        text = str(field.description).replace("<", "&lt;")  # <model>:NAME is text, not a tag
        lines.append(
            f"| `{flags(name)}`{kind} | `{env_var(name)}` | "
            f"{f'`{default}`' if default else '—'} | {text} |"
        )
    lines += [
        "",
        "Any other `vllm serve` engine flag (`--quantization`, `--max-num-batched-tokens`, "
        "`--enable-chunked-prefill`, `--seed`, `--tokenizer`, ...) is passed to vLLM's engine as "
        "given: see `steerserve vllm serve --help` (stock vLLM's command line; the CPU install's "
        "`vllm` command cannot start). Flags steerserve sets itself for steering "
        "(`--hf-overrides`, `--additional-config`, `--worker-extension-cls`) are refused. "
        "`vllm serve`'s server options are taken under vLLM's names where they apply (TLS, "
        "`--root-path`, CORS above); the others are refused with what to use instead "
        "(`--uvicorn-log-level`: `--log-level`; `--lora-modules`: `--preset`).",
        "",
        "Other variables: `STEERSERVE_CACHE` sets where an embedded model is converted (default "
        "`~/.cache/steerserve`); vLLM's own `VLLM_*` variables pass through.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference(), end="")
