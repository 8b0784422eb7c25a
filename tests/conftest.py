"""Shared fixtures: tiny random models built offline, once per test session."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# One process per engine: fast start, workers reachable. Tests that need vLLM's default
# multi-process mode set it to "1" around their engine.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from steerserve.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: build_tiny_model(root / arch, arch) for arch in ("llama", "gemma3")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def tiny_gemma(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["gemma3"]


@pytest.fixture(scope="module")
def root(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path
) -> Path:
    """A module's folder, its ``vectors/`` holding one artifact (``v1``) for the tiny Llama; a
    module whose server wants other vectors defines its own ``root``."""
    from _server import make_artifact

    root = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    make_artifact(root / "vectors", tiny_llama, "v1")
    return root


@pytest.fixture(scope="module")
def http(server: Any) -> Iterator[Any]:
    """An httpx client of the module's ``server`` fixture (a ``_server.Server``) with the test
    key; a module whose server wants another client defines its own ``http``."""
    import httpx
    from _server import AUTH

    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server: Any) -> Any:
    """The ``openai`` SDK on the module's ``server`` fixture, with the test key, no retries."""
    import openai
    from _server import KEY

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


#: What starts a vLLM engine, a server, a browser or another process: a test module that does is
#: marked ``heavy`` and left out of the fast tier (``make test-fast``: ``-m "not heavy"``); the
#: full suite (``make test``) runs every test. Read from the module's text, so a new module that
#: starts an engine is heavy without anyone remembering to mark it.
HEAVY = re.compile(
    r"create_app\(|SteerEngine\(|\bengine\(|serving\(|Serve\(|Server\(|subprocess\.|AsyncLLM"
    r"|\bLLM\(|simple_evaluate|chromium|tiny_server\(|tiny_http\(|dry_run\("
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "heavy: starts an engine, server or process (not fast)")


#: The slowest tests and modules of the run (setup + call + teardown), written at its end: CI's clone keeps
#: the file, so a slowdown shows by name without rereading the log (issue 59).
SLOWEST = Path(__file__).parents[1] / ".work" / "slowest-tests.txt"
_durations: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _durations:
        return
    top = sorted(_durations.items(), key=lambda kv: -kv[1])[:15]
    SLOWEST.parent.mkdir(parents=True, exist_ok=True)
    total = sum(_durations.values())
    per_file: dict[str, float] = {}
    for nodeid, d in _durations.items():
        per_file[nodeid.split("::")[0]] = per_file.get(nodeid.split("::")[0], 0.0) + d
    files = sorted(per_file.items(), key=lambda kv: -kv[1])[:15]
    lines = [
        f"# {len(_durations)} tests, {total:.0f} s in tests, exit {exitstatus}",
        *(f"{d:8.1f} s  {n}" for n, d in top),
        "# the 15 slowest modules",
        *(f"{d:8.1f} s  {n}" for n, d in files),
    ]
    SLOWEST.write_text("\n".join(lines) + "\n")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    heavy: dict[Path, bool] = {}
    for item in items:
        if item.path not in heavy:
            heavy[item.path] = bool(HEAVY.search(item.path.read_text()))
        if heavy[item.path]:
            item.add_marker(pytest.mark.heavy)


@pytest.fixture(scope="session")
def product_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """steerserve's wheel built from the CPU image's build context (the checkout less what
    .dockerignore leaves out): the wheel pip builds when the image installs the context."""
    from _venv import build_wheel
    from test_deploy import context_files

    return build_wheel(context_files(), tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="session")
def installed_venv(product_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One fresh venv with the product wheel installed by the image's install steps
    (deploy/install-cpu.sh), shared by test_deploy.py and test_wheel.py: each install is ~2 min
    of a 2-core machine. Removed at the end: it holds GBs."""
    import shutil

    from _venv import install_cpu

    root = tmp_path_factory.mktemp("installed")
    yield install_cpu(product_wheel, root)
    shutil.rmtree(root, ignore_errors=True)
