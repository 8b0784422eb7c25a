"""Evaluation records in either form (completion ``prompt`` or chat ``messages``, rendered as
the server renders them, so what is measured is what is served) and their token ids.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from steerserve.models.chat import chat_ids, check_messages, reply_separator
from steerserve.tune.facts import ANSWER_SEP, FORMS, default_shots, eval_records
from steerserve.tune.scorer import fold

Prompt = str | list[dict[str, str]]  # completion text or chat messages


def form_of(rec: Mapping[str, Any]) -> str:
    """``chat`` for a record with messages, else ``completion``."""
    return "chat" if "messages" in rec else "completion"


def answer_sep(record: Mapping[str, Any], tokenizer: Any = None) -> str:
    """What follows the prompt before the answer: the record's ``sep``, else for a chat what
    follows the rendered chat (:func:`steerserve.models.chat.reply_separator`), else the fact set's."""
    if "sep" in record:
        return str(record["sep"])
    if "messages" in record:
        return reply_separator(tokenizer)
    if record["prompt"][-1:].isspace():
        return ""
    return ANSWER_SEP.get(record["lang"], " ")


def check_record(rec: Any, where: str = "") -> dict:
    """``rec`` checked (not trusted) and normalised: ``answers_en`` defaults to ``[]``, chat
    messages become plain ``{role, content}``; ``ValueError`` names the record's id."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: a record must be a JSON object")
    name = f"{where}: record {rec['id']!r}" if "id" in rec else f"{where}: record"
    missing = {"id", "lang", "answers"} - set(rec)
    if "prompt" not in rec and "messages" not in rec:
        missing.add("prompt or messages")
    if missing:
        raise ValueError(f"{name}: missing {sorted(missing)}")
    if "prompt" in rec and "messages" in rec:
        raise ValueError(f"{name}: has both prompt and messages; a record is one or the other")
    if not isinstance(rec["answers"], list) or not rec["answers"]:
        raise ValueError(f"{name}: answers must be a non-empty list")
    out = {**rec, "answers_en": rec.get("answers_en") or []}
    if "messages" in rec:
        empty = [a for a in rec["answers"] if not isinstance(a, str) or not fold(a, rec["lang"])]
        if empty:
            raise ValueError(
                f"{name}: accepted answers {empty!r} are empty once folded (punctuation and "
                "whitespace dropped): they would match every reply"
            )
        try:
            out["messages"] = check_messages(rec["messages"])
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    elif not isinstance(rec["prompt"], str) or not rec["prompt"]:
        raise ValueError(f"{name}: prompt must be a non-empty string")
    return out


def read_dataset(path: str | Path) -> list[dict]:
    """JSONL records of either form (see the module docstring), checked line by line."""
    out = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            out.append(check_record(json.loads(line), f"{path}:{i}"))
    if not out:
        raise ValueError(f"{path}: no records")
    return out


def dataset_form(records: Sequence[Mapping[str, Any]]) -> str:
    """The one form of ``records``; a mix is refused (a report compares like with like)."""
    forms = {form_of(r) for r in records}
    if len(forms) > 1:
        raise ValueError("records mix completion (prompt) and chat (messages) forms")
    return forms.pop() if forms else "completion"


def encode(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids the model reads: chat messages through the server's template rendering,
    completion text with the tokenizer's special tokens (BOS), as vLLM tokenizes it."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    return chat_ids(tokenizer, prompt)


def record_prompt(rec: Mapping[str, Any]) -> Prompt:
    return rec["messages"] if "messages" in rec else rec["prompt"]


def engine_prompts(tokenizer: Any, records: Sequence[Mapping[str, Any]]) -> list[str | list[int]]:
    """What the engine is given: completion text unchanged (vLLM tokenizes it), chat records as
    the token ids the server would send for the same messages."""
    return [r["prompt"] if "prompt" in r else chat_ids(tokenizer, r["messages"]) for r in records]


#: Name endings of instruction-tuned checkpoints (Qwen2.5-...-Instruct, Llama-3.2-3B-Instruct,
#: gemma-3-1b-it, ...-chat): their default form is chat.
_CHAT_SUFFIXES: tuple[str, ...] = ("-instruct", "-it", "-chat")


def default_form(model_dir: str | Path, form: str = "auto") -> str:
    """``form`` if given, else ``chat`` for an instruction-tuned model (by its folder name),
    else ``completion``."""
    if form != "auto":
        if form not in FORMS:
            raise ValueError(f"unknown form {form!r}; known: auto, {', '.join(FORMS)}")
        return form
    name = Path(model_dir).name.lower()
    return "chat" if name.endswith(_CHAT_SUFFIXES) else "completion"


def load_records(
    dataset: str | Path | None,
    model_dir: str | Path,
    form: str = "auto",
    fallback: str = "auto",
    build: Callable[..., list[dict]] | None = None,
    **select: Any,
) -> tuple[list[dict], str]:
    """The records a run reads and their one form: a ``dataset`` file's, else the built-in facts in
    ``form`` (auto: ``fallback``, then the model's name); one function, as three copies drifted."""
    if dataset is not None:
        records = read_dataset(dataset)
        return records, dataset_form(records)
    form = default_form(model_dir, fallback if form == "auto" else form)
    return (build or eval_records)(form=form, **select), form


def describe_source(
    dataset: str | Path | None,
    split: str,
    form: str,
    shots: int | None,
    part: tuple[int, int] = (0, 1),
) -> str:
    """The report's ``dataset`` line: the file, or which built-in split, part, form and shots."""
    if dataset is not None:
        return str(dataset)
    sub = "" if part == (0, 1) else f", part {part[0]}/{part[1]}"
    return f"built-in {split} split{sub}, {form} form, {default_shots(form, shots)}-shot"
