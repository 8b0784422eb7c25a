"""Plugin wiring: entry point, lazy Steered<Arch> classes, config salting, refusals at build."""

from __future__ import annotations

import importlib.metadata

import pytest

from steerserve.engine import archs
from steerserve.engine.api import EngineConfig, ModelShape, engine_kwargs


def test_entry_point_registers_every_architecture():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ep = next(e for e in eps if e.name == "steerserve")
    ep.load()()
    ep.load()()  # idempotent
    from vllm import ModelRegistry

    supported = ModelRegistry.get_supported_archs()
    for arch in archs.SUPPORTED:
        assert archs.steered_name(arch) in supported


@pytest.mark.parametrize("arch", list(archs.SUPPORTED))
def test_steered_classes_subclass_the_stock_model(arch):
    if arch == "Gemma3ForConditionalGeneration":  # vLLM's Gemma 3 vision tower imports torchvision
        pytest.importorskip("torchvision", reason="torchvision breaks imports on the CPU build")
    cls = getattr(archs, archs.steered_name(arch))
    module, name = archs.SUPPORTED[arch].split(":")
    base = getattr(importlib.import_module(module), name)
    assert issubclass(cls, base) and issubclass(cls, archs.SteeringMixin)
    assert cls.__name__ == archs.steered_name(arch)


def _config_hash(model, steering: bool, **kw) -> str:
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineConfig(model=str(model), steering=steering, max_model_len=512, **kw)
    return (
        EngineArgs(**engine_kwargs(cfg, ModelShape.read(str(model))))
        .create_engine_config()
        .compute_hash()
    )


def test_compile_cache_key_differs_without_the_plugin(tiny_llama):
    with_plugin = _config_hash(tiny_llama, True)
    assert with_plugin != _config_hash(tiny_llama, False)
    assert with_plugin != _config_hash(tiny_llama, True, rows_per_request=8)
    assert with_plugin == _config_hash(tiny_llama, True)


def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"architectures": ["BertModel"], "num_hidden_layers": 2, "hidden_size": 8}'
    )
    with pytest.raises(ValueError, match="'BertModel' cannot be steered"):
        engine_kwargs(EngineConfig(model=str(tmp_path)), ModelShape.read(str(tmp_path)))
    assert "hf_overrides" not in engine_kwargs(
        EngineConfig(model=str(tmp_path), steering=False), ModelShape.read(str(tmp_path))
    )


def test_parallel_settings_pass_through(tiny_llama):
    cfg = EngineConfig(
        model=str(tiny_llama),
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        distributed_executor_backend="ray",
    )
    kw = engine_kwargs(cfg, ModelShape.read(str(tiny_llama)))
    assert (kw["tensor_parallel_size"], kw["pipeline_parallel_size"]) == (2, 2)
    assert kw["distributed_executor_backend"] == "ray"


def test_structured_outputs_are_compact_unless_configured(tiny_llama):
    from vllm.engine.arg_utils import EngineArgs

    shape = ModelShape.read(str(tiny_llama))
    cfg = EngineConfig(model=str(tiny_llama), max_model_len=512)
    built = EngineArgs(**engine_kwargs(cfg, shape)).create_engine_config()
    assert built.structured_outputs_config.disable_any_whitespace
    mine = {"structured_outputs_config": {"backend": "guidance"}}
    cfg = EngineConfig(model=str(tiny_llama), max_model_len=512, extra=mine)
    built = EngineArgs(**engine_kwargs(cfg, shape)).create_engine_config()
    assert not built.structured_outputs_config.disable_any_whitespace
    assert built.structured_outputs_config.backend == "guidance"
