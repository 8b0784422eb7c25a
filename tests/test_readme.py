"""The README is a one-page front door that stays true (issue 46 item 1).

No engine, no server: the README's shell commands (and those of the guides in docs/) are read out
of their ```bash/```sh blocks and inline `steerserve ...` spans, and every `steerserve` command in
them is checked against the
installed CLI's own help (rendered at COLUMNS=80, as a user reads it): the subcommand exists,
every --flag it cites is one of that command's options, and it is given no more positional
arguments than its usage line takes. Every relative link of README.md and docs/*.md points at a
file that exists, and the README fits a page.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_LINES = 200  # issue 46's hard limit (aim: ~150)
_bin = Path(sys.executable).parent / "steerserve"
STEERSERVE = str(_bin if _bin.exists() else ROOT / ".venv" / "bin" / "steerserve")
# Shell words that separate one command from the next (shlex with punctuation_chars).
SEPARATORS = {";", "&", "&&", "|", "||", "(", ")", "do", "then", "done", "fi"}


def shell_blocks(text: str) -> list[str]:
    """The bodies of the ```bash and ```sh fences, in order."""
    return re.findall(r"^```(?:bash|sh|shell)[ \t]*\n(.*?)^```", text, re.M | re.S)


def _open_quote(line: str) -> bool:
    try:
        shlex.split(line, comments=True)
    except ValueError:  # "No closing quotation": a quoted JSON body goes on
        return True
    return False


def shell_lines(block: str) -> list[str]:
    """A block's commands: comment lines dropped, backslash continuations and lines inside an
    open quote (a multi-line JSON body) joined."""
    out: list[str] = []
    buf = ""
    for raw in block.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        line = f"{buf} {line}".strip() if buf else line
        buf = ""
        if line.endswith("\\"):
            buf = line[:-1].strip()
            continue
        if _open_quote(line):
            buf = line
            continue
        out.append(line)
    if buf:
        out.append(buf)
    return out


def commands_in(line: str) -> list[list[str]]:
    """The `steerserve` commands of one shell line (several where it pipes or chains)."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    words = list(lex)
    found: list[list[str]] = []
    cur: list[str] = []
    for w in [*words, ";"]:
        if w in SEPARATORS:
            if cur and Path(cur[0]).name == "steerserve":
                found.append(cur[1:])
            cur = []
        else:
            cur.append(w)
    return found


def readme_commands(path: Path = README) -> list[list[str]]:
    """Every `steerserve` command a page shows: in its shell blocks, and inline."""
    text = path.read_text()
    cmds: list[list[str]] = []
    for block in shell_blocks(text):
        for line in shell_lines(block):
            cmds += commands_in(line)
    for span in re.findall(r"`((?:\.venv/bin/)?steerserve [^`]+)`", text):
        if "…" in span or "..." in span:  # a pattern ("steerserve lab …"), not a command
            continue
        cmds += commands_in(" ".join(span.split()))
    return cmds


@functools.cache
def help_text(*path: str) -> str:
    env = {**os.environ, "COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"}
    p = subprocess.run(
        [STEERSERVE, *path, "--help"], capture_output=True, text=True, env=env, timeout=120
    )
    assert p.returncode == 0, (
        f"steerserve {' '.join(path)} --help exited {p.returncode}: {p.stderr}"
    )
    return p.stdout


def subcommands(help_: str) -> set[str]:
    """The command names a group's help lists under 'Commands:' (empty for a leaf)."""
    m = re.search(r"^Commands:\n((?:[ \t]+.*\n?)*)", help_, re.M)
    if not m:
        return set()
    return {line.split()[0] for line in m.group(1).splitlines() if re.match(r"  \S", line)}


def option_names(help_: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", help_))


def takes_value(help_: str, flag: str) -> bool:
    """Whether the option's own line gives it a metavar (`--port <int>`, `--dtype [auto|...]`)
    rather than none (`--open-admin`, `--enforce-eager / --compile`)."""
    for line in help_.splitlines():
        m = re.match(r"\s+(-\S.*?)(?:\s{2,}|$)", line)
        words = m.group(1).replace(",", " ").split() if m else []
        if flag in words:
            after = words[words.index(flag) + 1 : words.index(flag) + 2]
            return bool(after) and after[0] != "/" and not after[0].startswith("-")
    return False


def usage_arguments(help_: str, path: tuple[str, ...]) -> tuple[int, bool]:
    """How many positional arguments the usage line takes, and whether the last repeats."""
    m = re.search(r"^Usage: \S+ (.*)$", help_, re.M)
    assert m, help_
    words = m.group(1).split()[len(path) :]
    args = [w for w in words if w not in ("[OPTIONS]", "COMMAND", "[ARGS]...")]
    return len(args), any(w.endswith("...") for w in args)


def resolve(argv: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """Walk argv down the command tree: (the command's path, the words after it)."""
    path: tuple[str, ...] = ()
    rest = list(argv)
    while True:
        subs = subcommands(help_text(*path))
        if not subs or (path and not rest):  # a leaf, or a group named on its own
            return path, rest
        assert rest and rest[0] in subs, (
            f"`steerserve {' '.join(argv)}`: {rest[0] if rest else '(nothing)'!r} is not a "
            f"command of `steerserve {' '.join(path)}` (it has {sorted(subs)})"
        )
        path, rest = (*path, rest[0]), rest[1:]


def check_command(argv: list[str]) -> None:
    if argv[:1] == ["vllm"]:  # stock vLLM's command line: vLLM's own parser is the judge
        words = [w for w in argv if w != "--help"]
        p = subprocess.run([STEERSERVE, *words, "--help"], capture_output=True, text=True,
                           timeout=300)  # fmt: skip
        assert p.returncode == 0, f"`steerserve {' '.join(argv)}`: {p.stderr[-2000:]}"
        return
    path, rest = resolve(argv)
    shown = f"steerserve {' '.join(argv)}"
    help_ = help_text(*path)
    known = option_names(help_)
    positional: list[str] = []
    i = 0
    while i < len(rest):
        word = rest[i]
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            assert flag in known, (
                f"`{shown}`: {flag} is not an option of `steerserve {' '.join(path)}`"
            )
            if "=" not in word and takes_value(help_, flag):
                i += 1
        else:
            positional.append(word)
        i += 1
    n, repeats = usage_arguments(help_, path)
    assert len(positional) <= n or repeats, (
        f"`{shown}`: {positional} given, but `steerserve {' '.join(path)}` takes {n} argument(s)"
    )


COMMANDS = readme_commands()
# The guides the README links to (docs/*.md, not the results' records of past runs).
DOC_COMMANDS = [
    (doc.name, argv) for doc in sorted(DOCS.glob("*.md")) for argv in readme_commands(doc)
]


def test_the_readme_shows_steerserve_commands() -> None:
    """The extraction finds what the README shows (else the checks below check nothing)."""
    heads = {c[0] for c in COMMANDS if c}
    assert {"serve", "tune", "ab-report"} <= heads, heads


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a)[:60])
def test_readme_command_matches_the_cli(argv: list[str]) -> None:
    check_command(argv)


@pytest.mark.parametrize(
    ("doc", "argv"), DOC_COMMANDS, ids=lambda x: x if isinstance(x, str) else " ".join(x)[:50]
)
def test_docs_command_matches_the_cli(doc: str, argv: list[str]) -> None:
    check_command(argv)


def test_the_check_refuses_what_is_not_there() -> None:
    """The checker itself: an unknown subcommand, flag or extra argument is caught."""
    for bad in (["sreve"], ["serve", "--no-such-flag"], ["vectors", "show", "a", "b"]):
        with pytest.raises(AssertionError):
            check_command(bad)
    check_command(["vectors", "show", "gemma-3-270m/v3", "--root", "vectors"])


def test_extraction_of_shell_lines() -> None:
    block = (
        "# a comment\n"
        "for p in 1 2; do steerserve serve --port $p \\\n"
        "  --ab-split 0.5 & done\n"
        "steerserve vectors show x | grep verdict   # trailing comment\n"
    )
    cmds = [c for line in shell_lines(block) for c in commands_in(line)]
    assert cmds == [
        ["serve", "--port", "$p", "--ab-split", "0.5"],
        ["vectors", "show", "x"],
    ]


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def relative_links(path: Path) -> list[str]:
    """Link and image targets of a markdown file that point into the repository, code stripped."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)
    targets += re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, re.M)
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation dropped, spaces
    to hyphens (a repeated heading's -1, -2 ... included)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    seen: dict[str, int] = {}
    out: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(path: Path) -> None:
    """Every link into the repository finds its file, and a #section of a markdown file its
    heading (a same-page #section too)."""
    missing = [t for t in relative_links(path) if not (path.parent / t.split("#", 1)[0]).exists()]
    assert not missing, f"{path.relative_to(ROOT)}: links to nothing: {missing}"
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    broken = []
    for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or "#" not in target:
            continue
        file, anchor = target.split("#", 1)
        page = path.parent / file if file else path
        if page.suffix == ".md" and anchor not in heading_anchors(page):
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)}: no such section: {broken}"


def test_readme_fits_a_page() -> None:
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines (at most {MAX_LINES})"


def test_readme_states_the_vectors_status_and_links_the_evidence() -> None:
    """The status box says plainly that the shipped vectors do not mend recall, and links why."""
    text = README.read_text()
    head = text[: text.index("## Install")]
    assert "do not mend recall" in head
    assert "docs/results/" in head and "docs/status.md" in head
