"""Acceptance soak (issue 33): mixed load on a supervised `steerserve serve`, one engine kill and
one SIGTERM in it.

A supervisor thread restarts the server whenever it exits (as systemd's ``Restart=always``),
with the same port and the same A/B decision log (``--ab-split 0.5 --ab-log``). ``--clients``
clients send, for ``--duration`` seconds, a mix of chat and completions, collected and streamed,
steered (``true``, multipliers, entries) and unsteered, the A/B endpoint (collected and
streamed), requests enrolled in the server's split (a ``user`` field) and feedback on the
decisions the server answered with a 200. At a third of the duration EngineCore gets SIGKILL; at
two thirds the server process alone gets SIGTERM. A fault window runs from the fault until the
restarted server is ready (+ ``--window-slack`` s); a request belongs to a window when its
answer (or its error) arrives in one. The load goes on until ``--post-seconds`` after the last
window has closed, even past ``--duration``.

Checked: no 5xx (an error event in a stream counts as its status) outside the windows; every
process that was ever a child of a server incarnation gone within 30 s of that incarnation's
exit (and nothing left in its session at the end); every decision id and every feedback the
server answered with a 200 in the decision log. Also reported: requests by kind and status,
exit status of each incarnation and why (from its log), fault-to-ready and exit-to-ready times,
p50/p95 latency outside the windows. Exit status 1 when a check fails.

    .venv/bin/python docs/results/soak/soak.py                       # default model, 32 x 300 s
    .venv/bin/python docs/results/soak/soak.py --model tiny --duration 40 --clients 8  # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))
import harness  # noqa: E402

EN = "What is the capital city of France? Please answer briefly."
FR = "Quelle est la capitale de la France ? Réponds brièvement, s'il te plaît."
JA = "日本の首都はどこですか"

PROMPTS = (EN, FR, JA)
#: Seconds every process of an exited incarnation has to be gone (else it is an orphan).
GONE = 30.0
#: An error event's ``type`` in a stream -> the status it stands for.
STREAM_STATUS = {"service_unavailable": 503, "server_error": 500}


# --- the request mix ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """One kind of request. ``enrolled``: no ``steering`` and a ``user``, so the server's split
    decides its arm and logs it; ``feedback``: a score for a decision answered earlier."""

    name: str
    path: str
    body: dict[str, Any]
    enrolled: bool = False
    feedback: bool = False

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def catalogue(model: str, listing: dict[str, Any], max_tokens: int) -> list[Kind]:
    """The kinds the clients draw from (feedback twice: it is cheap and it is what is lost)."""
    art = next(a for a in listing["data"] if a["default"])["manifest"]
    ivs = art["interventions"]
    entries = [
        {"vector": f"{art['name']}/{art['version']}/{ivs[0]['name']}", "layer": ivs[0]["layer"]}
        | {"scale": ivs[0]["scale"], "positions": ivs[0].get("positions", "all")}
    ]
    mult = {"interventions": {ivs[-1]["name"]: 0.5}}
    chat = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    comp = chat | {"prompt": EN}
    stream = {"stream": True}
    return [
        Kind("chat unsteered", "/v1/chat/completions", chat | {"steering": False}),
        Kind("chat steered stream", "/v1/chat/completions", chat | {"steering": True} | stream),
        Kind("chat entries", "/v1/chat/completions", chat | {"steering": {"entries": entries}}),
        Kind("chat multipliers stream", "/v1/chat/completions", chat | {"steering": mult} | stream),
        Kind("completions unsteered", "/v1/completions", comp | {"steering": False}),
        Kind("completions steered stream", "/v1/completions", comp | {"steering": True} | stream),
        Kind("ab", "/v1/chat/completions/ab", chat | {"steering": True, "seed": 1}),
        Kind("ab stream", "/v1/chat/completions/ab", chat | {"steering": mult} | stream),
        Kind("split chat", "/v1/chat/completions", chat, enrolled=True),
        Kind("split chat stream", "/v1/chat/completions", chat | stream, enrolled=True),
        Kind("split completions", "/v1/completions", comp, enrolled=True),
        Kind("feedback", "/v1/steering/feedback", {}, feedback=True),
        Kind("feedback", "/v1/steering/feedback", {}, feedback=True),
    ]


@dataclass
class Result:
    kind: str
    t0: float
    t1: float
    status: int  # 0: no answer (connection error, a stream cut without [DONE])
    error: str = ""  # the exception's type, or "stream error" / "stream cut"


@dataclass
class Ledger:
    """What the clients saw: every request, and the ids and scores the server answered 200."""

    results: list[Result] = field(default_factory=list)
    decisions: dict[str, tuple[str | None, float, str]] = field(default_factory=dict)  # arm t kind
    feedback: Counter = field(default_factory=Counter)  # (id, score) answered 200
    scored: Counter = field(default_factory=Counter)  # id: feedback attempts (5 at most)
    feedback_404: list[str] = field(default_factory=list)  # ids the server did not know


def _messages(body: dict[str, Any], prompt: str) -> dict[str, Any]:
    if "prompt" in body:
        return body | {"prompt": prompt}
    return body | {"messages": [{"role": "user", "content": prompt}]}


async def _read_stream(r: httpx.Response) -> tuple[int, str, str | None, str | None]:
    """(status, error, id, experiment arm) of a streamed 200: 200 only after ``[DONE]`` with no
    error event; an error event stands for its type's status; no ``[DONE]``: 0, "stream cut"."""
    rid = arm = None
    err: dict[str, Any] | None = None
    done = False
    # hang up as soon as [DONE] is read (the harsher client: before d2d9523 the server counted
    # such a stream a 499 and lost its decision line)
    async for line in r.aiter_lines():
        if line == "data: [DONE]":
            done = True
            break
        if not line.startswith("data: {"):
            continue
        ev = json.loads(line[6:])
        if "error" in ev:
            err = ev["error"]
            continue
        rid = rid or ev.get("id")
        arm = arm or ((ev.get("steering") or {}).get("experiment") or {}).get("arm")
    if not done:
        return 0, "stream cut", rid, arm
    if err is not None:
        return STREAM_STATUS.get(err.get("type", ""), 400), "stream error", rid, arm
    return 200, "", rid, arm


async def call(c: httpx.AsyncClient, kind: Kind, rnd: random.Random, led: Ledger) -> Result:
    body = _messages(kind.body, rnd.choice(PROMPTS)) if not kind.feedback else {}
    if kind.enrolled:
        body["user"] = f"soak-user-{rnd.randrange(200)}"
    rid = None
    if kind.feedback:  # decisions answered 2 s ago at least (a stream's is logged after [DONE])
        old = time.monotonic() - 2
        ids = [i for i, (_, t, _) in led.decisions.items() if t < old and led.scored[i] < 5]
        if not ids:
            await asyncio.sleep(0.2)
            return Result(kind.name, 0, 0, -1)  # nothing to score yet: not a request
        rid = rnd.choice(ids)
        body = {"id": rid, "score": rnd.choice((1, 0, -1, 0.5))}
        led.scored[rid] += 1
    t0 = time.monotonic()
    arm = None
    try:
        if kind.stream:
            async with c.stream("POST", kind.path, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    status, error = r.status_code, ""
                else:
                    status, error, rid, arm = await _read_stream(r)
        else:
            r = await c.post(kind.path, json=body)
            status, error = r.status_code, ""
            if status == 200 and kind.enrolled:
                got = r.json()
                steering = got.get("steering") or {}
                if kind.path == "/v1/completions" and not steering:
                    steering = got["choices"][0].get("steering") or {}
                rid, arm = got["id"], (steering.get("experiment") or {}).get("arm")
            elif status == 404 and kind.feedback:
                led.feedback_404.append(str(rid))
    except httpx.HTTPError as e:
        status, error = 0, type(e).__name__
    t1 = time.monotonic()
    if status == 200 and kind.enrolled and rid:
        led.decisions[rid] = (arm, t1, kind.name)
    if status == 200 and kind.feedback:
        led.feedback[rid, float(body["score"])] += 1
    return Result(kind.name, t0, t1, status, error)


async def load(url: str, kinds: list[Kind], clients: int, sup: Supervisor) -> Ledger:
    """``clients`` clients until the supervisor says the soak is over; a client backs off 1 s
    after a failure (a refused connection fails at once: no tight loop while the server is down)."""
    led = Ledger()
    limits = httpx.Limits(max_connections=4, max_keepalive_connections=2, keepalive_expiry=2)

    async def client(k: int) -> None:
        rnd = random.Random(k)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
            while sup.loading():
                res = await call(c, rnd.choice(kinds), rnd, led)
                if res.status == -1:
                    continue
                led.results.append(res)
                if res.status == 0 or res.status >= 500:
                    await asyncio.sleep(1.0)

    await asyncio.gather(*(client(k) for k in range(clients)))
    return led


# --- the supervised server ---------------------------------------------------------------------


def _role(p: psutil.Process) -> str:
    try:
        text = " ".join(p.cmdline()) + " " + p.name()
    except psutil.Error:
        return "?"
    keys = (("EngineCore", "EngineCore"), ("Worker", "worker"), ("torchinductor", "inductor"))
    for key, role in (*keys, ("TORCH_INDUCTOR", "inductor")):
        if key in text:
            return role
    return "resource_tracker" if "resource_tracker" in text else p.name()


def _live(p: psutil.Process) -> bool:
    """Running and not a zombie (a dead orphan waits for PID 1 to reap it)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@dataclass
class Incarnation:
    """One ``steerserve serve`` process, and every process ever seen below it."""

    index: int
    proc: subprocess.Popen
    log: Path
    started: float
    ready_at: float | None = None
    exited_at: float | None = None
    code: int | None = None
    ended_by: str = "?"  # the fault or stop that ended it
    signalled_at: float | None = None
    forced: bool = False  # SIGKILLed by the supervisor after not exiting in time
    family: dict[tuple[int, float], tuple[str, psutil.Process]] = field(default_factory=dict)
    cmdlines: dict[int, str] = field(default_factory=dict)  # pid: the first one seen
    gone_after: float | None = None  # seconds from exit until every child was gone
    left: list[str] = field(default_factory=list)  # children alive GONE s after the exit

    def scan(self) -> None:
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return
        for p in kids:
            try:
                key = (p.pid, p.create_time())
            except psutil.Error:
                continue
            role = _role(p)  # again each time: EngineCore takes its title after the spawn
            if key not in self.family or role != "?":
                self.family[key] = (role, p)
            if p.pid not in self.cmdlines:
                try:
                    self.cmdlines[p.pid] = " ".join(p.cmdline())[:200]
                except psutil.Error:
                    pass

    def roles(self) -> Counter:
        return Counter(role for role, _ in self.family.values())

    def why(self) -> str:
        """The log lines that say why it stopped (the engine died, requests dropped)."""
        keys = ("the engine died", "stopped:", "dropping the requests", "Traceback")
        text = self.log.read_text(errors="replace").splitlines()
        lines = [
            f"a traceback ({where.group(1) if where else '?'})"
            if "Traceback" in line
            else line.split(": ", 1)[-1][:160]
            for line in text
            if any(k in line for k in keys)
            for where in [re.search(r"\[(\S+\.py:\d+)\]", line)]
        ]
        hangups = sum("status=499" in line for line in text)
        why = "; ".join(dict.fromkeys(lines))
        if not why:
            why = "drained, nothing dropped" if self.code == 0 else "(nothing logged)"
        return f"{why} (hang-ups it counted 499: {hangups})"


class Supervisor(threading.Thread):
    """Starts the server, restarts it whenever it exits, injects the faults once the load runs,
    and keeps the fault windows and each incarnation's processes."""

    def __init__(self, env: dict[str, str], workdir: Path, args: Any) -> None:
        super().__init__(daemon=True)
        self.env, self.workdir, self.args = env, workdir, args
        self.url = f"http://127.0.0.1:{env['STEERSERVE_PORT']}"
        self.incarnations: list[Incarnation] = []
        self.windows: list[list[float | None]] = []  # [fault, ready again]
        self.faults: list[dict[str, Any]] = []
        self.t0: float | None = None  # the load's start
        self.plan: list[tuple[float, str]] = []
        self.stop_load = False
        self.stopping = False  # the final stop: no restart
        self.error: BaseException | None = None
        self.start_new()

    def start_new(self) -> None:
        i = len(self.incarnations)
        log = self.workdir / f"serve-{i}.log"
        with log.open("w") as f:
            proc = subprocess.Popen(
                [sys.executable, "-m", "steerserve", "serve"],
                env=self.env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.incarnations.append(Incarnation(i, proc, log, time.monotonic()))

    @property
    def current(self) -> Incarnation:
        return self.incarnations[-1]

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.current.ready_at is None:
            if self.error is not None:
                raise self.error
            if self.current.code is not None or time.monotonic() > deadline:
                raise RuntimeError("server not ready:\n" + self.current.log.read_text()[-3000:])
            time.sleep(0.2)

    def begin_load(self) -> None:
        self.t0 = t0 = time.monotonic()
        d = self.args.duration
        self.plan = [(t0 + d / 3, "engine SIGKILL"), (t0 + 2 * d / 3, "server SIGTERM")]

    def loading(self) -> bool:
        """Whether the clients go on: until --duration, every fault injected, the last window
        closed and --post-seconds after it (bounded by --max-extra past --duration)."""
        if self.t0 is None or self.stop_load or self.error is not None:
            return False
        now, end = time.monotonic(), self.t0 + self.args.duration
        if now > end + self.args.max_extra:
            return False
        if now < end or self.plan or any(w[1] is None for w in self.windows):
            return True
        last = max((w[1] for w in self.windows), default=0.0)
        return now < last + self.args.post_seconds  # type: ignore[operator]

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # reported by the main thread
            self.error = e

    def _run(self) -> None:
        retired: list[Incarnation] = []
        last_scan = 0.0
        while True:
            inc, now = self.current, time.monotonic()
            if now - last_scan > 0.5:
                inc.scan()
                last_scan = now
            self._watch_gone(retired, now)
            code = inc.proc.poll()
            if code is not None:
                inc.scan()
                inc.code, inc.exited_at = code, time.monotonic()
                if inc.signalled_at is None:
                    inc.ended_by = "unexpected exit"
                retired.append(inc)
                if self.stopping:
                    break
                time.sleep(0.1)  # systemd's RestartSec default
                self.start_new()
                continue
            if inc.ready_at is None and self._ready():
                inc.ready_at = time.monotonic()
                for w in self.windows:
                    w[1] = inc.ready_at if w[1] is None else w[1]
            elif inc.ready_at is not None and self.plan and now >= self.plan[0][0]:
                self._fault(inc, self.plan.pop(0)[1])
            elif self.stop_load and not self.stopping and not self.loading():
                self.stopping = True  # one stopping already (a fault) is left to finish
                if inc.signalled_at is None:
                    inc.ended_by, inc.signalled_at = "final SIGTERM", now
                    inc.proc.send_signal(signal.SIGTERM)
            limit = self.args.drain_limit if inc.ended_by != "engine SIGKILL" else 120
            if inc.signalled_at is not None and now - inc.signalled_at > limit and not inc.forced:
                inc.forced = True  # did not exit in time: a failure of its own
                os.killpg(inc.proc.pid, signal.SIGKILL)
            time.sleep(0.1)
        deadline = time.monotonic() + GONE + 1
        while any(i.gone_after is None and not i.left for i in retired):
            if time.monotonic() > deadline:
                break
            self._watch_gone(retired, time.monotonic())
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _fault(self, inc: Incarnation, what: str) -> None:
        now = time.monotonic()
        fault: dict[str, Any] = {"fault": what, "at": now, "incarnation": inc.index}
        if what == "engine SIGKILL":
            inc.scan()
            cores = [p for role, p in inc.family.values() if role == "EngineCore" and _live(p)]
            if not cores:
                fault["error"] = "no EngineCore process found"
                self.faults.append(fault)
                return
            fault["pid"] = cores[0].pid
            cores[0].kill()
        else:
            fault["pid"] = inc.proc.pid
            inc.proc.send_signal(signal.SIGTERM)  # the server alone, not its group
        inc.ended_by, inc.signalled_at = what, now
        self.faults.append(fault)
        self.windows.append([now, None])

    @staticmethod
    def _watch_gone(retired: list[Incarnation], now: float) -> None:
        for inc in retired:
            if inc.gone_after is not None or inc.left:
                continue
            alive = [p for _, p in inc.family.values() if _live(p)]
            if not alive:
                inc.gone_after = now - inc.exited_at  # type: ignore[operator]
            elif now - inc.exited_at > GONE:  # type: ignore[operator]
                inc.left = [f"{p.pid} {_role(p)}" for p in alive]


def session_leftovers(incs: list[Incarnation]) -> list[str]:
    """Live processes still in the session of any incarnation (each server starts its own), so
    that a child the 0.5 s scans never saw is not missed."""
    sids = {i.proc.pid for i in incs}
    out = []
    for pid in psutil.pids():
        try:
            if os.getsid(pid) in sids and _live(psutil.Process(pid)):
                out.append(f"{pid} {_role(psutil.Process(pid))}")
        except (OSError, psutil.Error):
            continue
    return out


# --- the decision log --------------------------------------------------------------------------


def check_log(path: Path, led: Ledger) -> dict[str, Any]:
    """Decision ids and feedback answered 200 that the log lacks; lines it cannot read."""
    decisions: dict[str, dict[str, Any]] = {}
    feedback: Counter = Counter()
    torn = 0
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines() if path.exists() else []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            torn += 1
            continue
        if rec.get("type") == "decision":
            decisions[rec["id"]] = rec
        elif rec.get("type") == "feedback":
            feedback[rec["id"], float(rec["score"])] += 1
    missing = [i for i in led.decisions if i not in decisions]
    arms = [
        i
        for i, (arm, _, _) in led.decisions.items()
        if arm is not None and i in decisions and decisions[i]["arm"] != arm
    ]
    lost_fb = sum(max(0, n - feedback[k]) for k, n in led.feedback.items())
    return {
        "lines": len(lines),
        "torn_lines": torn,
        "decision_lines": len(decisions),
        "feedback_lines": sum(feedback.values()),
        "decisions_answered_200": len(led.decisions),
        "decisions_missing": len(missing),
        "missing_ids": [f"{i} ({led.decisions[i][2]})" for i in missing[:20]],
        "arm_mismatches": len(arms),
        "decisions_not_seen_by_clients": len(set(decisions) - set(led.decisions)),
        "feedback_answered_200": sum(led.feedback.values()),
        "feedback_missing": lost_fb,
        "feedback_404": len(led.feedback_404),
    }


# --- the report --------------------------------------------------------------------------------


def _in_window(t: float, windows: list[list[float | None]], slack: float) -> bool:
    return any(a <= t <= (b + slack if b is not None else float("inf")) for a, b in windows)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def _status(r: Result) -> str:
    if r.status == 0:
        return f"conn:{r.error}"
    return f"{r.status}{' (stream event)' if r.error == 'stream error' else ''}"


def summarize(sup: Supervisor, led: Ledger, log: dict[str, Any], args: Any) -> dict[str, Any]:
    t0 = sup.t0 or 0.0
    win = [r for r in led.results if _in_window(r.t1, sup.windows, args.window_slack)]
    out = [r for r in led.results if not _in_window(r.t1, sup.windows, args.window_slack)]

    def counts(rs: list[Result]) -> dict[str, int]:
        return {
            "requests": len(rs),
            "200": sum(r.status == 200 for r in rs),
            "4xx": sum(400 <= r.status < 500 for r in rs),
            "5xx": sum(r.status >= 500 for r in rs),
            "connection_errors": sum(r.status == 0 for r in rs),
        }

    by_kind: dict[str, Counter] = defaultdict(Counter)
    for r in led.results:
        by_kind[r.kind][_status(r)] += 1
    lat: dict[str, list[float]] = defaultdict(list)
    for r in out:
        if r.status == 200:
            lat[r.kind].append(r.t1 - r.t0)
            lat["all"].append(r.t1 - r.t0)
    incs = []
    for inc in sup.incarnations:
        incs.append(
            {
                "index": inc.index,
                "pid": inc.proc.pid,
                "started_s": round(inc.started - t0, 1),
                "ready_s": None if inc.ready_at is None else round(inc.ready_at - t0, 1),
                "start_to_ready_s": None
                if inc.ready_at is None
                else round(inc.ready_at - inc.started, 1),
                "exited_s": None if inc.exited_at is None else round(inc.exited_at - t0, 1),
                "ended_by": inc.ended_by,
                "exit_code": inc.code,
                "forced_kill": inc.forced,
                "why": inc.why() if inc.code is not None else "",
                "processes": dict(inc.roles()),
                "process_list": [
                    f"{pid} {role} {inc.cmdlines.get(pid, '')}"
                    for (pid, _), (role, _) in inc.family.items()
                ],
                "children_gone_after_s": None
                if inc.gone_after is None
                else round(inc.gone_after, 1),
                "orphans": inc.left,
            }
        )
    faults = []
    for f in sup.faults:
        nxt = next((i for i in sup.incarnations if i.index == f["incarnation"] + 1), None)
        old = sup.incarnations[f["incarnation"]]
        ready = None if nxt is None else nxt.ready_at
        faults.append(
            {
                "fault": f["fault"],
                "pid": f.get("pid"),
                "error": f.get("error"),
                "at_s": round(f["at"] - t0, 1),
                "exit_code": old.code,
                "fault_to_exit_s": None
                if old.exited_at is None
                else round(old.exited_at - f["at"], 1),
                "fault_to_ready_s": None if ready is None else round(ready - f["at"], 1),
                "exit_to_ready_s": None
                if ready is None or old.exited_at is None
                else round(ready - old.exited_at, 1),
            }
        )
    return {
        "outside_windows": counts(out),
        "inside_windows": counts(win),
        "inside_windows_by_status": dict(Counter(_status(r) for r in win)),
        "outside_windows_not_200": dict(Counter(_status(r) for r in out if r.status != 200)),
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "latency_outside_windows_s": {
            k: {"n": len(v), "p50": _pct(v, 0.5), "p95": _pct(v, 0.95)}
            for k, v in sorted(lat.items())
        },
        "windows_s": [
            [round(a - t0, 1), None if b is None else round(b - t0, 1)]
            for a, b in sup.windows  # type: ignore[operator]
        ],
        "faults": faults,
        "incarnations": incs,
        "decision_log": log,
    }


def markdown(s: dict[str, Any], meta: dict[str, Any]) -> str:
    o, w, log = s["outside_windows"], s["inside_windows"], s["decision_log"]
    orphans = [x for i in s["incarnations"] for x in i["orphans"]] + meta["session_leftovers"]
    checks = [
        ("5xx outside fault windows", o["5xx"]),
        ("orphaned processes", len(orphans)),
        ("decision lines lost", log["decisions_missing"]),
        ("feedback lines lost", log["feedback_missing"]),
        ("faults not injected", 2 - sum(f["error"] is None for f in s["faults"])),
        ("incarnations force-killed", sum(i["forced_kill"] for i in s["incarnations"])),
        ("unexpected exits", sum(i["ended_by"] == "unexpected exit" for i in s["incarnations"])),
    ]
    md = [
        f"`{meta['command']}`: model `{meta['model']}`, {meta['clients']} clients, "
        f"{meta['wall']:.0f} s of load (--duration {meta['duration']:.0f}); {meta['machine']}, "
        f"{meta['date']}, load average {meta['load0']:.1f} at start, {meta['load1']:.1f} at end. "
        f"Fault windows (s from the load's start, fault to ready again, + {meta['slack']:.0f} s): "
        + ", ".join(f"{a}-{b}" for a, b in s["windows_s"])
        + ".\n",
        "| check | count | |\n|---|---|---|",
        *(f"| {name} | {n} | {'ok' if n == 0 else '**FAIL**'} |" for name, n in checks),
        "",
        "| requests | total | 200 | 4xx | 5xx | connection errors |\n|---|---|---|---|---|---|",
        *(
            f"| {name} | {c['requests']} | {c['200']} | {c['4xx']} | {c['5xx']} "
            f"| {c['connection_errors']} |"
            for name, c in (("outside fault windows", o), ("inside fault windows", w))
        ),
        "",
        "Inside the windows by status: "
        + (", ".join(f"{k} x{n}" for k, n in sorted(s["inside_windows_by_status"].items())))
        + ". Outside, not 200: "
        + (", ".join(f"{k} x{n}" for k, n in s["outside_windows_not_200"].items()) or "none")
        + ".\n",
        "| fault | at s | exit status | fault to exit s | fault to ready s | exit to ready s |\n"
        "|---|---|---|---|---|---|",
        *(
            f"| {f['fault']}{' (' + f['error'] + ')' if f['error'] else ''} | {f['at_s']} "
            f"| {f['exit_code']} | {f['fault_to_exit_s']} | {f['fault_to_ready_s']} "
            f"| {f['exit_to_ready_s']} |"
            for f in s["faults"]
        ),
        "",
        "| incarnation | start to ready s | ended by | exit status | why (its log) "
        "| processes seen | children gone after s | orphans |\n|---|---|---|---|---|---|---|---|",
        *(
            f"| {i['index']} | {i['start_to_ready_s']} | {i['ended_by']} | {i['exit_code']}"
            f"{' (force-killed)' if i['forced_kill'] else ''} | {i['why']} "
            f"| {', '.join(f'{k} {n}' for k, n in i['processes'].items())} "
            f"| {i['children_gone_after_s']} | {', '.join(i['orphans']) or 'none'} |"
            for i in s["incarnations"]
        ),
        "",
        f"Decision log: {log['lines']} lines ({log['torn_lines']} unreadable), "
        f"{log['decision_lines']} decisions, {log['feedback_lines']} feedback. Decisions the "
        f"clients got a 200 for: {log['decisions_answered_200']}, missing from the log: "
        f"{log['decisions_missing']}, logged under another arm: {log['arm_mismatches']}; logged "
        f"but not seen answered by a client (cut by a fault): "
        f"{log['decisions_not_seen_by_clients']}. Feedback answered 200: "
        f"{log['feedback_answered_200']}, missing from the log: {log['feedback_missing']}; "
        f"feedback answered 404: {log['feedback_404']}. Processes left in the servers' sessions "
        f"at the end: {', '.join(meta['session_leftovers']) or 'none'}."
        + (f" Missing: {', '.join(log['missing_ids'])}." if log["missing_ids"] else "")
        + "\n",
        "| kind | statuses (whole run) | p50 s | p95 s (200, outside windows) |\n|---|---|---|---|",
    ]
    lat = s["latency_outside_windows_s"]
    for kind, st in s["by_kind"].items():
        lk = lat.get(kind, {"p50": float("nan"), "p95": float("nan")})
        sts = ", ".join(f"{k} x{n}" for k, n in sorted(st.items()))
        md.append(f"| {kind} | {sts} | {lk['p50']:.2f} | {lk['p95']:.2f} |")
    a = lat.get("all", {"n": 0, "p50": float("nan"), "p95": float("nan")})
    md.append(f"| all ({a['n']} answered 200) | | {a['p50']:.2f} | {a['p95']:.2f} |")
    return "\n".join(md) + "\n"


# --- main --------------------------------------------------------------------------------------


def server_env(args: Any, workdir: Path) -> tuple[dict[str, str], str]:
    """The servers' environment (every incarnation the same) and the model's name for the report."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEERSERVE_")}
    env |= {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "STEERSERVE_HOST": "127.0.0.1",
        "STEERSERVE_PORT": str(harness.free_port()),
        "STEERSERVE_LOG_LEVEL": "info",
        "STEERSERVE_AB_SPLIT": "0.5",
        "STEERSERVE_AB_NAME": "soak",
        "STEERSERVE_AB_LOG": str(workdir / "decisions.jsonl"),
    }
    if args.drain_seconds is not None:
        env["STEERSERVE_DRAIN_SECONDS"] = str(args.drain_seconds)
    if args.model == "tiny":
        model, vectors = harness.tiny_with_vectors(workdir)
        env |= {"STEERSERVE_MODEL": str(model), "STEERSERVE_VECTORS_DIR": str(vectors)}
        env |= {"STEERSERVE_DTYPE": "float32", "STEERSERVE_MAX_MODEL_LEN": "512"}
        env |= {"STEERSERVE_KV_CACHE_MEMORY_BYTES": str(128 << 20)}
        return env, "steerserve.models.tiny Llama (random weights, float32)"
    if args.model == "default":  # converted once (minutes), before any server is timed
        subprocess.run(
            [
                sys.executable,
                "-c",
                "from steerserve.models import resolve_model as r; r('default')",
            ],
            check=True,
        )
    env["STEERSERVE_MODEL"] = args.model
    if args.vectors_dir:
        env["STEERSERVE_VECTORS_DIR"] = str(args.vectors_dir)
    return env, args.model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="default, tiny, or a checkpoint folder")
    ap.add_argument("--vectors-dir", type=Path, help="artifacts for a --model folder")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--drain-seconds", type=int, help="the servers' (default: theirs, 300)")
    ap.add_argument("--window-slack", type=float, default=5.0, help="s after ready again")
    ap.add_argument("--post-seconds", type=float, default=20.0, help="load after the last window")
    ap.add_argument("--max-extra", type=float, default=600.0, help="most load past --duration")
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    ap.add_argument("--json", type=Path, help="write the raw numbers here")
    ap.add_argument("--workdir", type=Path, help="logs and decision log (default: a new temp dir)")
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="steerserve-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"workdir (server logs, decision log): {workdir}", flush=True)
    env, model_label = server_env(args, workdir)
    # a server that never exits by itself: SIGTERM drains for up to --drain-seconds, then 5 s
    drain = args.drain_seconds if args.drain_seconds is not None else 300
    args.drain_limit = drain + 60
    sup = Supervisor(env, workdir, args)
    sup.start()
    try:
        sup.wait_ready(args.ready_timeout)
        name = httpx.get(f"{sup.url}/v1/models", timeout=10).json()["data"][0]["id"]
        listing = httpx.get(f"{sup.url}/v1/steering/vectors", timeout=10).json()
        kinds = catalogue(name, listing, args.max_tokens)
        print(f"ready in {sup.current.ready_at - sup.current.started:.0f} s; load", flush=True)
        load0 = os.getloadavg()[0]
        sup.begin_load()
        led = asyncio.run(load(sup.url, kinds, args.clients, sup))
        wall, load1 = time.monotonic() - sup.t0, os.getloadavg()[0]  # type: ignore[operator]
    finally:
        sup.stop_load = True
        sup.join(args.drain_limit + GONE + 60)
        for inc in sup.incarnations:  # only on a failure of the soak itself
            if inc.proc.poll() is None:
                os.killpg(inc.proc.pid, signal.SIGKILL)
    if sup.error is not None:
        raise sup.error
    log = check_log(workdir / "decisions.jsonl", led)
    s = summarize(sup, led, log, args)
    meta = {
        "command": "docs/results/soak/soak.py " + " ".join(sys.argv[1:]),
        "model": model_label,
        "clients": args.clients,
        "duration": args.duration,
        "wall": wall,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d"),
        "load0": load0,
        "load1": load1,
        "slack": args.window_slack,
        "session_leftovers": session_leftovers(sup.incarnations),
    }
    md = markdown(s, meta)
    print(md)
    if args.json:
        args.json.write_text(json.dumps({**meta, **s}, indent=1, default=str))
    o = s["outside_windows"]
    orphans = meta["session_leftovers"] + [x for i in s["incarnations"] for x in i["orphans"]]
    bad = o["5xx"] or orphans or log["decisions_missing"] or log["feedback_missing"]
    bad = bad or any(f["error"] for f in s["faults"]) or len(s["faults"]) < 2
    bad = bad or any(
        i["forced_kill"] or i["ended_by"] == "unexpected exit" for i in s["incarnations"]
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
