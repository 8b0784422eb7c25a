"""lm-evaluation-harness against a test server: a small local multiple-choice task run through
``local-completions`` (echo + logprobs requests, as its loglikelihood tasks send them), offline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


def multiple_choice(
    folder: Path,
    task: str,
    docs: list[dict[str, Any]],
    url: str,
    model: str,
    tokenizer: Path,
    key: str,
    monkeypatch: pytest.MonkeyPatch,
) -> float:
    """Accuracy of ``model`` on ``docs`` (``q``, ``choices``, ``gold``) written as the task
    ``task`` in ``folder``; ``key``: the server's API key (local-completions sends it)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("OPENAI_API_KEY", key)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = folder / f"{task}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / f"{task}.yaml").write_text(
        f"task: {task}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{q}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: gold\n"
        "metric_list:\n  - metric: acc\n"
    )
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(
            f"model={model},base_url={url}/v1/completions,tokenizer={tokenizer},"
            "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,batch_size=1"
        ),
        tasks=[task],
        task_manager=TaskManager(include_path=str(folder)),
    )
    return out["results"][task]["acc,none"]
