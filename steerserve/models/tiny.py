"""Tiny random models built offline in seconds (tests, benchmarks, smoke checks).

A byte-level tokenizer (no merges: every UTF-8 byte is a token, so any language encodes) with BOS
and a chat template, and a random Llama- or Gemma-3-shaped checkpoint in safetensors that both
transformers and vLLM's CPU backend load (head_dim 32).
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def build_tokenizer(path: Path) -> int:
    """Write a byte-level tokenizer to ``path``; return its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(path)
    return len(vocab)


def build_tiny_model(
    path: str | Path,
    arch: str = "llama",
    *,
    num_layers: int = 4,
    hidden: int = 64,
    seed: int = 0,
    max_positions: int = 1024,
) -> Path:
    """Write a random ``arch`` ("llama" or "gemma3") model with its tokenizer to ``path``
    (``max_positions``: its context, the most ``max_model_len`` vLLM then allows)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(path)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    if arch == "llama":
        from transformers import LlamaConfig

        cfg = LlamaConfig(**common)
    elif arch == "gemma3":
        from transformers import Gemma3TextConfig

        cfg = Gemma3TextConfig(**common, sliding_window=64, query_pre_attn_scalar=32)
        cfg.architectures = ["Gemma3ForCausalLM"]
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger random weights: less degenerate greedy continuations
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    return path
