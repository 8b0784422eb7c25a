"""py-spy sampling of a server's processes, and its stacks sorted into where the time went.

Shared by latency.py and bench_serve.py (``--profile``): the same rules read both.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: (category, substrings of a collapsed stack; the first rule that matches counts the sample);
#: the lifeline thread's sleep is native, so its leaf is ``_watch`` itself
RULES = [
    ("waiting (spin, poll, sleep)", ("sched_yield", "Condition.wait", "select", "Poller.poll",
                                     "_recv", "Event.wait", ";sleep", "Queue.get",
                                     "_watch (steerserve/engine/lifeline.py")),
    ("steering hook + op", ("(steerserve/engine/buffers.py);hook", "steerserve/engine/kernels.py")),
    ("steering seam: index fill", ("prepare_step (steerserve",)),
    ("steering seam: slots", ("sync (steerserve",)),
    ("model forward", ("_model_forward (",)),
    ("sampling: logprobs", ("compute_logprobs (", "gather_logprobs (")),
    ("front end: logprobs", ("v1/engine/logprobs.py", "_checked (")),
    ("sampling", ("_sample (", "sample_tokens (")),
    ("runner: update states", ("_update_states (",)),
    ("runner: other", ("execute_model (",)),
    ("engine core: scheduler", ("schedule (vllm",)),
    ("tokenize", ("encode (", "tokeniz", "apply_chat_template")),
    ("detokenize", ("detokeniz", "decode (")),
    ("steerserve server", ("steerserve/server",)),
    ("http (uvicorn, starlette, fastapi)", ("uvicorn", "starlette", "fastapi", "h11", "httptools")),
    ("vLLM OpenAI front end", ("vllm/entrypoints",)),
    ("output processor", ("output_processor",)),
    ("engine core client", ("core_client",)),
]  # fmt: skip


class Spy:
    """py-spy sampling one process (raw collapsed stacks, file named by its role) until stopped."""

    def __init__(self, proc: Any, folder: Path, i: int) -> None:
        role = "api" if i == 0 else "".join(c for c in proc.name() if not c.isdigit())
        spy = Path(sys.executable).with_name("py-spy")
        cmd = [str(spy), "record", "-p", str(proc.pid), "-f", "raw", "--nolineno", "-r", "100"]
        folder.mkdir(parents=True, exist_ok=True)
        out = folder / f"{role.replace(':', '_')}-{proc.pid}.txt"
        self.proc = subprocess.Popen([*cmd, "-o", str(out)], stdout=subprocess.DEVNULL)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(60)


def profiled(procs: list[Any], folder: Path, fn: Callable[[], Any]) -> Any:
    """``fn()`` with py-spy sampling every process of ``procs`` into ``folder``."""
    spies = [Spy(p, folder, i) for i, p in enumerate(procs)]
    time.sleep(1.0)  # attached before the first request
    try:
        return fn()
    finally:
        for s in spies:
            s.stop()


def category(stack: str) -> str:
    """The first rule matching: the leaf (last two frames) for waiting, else the whole stack."""
    leaf = ";" + ";".join(stack.split(";")[-2:])
    for cat, pats in RULES:
        where = leaf if cat.startswith("waiting") else stack
        if any(p in where for p in pats):
            return cat
    return "event loop (native)" if stack.endswith("Runner.run") else "other"


def seconds(folders: list[Path], label: Callable[[Path, Path], str]) -> dict[str, dict[str, float]]:
    """Seconds of samples (100 Hz) by ``label(folder, file)`` and category."""
    out: dict[str, dict[str, float]] = {}
    for d in folders:
        for f in d.glob("*.txt"):
            per = out.setdefault(label(d, f), {})
            for m in re.finditer(r"^(.*) (\d+)$", f.read_text(errors="replace"), re.M):
                cat = category(m.group(1))
                per[cat] = per.get(cat, 0.0) + int(m.group(2)) / 100
    return out


def role_of(_: Path, f: Path) -> str:
    """A sample file's process role (its name less the pid)."""
    return f.stem.rsplit("-", 1)[0]
