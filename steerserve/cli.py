"""steerserve command line (typer)."""

from __future__ import annotations

import typer

app = typer.Typer(
    help="steerserve: multilingual factual-recall steering for vLLM.", no_args_is_help=True
)


@app.callback()
def _root() -> None:
    """Serve, build and evaluate steering vectors."""


def main() -> None:
    app()
