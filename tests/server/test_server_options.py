"""``steerserve serve``'s settings (server/settings.py) as the server's (server/options.py), and
the command line derived from them, without starting an engine."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from steerserve.cli import app
from steerserve.server import options as so
from steerserve.server import settings as ss

ROOT = Path(__file__).resolve().parents[2]


def test_settings_from_options(tiny_llama: Path, tmp_path: Path, monkeypatch) -> None:
    """The CPU rules (eager without a GPU) and the settings pass through; the KV cache is the
    engine's to size unless given (engine_kwargs: 1 GiB on CPU, vLLM's own on GPU)."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "")  # restored after, whatever settings binds
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    given = ss.ServeSettings(
        model=str(tiny_llama), vectors_dir=str(tmp_path), dtype="float32", steering="auto",
        ab_split=0.5, ab_name="x", kv_cache_memory_bytes=64 << 20,
        served_model_name=["tiny", "alias"], api_key=["k1", "k2"],
    )  # fmt: skip
    s = so.settings(given)
    assert s.engine.model == str(tiny_llama) and s.engine.dtype == "float32"
    assert s.engine.enforce_eager and s.engine.kv_cache_memory_bytes == 64 << 20
    assert s.vectors_dir == str(tmp_path) and s.exit_on_failure
    assert s.api_keys == ("k1", "k2") and s.served_model_names == ("tiny", "alias")
    assert (s.steering, s.ab_split, s.ab_name) == ("auto", 0.5, "x")
    unset = so.settings(ss.ServeSettings(model=str(tiny_llama)))
    assert unset.engine.kv_cache_memory_bytes is None and unset.api_keys == ()
    assert unset.engine.gpu_memory_utilization == ss.FIELDS["gpu_memory_utilization"].default


def test_engine_sizes_the_kv_cache(monkeypatch) -> None:
    """Unset, the KV cache is 1 GiB on a CPU and left to --gpu-memory-utilization on a GPU."""
    from steerserve.engine import defaults
    from steerserve.engine.api import EngineConfig, ModelShape, engine_kwargs

    shape = ModelShape("LlamaForCausalLM", 4, 64)
    for gpu, kv in ((False, defaults.CPU_KV_CACHE_MEMORY_BYTES), (True, None)):
        monkeypatch.setattr("torch.cuda.is_available", lambda gpu=gpu: gpu)
        kw = engine_kwargs(EngineConfig(model="m", gpu_memory_utilization=0.8), shape)
        assert kw.get("kv_cache_memory_bytes") == kv and kw["gpu_memory_utilization"] == 0.8
        given = EngineConfig(model="m", kv_cache_memory_bytes=5 << 20)
        assert engine_kwargs(given, shape)["kv_cache_memory_bytes"] == 5 << 20


def test_variables_and_options(monkeypatch) -> None:
    """STEERSERVE_* under the command line; lists comma-separated or JSON; an empty variable is
    unset; a bad value names its flag (and its variable)."""
    monkeypatch.setenv("STEERSERVE_API_KEY", "a, b")
    monkeypatch.setenv("STEERSERVE_SERVED_MODEL_NAME", '["x", "y"]')
    monkeypatch.setenv("STEERSERVE_PRESET", 'fr={"vector": "fr", "scale": 2}')
    monkeypatch.setenv("STEERSERVE_PORT", "9000")
    monkeypatch.setenv("STEERSERVE_KV_CACHE_MEMORY_BYTES", "")
    for name in ("ADMIN_KEY", "ALLOWED_ORIGINS", "ALLOWED_METHODS", "FORWARDED_ALLOW_IPS"):
        monkeypatch.setenv(f"STEERSERVE_{name}", "p, q")  # every list, not only some (was refused)
    s = so.read()
    assert s.api_key == ["a", "b"] and s.served_model_name == ["x", "y"] and s.port == 9000
    assert (
        s.admin_key == s.allowed_origins == s.allowed_methods == s.forwarded_allow_ips == ["p", "q"]
    )
    assert s.preset == ['fr={"vector": "fr", "scale": 2}'] and s.kv_cache_memory_bytes is None
    assert so.read({"port": 1}).port == 1
    monkeypatch.setenv("STEERSERVE_MAX_NUM_SEQS", "0")
    with pytest.raises(so.OptionError) as e:
        so.read()
    assert e.value.param == "--max-num-seqs" and "STEERSERVE_MAX_NUM_SEQS" in str(e.value)
    monkeypatch.setenv("STEERSERVE_API_KEY", '["sekrit"')  # not JSON: refused, never echoed
    with pytest.raises(so.OptionError) as e:
        so.read({"max_num_seqs": 1})
    assert e.value.param == "--api-key" and "sekrit" not in str(e.value)


def test_every_setting_is_an_option() -> None:
    """One option per setting, spelled from its field, and the engine flags with vLLM's names."""
    import typer

    serve = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    opts = {o for p in serve.params for o in p.opts + p.secondary_opts}
    for name in ss.FIELDS:
        assert all(f in opts for f in ss.flags(name).split("/")), name
    for name in ss.ENGINE_SETTINGS:
        assert ss.flag(name) == "--" + name.replace("_", "-")


def test_configuration_page_is_generated() -> None:
    """docs/configuration.md is what the model renders: regenerate it with
    ``python -m steerserve.server.settings > docs/configuration.md``."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == ss.reference()
    assert all(f"`{v}`" in page for v in ss.env_vars())


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--steering", "maybe"], "--steering"),
        (["--ab-split", "1.5"], "--ab-split"),
        (["--ab-log", "/dev/null/x"], "--ab-log"),
        (["--model", "/nonexistent/model"], "--model"),
        (["/nonexistent/model"], "--model"),
        (["--embedded-quantization", "int4"], "--embedded-quantization"),
        (["--ops-per-layer", "9"], "--ops-per-layer"),
        (["--worker-extension-cls", "x.Y"], "--worker-extension-cls"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
        (["--vectors-dir", "/nonexistent"], "--vectors-dir"),
        (["--uvicorn-log-level", "debug"], "use --log-level"),
        (["--lora-modules", "a=b"], "use --preset"),
        (["--ssl-ciphers", "X"], "server option steerserve serve does not take"),
        (["--frobnicate"], "not an option of steerserve serve or of vLLM's engine"),
    ],
)
def test_bad_options_are_usage_errors(args: list[str], names: str) -> None:
    """Refused before any engine starts, exit 2, naming the option."""
    out = CliRunner().invoke(app, ["serve", *args], env={"COLUMNS": "200"})
    assert out.exit_code == 2 and names in out.output, out.output


def test_model_is_positional_and_vllm_flags_pass(monkeypatch) -> None:
    """``steerserve serve MODEL`` as ``vllm serve MODEL``; a vLLM flag first is not the model."""
    seen: list[Any] = []

    def fake(s: ss.ServeSettings, engine_args: list[str]) -> None:
        seen.append((s.model, list(engine_args), s.served_model_name, s.api_key))
        raise SystemExit(0)

    monkeypatch.setattr(so, "settings", fake)
    run = CliRunner().invoke
    run(app, ["serve", "m1", "--max-num-batched-tokens", "512", "--served-model-name", "a",
              "--served-model-name", "b", "--api-key", "k"])  # fmt: skip
    run(app, ["serve", "--enable-chunked-prefill", "--model", "m2", "--quantization", "fp8"])
    assert seen == [
        ("m1", ["--max-num-batched-tokens", "512"], ["a", "b"], ["k"]),
        ("m2", ["--enable-chunked-prefill", "--quantization", "fp8"], [], []),
    ]


def test_vllm_quantization_is_vllms(tiny_llama: Path, monkeypatch) -> None:
    """``--quantization`` is vLLM's: parsed as an engine flag, and refused with vLLM's own reason
    before the engine starts where vLLM cannot run it (fp8 in float32)."""
    monkeypatch.setattr("os.environ", dict(os.environ))  # settings() binds the CPU threads
    assert so.vllm_engine_args(["--quantization", "fp8"]) == {"quantization": "fp8"}
    given = ss.ServeSettings(model=str(tiny_llama), dtype="float32", max_model_len=512)
    with pytest.raises(so.OptionError) as e:
        so.settings(given, ["--quantization", "fp8"])
    assert "float32 is not supported for quantization method fp8" in str(e.value)
