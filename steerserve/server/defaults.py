"""Serving defaults shared by the CLI and ``ServerSettings``: one place for each, in a module
that imports nothing heavy (the CLI must not load the server or vLLM to print its help)."""

#: On SIGTERM/SIGINT: how long requests in flight may finish before the server stops.
DRAIN_SECONDS = 300

#: Idle HTTP connections are kept this long: longer than a proxy's idle timeout (60 s is common)
#: and a busy client's lag, so the server never closes a connection a client is reusing
#: (uvicorn's 5 s: 298 client ReadErrors in 3 min of bench/load.py at load 10; 75 s: 0).
KEEP_ALIVE_SECONDS = 75
