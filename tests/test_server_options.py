"""``steerserve serve``'s options as settings (server/options.py), without starting an engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from steerserve.cli import app
from steerserve.server import options as so


def test_settings_from_options(tiny_llama: Path, tmp_path: Path, monkeypatch) -> None:
    """The CPU rules (eager without a GPU, a KV cache in bytes) and the options pass through."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "")  # restored after, whatever settings binds
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    opts = so.ServeOptions(
        model=str(tiny_llama), vectors_dir=str(tmp_path), dtype="float32", api_key="",
        steering="auto", ab_split=0.5, ab_name="x", kv_cache_bytes=64 << 20,
    )  # fmt: skip
    s = so.settings(opts)
    assert s.engine.model == str(tiny_llama) and s.engine.dtype == "float32"
    assert s.engine.enforce_eager and s.engine.kv_cache_memory_bytes == 64 << 20
    assert s.engine.gpu_memory_utilization is None
    assert s.vectors_dir == str(tmp_path) and s.api_key is None and s.exit_on_failure
    assert (s.steering, s.ab_split, s.ab_name) == ("auto", 0.5, "x")
    gpu = so.settings(so.ServeOptions(model=str(tiny_llama), kv_cache_bytes=0))
    assert gpu.engine.kv_cache_memory_bytes is None and gpu.engine.gpu_memory_utilization == 0.9


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--steering", "maybe"], "--steering must be off, on or auto"),
        (["--ab-split", "1.5"], "--ab-split"),
        (["--ab-log", "/dev/null/x"], "--ab-log"),
        (["--model", "/nonexistent/model"], "--model"),
    ],
)
def test_bad_options_are_usage_errors(args: list[str], names: str) -> None:
    """Refused before any engine starts, exit 2, naming the option."""
    out = CliRunner().invoke(app, ["serve", *args])
    assert out.exit_code == 2 and names in out.output, out.output
