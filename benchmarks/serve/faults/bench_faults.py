"""Faults of a live server, one scenario each: what the client gets, the worst /health latency meanwhile (a poller
in a process of its own, GET /health every ~50 ms with a short timeout; a timeout counts as the timeout and is
flagged), the API process's RSS growth (VmRSS sampled every 50 ms: peak and after, and VmHWM) and the time to the
answer. Scenarios: ``stop`` (the most stop strings the server allows, then 100,000), ``token-ids`` (16 MB of token
ids, 2M one-token prompts, 1M logit_bias keys), ``stall`` (SIGSTOP the engine process, then SIGCONT), ``body-cap``
(20 MB and 40 MB bodies from urllib: the 413 read, or a reset), ``beside-long`` (8-token generates beside a 50,000-word
prefill), ``burst`` (500 generates at once: the 429s and how fast they come; sent by nghttp2's ``h2load`` where it is on
PATH, a compiled client whose own CPU does not delay the answers it times, else by this process: ``--burst-client``).

    python -m benchmarks.serve.faults.bench_faults [--only NAME[,NAME]] [--json PATH] [--engine-timeout S]
        [--max-stop N]
    python -m benchmarks.serve.faults.bench_faults --url http://127.0.0.1:8000 [--api-pid PID] [--engine-pid PID]

Without ``--url`` it starts ``python -m server`` on the shipped text-lrnn, text-regulargpt and parity_check-lrnn
(restarted if a scenario ends it) and stops it at the end; every scenario is capped at about ``--cap`` seconds, and a
stopped engine is always continued.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import re
import shutil
import signal
import statistics
import string
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from benchmarks.serve.harness import (
    ROOT,
    add_server_arguments,
    child_pids,
    cpu_seconds,
    machine,
    percentile,
    server_process,
)
from server.settings import SHIPPED_CHECKPOINTS

TEXT_LRNN, TEXT_GPT, PARITY = "text-lrnn", "text-regulargpt", "parity_check-lrnn"
MODELS = (TEXT_LRNN, TEXT_GPT, PARITY)
SCENARIOS = ("stop", "token-ids", "stall", "body-cap", "beside-long", "burst")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "  # 18 words
JSON_HEADERS = {"Content-Type": "application/json"}

# The poller and RSS sampler, in a process of its own so that the benchmark's own work (building 16 MB bodies, 500
# sockets) does not delay it. Lines on stdout: "h START LATENCY STATUS DETAIL" and "m TIME PID VMRSS_KB VMHWM_KB".
MONITOR = r"""
import http.client, os, sys, threading, time
host, port, interval, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
pids = [int(pid) for pid in sys.argv[5:]]
lock = threading.Lock()
def emit(*fields):
    with lock:
        sys.stdout.write(" ".join(str(f) for f in fields) + "\n")
        sys.stdout.flush()
def health():
    connection, parent = None, os.getppid()
    while os.getppid() == parent:  # ends with the benchmark, whatever killed it
        start = time.monotonic()
        try:
            if connection is None:
                connection = http.client.HTTPConnection(host, port, timeout=timeout)
            connection.request("GET", "/health")
            response = connection.getresponse()
            body = response.read()
            detail = "" if response.status == 200 else body.decode("utf-8", "replace").replace("\n", " ")[:160]
            emit("h", start, time.monotonic() - start, response.status, detail)
        except TimeoutError:
            emit("h", start, time.monotonic() - start, "timeout", "")
            connection.close(); connection = None
        except Exception as error:
            emit("h", start, time.monotonic() - start, "error", type(error).__name__)
            if connection is not None:
                connection.close()
            connection = None
        time.sleep(max(0.0, interval - (time.monotonic() - start)))
def memory():
    while True:
        now = time.monotonic()
        for pid in pids:
            try:
                fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines())
                emit("m", now, pid, fields["VmRSS"].split()[0], fields["VmHWM"].split()[0])
            except Exception:
                pass
        time.sleep(0.05)
threading.Thread(target=memory, daemon=True).start()
health()
"""


@dataclass
class Answer:
    """One request's outcome: an HTTP status, or what went wrong instead ("timeout", "reset", ...)."""

    status: int | None
    seconds: float
    error: str | None = None
    message: str | None = None

    @property
    def label(self) -> str:
        return str(self.status) if self.status is not None else str(self.error)


@dataclass
class Row:
    scenario: str
    case: str
    got: str = "-"
    answer_s: float | None = None
    health_worst_ms: float | None = None
    health_timeouts: int = 0
    health_statuses: str = "-"
    rss_peak_mib: float | None = None
    rss_after_mib: float | None = None
    hwm_mib: float | None = None
    notes: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


# --- processes -------------------------------------------------------------------------------------------------


def read_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, kB (empty if it has gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    return {key: int(fields[key].split()[0]) for key in ("VmRSS", "VmHWM") if key in fields}


def engine_pid_of(api_pid: int) -> int | None:
    """The engine process: the API process's child started by multiprocessing (not its resource tracker)."""
    candidates = []
    for child in child_pids(api_pid):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "resource_tracker" not in command:
            candidates.append((read_status(child).get("VmRSS", 0), child))
    return max(candidates)[1] if candidates else None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return Path(f"/proc/{pid}/status").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()


class Monitor:
    """The /health poller and RSS sampler (a subprocess); samples in monotonic time, which the processes share."""

    def __init__(self, url: str, pids: list[int], interval: float, timeout: float) -> None:
        parts = urlsplit(url)
        self.timeout = timeout
        self.health: list[tuple[float, float, str, str]] = []  # start, latency, status, detail
        self.memory: list[tuple[float, int, int, int]] = []  # time, pid, VmRSS kB, VmHWM kB
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                MONITOR,
                parts.hostname or "127.0.0.1",
                str(parts.port or 80),
                str(interval),
                str(timeout),
                *map(str, pids),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            parts = line.rstrip("\n").split(" ", 4)
            if parts[0] == "h":
                self.health.append((float(parts[1]), float(parts[2]), parts[3], parts[4] if len(parts) > 4 else ""))
            elif parts[0] == "m":
                self.memory.append((float(parts[1]), int(parts[2]), int(parts[3]), int(parts[4])))

    def wait_past(self, moment: float) -> None:
        """Until a /health poll started after ``moment`` has been reported (those started before it have ended)."""
        deadline = time.monotonic() + self.timeout + 2
        while time.monotonic() < deadline and not any(start > moment for start, *_ in self.health[-5:]):
            time.sleep(0.02)

    def polls(self, start: float, end: float) -> list[tuple[float, float, str, str]]:
        """The polls in flight at some moment between ``start`` and ``end``."""
        return [sample for sample in self.health if sample[0] <= end and sample[0] + sample[1] >= start]

    def rss_peak(self, pid: int, start: float, end: float) -> int | None:
        values = [rss for moment, each, rss, _ in self.memory if each == pid and start <= moment <= end]
        return max(values) if values else None

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)


class Target:
    """The server under test: one this benchmark started (restarted if a scenario ends it), or ``--url``'s."""

    def __init__(self, args: argparse.Namespace, models: Path | None) -> None:
        self.args, self.models = args, models
        self.stack = ExitStack()
        self.url = args.url.rstrip("/") if args.url else ""
        self.api_pid: int | None = args.api_pid
        self.engine_pid: int | None = args.engine_pid
        self.monitor: Monitor | None = None
        self.stopped: set[int] = set()  # processes this benchmark has SIGSTOPped and not yet continued

    def start(self) -> None:
        if self.models is not None:
            settings = dict(setting.split("=", 1) for setting in self.args.setting)
            if self.args.engine_timeout is not None:
                settings["engine_timeout_s"] = self.args.engine_timeout
            cwd = self.args.server_cwd or ROOT
            process = server_process(
                self.models,
                self.args.threads,
                self.args.device,
                cwd=cwd,
                start_timeout_s=self.args.start_timeout,
                **settings,
            )
            url = self.stack.enter_context(process)
            self.url, self.api_pid, self.engine_pid = str(url), url.pid, None
        if self.api_pid is not None and self.engine_pid is None:
            self.engine_pid = engine_pid_of(self.api_pid)
        pids = [pid for pid in (self.api_pid, self.engine_pid) if pid is not None]
        self.monitor = Monitor(self.url, pids, self.args.poll_interval, self.args.health_timeout)
        warm_up(self.url)

    def ensure_serving(self) -> str | None:
        """Restart a server of ours that has exited; a note saying so, or None."""
        if self.models is None or (self.api_pid is not None and alive(self.api_pid)):
            return None
        self.restart()
        return "the server had exited: restarted"

    def restart(self) -> None:
        self.close()
        self.stack = ExitStack()
        self.start()

    def stop_process(self, pid: int) -> None:
        self.stopped.add(pid)
        os.kill(pid, signal.SIGSTOP)

    def continue_process(self, pid: int) -> None:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        self.stopped.discard(pid)

    def close(self) -> None:
        for pid in list(self.stopped):
            self.continue_process(pid)
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None
        engine = self.engine_pid
        try:
            self.stack.close()  # SIGTERM, then waits up to 60 s
        except subprocess.TimeoutExpired:
            if self.api_pid is not None:
                os.kill(self.api_pid, signal.SIGKILL)
        if self.models is not None and engine is not None and alive(engine):  # our server's engine, orphaned
            os.kill(engine, signal.SIGKILL)


def warm_up(url: str) -> None:
    with httpx.Client(base_url=url, timeout=120) as client:
        client.post("/v1/generate", json={"model": TEXT_LRNN, "prompt": "Hello", "max_tokens": 4})
        client.post("/v1/generate", json={"model": TEXT_GPT, "prompt": "Hello", "max_tokens": 4})
        client.post("/v1/transduce", json={"model": PARITY, "inputs": ["0110"]})


def settle(url: str, limit_s: float) -> float:
    """Seconds until /health answers 200 within 200 ms twice in a row (at most ``limit_s``)."""
    started = time.monotonic()
    fast = 0
    while time.monotonic() - started < limit_s and fast < 2:
        begun = time.monotonic()
        try:
            ok = httpx.get(f"{url}/health", timeout=2).status_code == 200 and time.monotonic() - begun < 0.2
        except httpx.HTTPError:
            ok = False
        fast = fast + 1 if ok else 0
        time.sleep(0.05)
    return time.monotonic() - started


# --- requests --------------------------------------------------------------------------------------------------


async def post(
    client: httpx.AsyncClient, path: str, timeout: float, body: dict | None = None, content: bytes | None = None
) -> Answer:
    """POST with an overall deadline; the status and the error message, or what went wrong."""
    started = time.perf_counter()
    try:
        request = client.post(path, json=body, content=content, headers=JSON_HEADERS if content else None)
        response = await asyncio.wait_for(request, timeout)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        return Answer(None, time.perf_counter() - started, "timeout")
    except httpx.HTTPError as error:
        return Answer(None, time.perf_counter() - started, type(error).__name__)
    answer = Answer(response.status_code, time.perf_counter() - started)
    if response.status_code != 200:
        try:
            answer.message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            answer.message = response.text[:200]
    return answer


def client_for(url: str, connections: int = 16) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120, connect=10), limits=limits)


def tally(answers: list[Answer]) -> str:
    counts = Counter(answer.label for answer in answers)
    return ", ".join(f"{label} x{count}" if count > 1 else label for label, count in sorted(counts.items()))


def short(message: str | None, length: int = 110) -> str:
    if not message:
        return ""
    message = message.replace("|", "/").replace("\n", " ")
    return message if len(message) <= length else message[: length - 3] + "..."


# --- measuring a scenario -----------------------------------------------------------------------------------


def measured(target: Target, scenario: str, case: str, run: Callable[[Row], None]) -> Row:
    """Run one case with the monitor's figures of its window: worst /health, RSS growth, and how long the server
    took to answer /health fast again afterwards."""
    row = Row(scenario, case)
    note = target.ensure_serving()
    if note:
        row.notes.append(note)
    pid = target.api_pid
    before = read_status(pid) if pid else {}
    start = time.monotonic()
    try:
        run(row)
    except Exception as error:
        row.notes.append(f"benchmark error: {type(error).__name__}: {short(str(error))}")
    end = max(time.monotonic(), start + 0.25)  # a refusal in a few ms: the polls just after it
    monitor = target.monitor
    if monitor is not None:
        monitor.wait_past(end)
        polls = monitor.polls(start, end)
        if polls:
            row.health_worst_ms = 1e3 * max(latency for _, latency, _, _ in polls)
            row.health_timeouts = sum(status == "timeout" for _, _, status, _ in polls)
            row.health_statuses = tally([Answer(int(s) if s.isdigit() else None, 0, s) for _, _, s, _ in polls])
            row.extra["health_polls"] = len(polls)
            row.extra["health_p50_ms"] = 1e3 * statistics.median(latency for _, latency, _, _ in polls)
            details = Counter(f"{status} {detail}" for _, _, status, detail in polls if status != "200")
            row.extra["health_other"] = dict(details.most_common(5))
    limit = target.args.settle
    busy = settle(target.url, limit) if target.url else 0.0
    if busy >= limit:
        row.notes.append(f"/health still slow {limit:g} s after")
    elif busy > 0.5:
        row.notes.append(f"/health slow for {busy:.1f} s after")
    row.extra["settle_s"] = busy
    if pid and before and alive(pid):
        after = read_status(pid)
        peak = monitor.rss_peak(pid, start, end) if monitor else None
        row.rss_peak_mib = (max(peak or 0, after["VmRSS"]) - before["VmRSS"]) / 1024
        row.rss_after_mib = (after["VmRSS"] - before["VmRSS"]) / 1024
        row.hwm_mib = (after["VmHWM"] - before["VmHWM"]) / 1024
        row.extra["rss_before_mib"] = before["VmRSS"] / 1024
    elif pid and not alive(pid):
        row.notes.append("the API process has exited")
    if busy >= limit and target.models is not None:  # the next case would measure this one's aftermath
        say("the server is still busy: restarting it")
        target.restart()
        row.notes.append("server restarted")
    return row


# --- 1. stop strings -------------------------------------------------------------------------------------------


def random_strings(count: int, rng: random.Random) -> list[str]:
    found: set[str] = set()
    while len(found) < count:
        found.add("".join(rng.choices(string.ascii_letters + string.digits, k=8)))
    return sorted(found)


def stop_body(stops: list[str]) -> dict:
    return {
        "model": TEXT_LRNN,
        "prompt": "Once upon a time",
        "n": 4,
        "max_tokens": 256,
        "temperature": 1.0,
        "seed": 1,
        "stop": stops,
    }


def limit_in(message: str | None, sent: int) -> int | None:
    """The limit a refusal names: the largest number in it below what was sent."""
    numbers = [int(text.replace(",", "").replace("_", "")) for text in re.findall(r"\d[\d,_]*", message or "")]
    numbers = [number for number in numbers if 1 < number < sent]
    return max(numbers) if numbers else None


def scenario_stop(target: Target, args: argparse.Namespace) -> list[Row]:
    """The limit first, from a refusal of the many strings with max_tokens 0 (which a server without the limit
    answers at once, generating nothing), then the most strings allowed, then the many strings for real (last:
    without the limit, the server stays busy with them long after the client has gone)."""
    rng = random.Random(0)
    many = random_strings(args.stops, rng)
    probe = run_async(one_request(target.url, "/v1/completions", {**stop_body(many), "max_tokens": 0}, args.cap))
    refused = probe.status is not None and 400 <= probe.status < 500 and "stop" in (probe.message or "")
    found = limit_in(probe.message, args.stops) if refused else None
    allowed = args.max_stop or found or 256
    source = "--max-stop" if args.max_stop else "from the refusal" if found else "default"

    def send(stops: list[str]) -> Callable[[Row], None]:
        def run(row: Row) -> None:
            answer = run_async(one_request(target.url, "/v1/completions", stop_body(stops), args.cap))
            row.got, row.answer_s = answer.label, answer.seconds
            if answer.message:
                row.notes.append(short(answer.message))

        return run

    return [
        measured(target, "stop", f"{allowed:,} stop strings ({source}), n=4, 256 tokens", send(many[:allowed])),
        measured(target, "stop", f"{args.stops:,} stop strings, n=4, 256 tokens", send(many)),
    ]


async def one_request(url: str, path: str, body: dict | None, timeout: float, content: bytes | None = None) -> Answer:
    async with client_for(url, 1) as client:
        return await post(client, path, timeout, body, content)


def run_async(awaitable):
    return asyncio.run(awaitable)


# --- 2. huge token-id bodies ---------------------------------------------------------------------------------


def token_id_bodies(args: argparse.Namespace) -> dict[str, Callable[[], bytes]]:
    head = b'{"model": "%s", "max_tokens": 1, ' % TEXT_LRNN.encode()

    def ids() -> bytes:
        return head + b'"prompt": [' + b"1," * (args.token_ids - 1) + b"1]}"

    def prompts() -> bytes:
        return head + b'"prompt": [' + b"[1]," * (args.one_token_prompts - 1) + b"[1]]}"

    def bias() -> bytes:
        keys = b",".join(b'"%d":1' % key for key in range(args.bias_keys))
        return head + b'"prompt": "Hello", "logit_bias": {' + keys + b"}}"

    return {
        f"{args.token_ids:,} token ids as prompt": ids,
        f"{args.one_token_prompts:,} one-token prompts": prompts,
        f"{args.bias_keys:,} logit_bias keys": bias,
    }


def scenario_token_ids(target: Target, args: argparse.Namespace) -> list[Row]:
    rows = []
    for case, build in token_id_bodies(args).items():
        content = build()

        def send(row: Row, content: bytes = content) -> None:
            answer = run_async(one_request(target.url, "/v1/completions", None, args.cap, content))
            row.got, row.answer_s = answer.label, answer.seconds
            row.extra["body_bytes"] = len(content)
            if answer.message:
                row.notes.append(short(answer.message))

        rows.append(measured(target, "token-ids", f"{case} ({len(content) / 1e6:.1f} MB)", send))
        del content
    return rows


# --- 3. stalled engine -----------------------------------------------------------------------------------------


def scenario_stall(target: Target, args: argparse.Namespace) -> list[Row]:
    def stall(row: Row) -> None:
        engine = target.engine_pid
        if engine is None or not alive(engine):
            row.notes.append("no engine process found (give --api-pid or --engine-pid; or the engine runs in process)")
            return
        run_async(stalled(target, engine, row, args))

    return [
        measured(
            target, "stall", f"SIGSTOP engine {args.stall_s:g} s at most; 1M-symbol transduce + 4 generates", stall
        )
    ]


async def stalled(target: Target, engine: int, row: Row, args: argparse.Namespace) -> None:
    monitor = target.monitor
    symbols = "".join(random.Random(0).choices("01", k=args.transduce_symbols))
    in_flight_timeout = args.stall_s + args.cap
    unavailable_at = served_at = late = None
    stopped_at = continued_at = time.monotonic()
    target.stop_process(engine)
    try:
        async with client_for(target.url, 8) as client:
            requests = [
                asyncio.ensure_future(
                    post(client, "/v1/transduce", in_flight_timeout, {"model": PARITY, "inputs": [symbols]})
                )
            ]
            await asyncio.sleep(0.2)
            for index in range(4):
                body = {"model": TEXT_LRNN, "prompt": f"Hello {index}", "max_tokens": 16, "temperature": 0}
                requests.append(asyncio.ensure_future(post(client, "/v1/generate", in_flight_timeout, body)))
            while time.monotonic() - stopped_at < args.stall_s:
                await asyncio.sleep(0.1)
                if unavailable_at is None and monitor is not None:
                    ends = [
                        start + latency
                        for start, latency, status, _ in monitor.polls(stopped_at, time.monotonic())
                        if status == "503"
                    ]
                    unavailable_at = min(ends) if ends else None
                    if unavailable_at is not None:  # a request sent now: refused at once?
                        body = {"model": TEXT_LRNN, "prompt": "Hello late", "max_tokens": 8, "temperature": 0}
                        late = asyncio.ensure_future(post(client, "/v1/generate", in_flight_timeout, body))
                        requests.append(late)
                if unavailable_at is not None and all(request.done() for request in requests):
                    break
            continued_at = time.monotonic()
            target.continue_process(engine)
            row.extra["stopped_s"] = continued_at - stopped_at
            done, _ = await asyncio.wait(requests, timeout=args.cap)
            answers = [request.result() for request in requests if request in done]
            pending = len(requests) - len(answers)
            row.got = "transduce " + requests[0].result().label if requests[0] in done else "transduce pending"
            row.got += "; generates " + (tally([r.result() for r in requests[1:5] if r in done]) or "-")
            if late is not None and late in done:
                row.got += f"; sent after the 503: {late.result().label} in {late.result().seconds:.2f} s"
            if pending:
                row.got += f"; {pending} unanswered"
            row.answer_s = max((answer.seconds for answer in answers), default=None)
            row.extra["in_flight"] = [asdict(answer) for answer in answers]
            messages = {short(answer.message, 70) for answer in answers if answer.message}
            row.notes += sorted(messages)
            # a new request, until one is served
            while time.monotonic() - continued_at < args.cap and served_at is None:
                body = {"model": TEXT_LRNN, "prompt": "Hello again", "max_tokens": 8, "temperature": 0}
                answer = await post(client, "/v1/generate", 10, body)
                if answer.status == 200:
                    served_at = time.monotonic()
                else:
                    await asyncio.sleep(0.2)
    finally:
        target.continue_process(engine)
    if unavailable_at is not None:
        detail = next(
            (
                d
                for start, latency, status, d in monitor.health
                if status == "503" and start + latency >= unavailable_at
            ),
            "",
        )
        row.notes.insert(0, f"/health 503 after {unavailable_at - stopped_at:.1f} s ({short(detail, 60)})")
    else:
        row.notes.insert(0, f"/health never 503 while stopped ({continued_at - stopped_at:.0f} s)")
    row.extra["health_503_after_s"] = None if unavailable_at is None else unavailable_at - stopped_at
    if monitor is not None:
        monitor.wait_past(time.monotonic())
        ends = [
            start + latency
            for start, latency, status, _ in monitor.health
            if status == "200" and start + latency > continued_at
        ]
        healthy = min(ends) - continued_at if ends else None
        row.extra["health_200_after_cont_s"] = healthy
        row.notes.insert(1, "/health 200 " + (f"{healthy:.1f} s after SIGCONT" if healthy is not None else "never"))
    row.extra["served_after_cont_s"] = None if served_at is None else served_at - continued_at
    row.notes.insert(
        2, "new request served " + (f"{served_at - continued_at:.1f} s after SIGCONT" if served_at else "never")
    )


# --- 4. body over the cap --------------------------------------------------------------------------------------


def urllib_post(url: str, content: bytes, timeout: float) -> Answer:
    """POST with urllib (which sends no Expect: 100-continue): the status and error body, or the failure."""
    request = urllib.request.Request(url, data=content, headers=JSON_HEADERS, method="POST")
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return Answer(response.status, time.perf_counter() - started)
    except urllib.error.HTTPError as error:
        answer = Answer(error.code, time.perf_counter() - started)
        try:
            answer.message = json.loads(error.read())["error"]["message"]
        except (ValueError, KeyError, TypeError, OSError) as failure:
            answer.message = f"body not read: {type(failure).__name__}"
        return answer
    except urllib.error.URLError as error:
        reason = error.reason
        label = "timeout" if isinstance(reason, TimeoutError) else f"{type(reason).__name__}"
        return Answer(None, time.perf_counter() - started, label, str(reason))
    except (OSError, http.client.HTTPException) as error:
        label = "timeout" if isinstance(error, TimeoutError) else type(error).__name__
        return Answer(None, time.perf_counter() - started, label, str(error))


def scenario_body_cap(target: Target, args: argparse.Namespace) -> list[Row]:
    rows = []
    transduce = b'{"model": "%s", "inputs": ["' % PARITY.encode() + b"01" * (10 * 2**20 // 1) + b'"]}'
    padded = b'{"model": "%s", "prompt": "Hello", "padding": "' % TEXT_LRNN.encode() + b"x" * (40 * 2**20) + b'"}'
    cases = {"20 MB transduce": ("/v1/transduce", transduce), "40 MB completions": ("/v1/completions", padded)}
    for case, (path, content) in cases.items():

        def send(row: Row, path: str = path, content: bytes = content) -> None:
            answer = urllib_post(target.url + path, content, args.cap)
            row.got, row.answer_s = answer.label, answer.seconds
            if answer.status is not None:
                row.notes.append(("413 JSON read: " if answer.status == 413 else "") + short(answer.message))
            else:
                row.notes.append(f"no response read: {short(answer.message, 80)}")

        rows.append(measured(target, "body-cap", f"{case} ({len(content) / 1e6:.0f} MB, urllib)", send))
    return rows


# --- 5. short requests beside a long prefill ------------------------------------------------------------------


def scenario_beside_long(target: Target, args: argparse.Namespace) -> list[Row]:
    def beside(row: Row) -> None:
        run_async(beside_long(target.url, row, args))

    return [measured(target, "beside-long", f"8-token {TEXT_GPT} beside a {args.prompt_words:,}-word prompt", beside)]


async def beside_long(url: str, row: Row, args: argparse.Namespace) -> None:
    def body(index: int) -> dict:
        return {"model": TEXT_GPT, "prompt": f"Hello {index}", "max_tokens": 8, "temperature": 0}

    async with client_for(url, 4) as client:
        alone = [await post(client, "/v1/generate", 30, body(index)) for index in range(args.short_requests + 1)][1:]
        words = args.prompt_words
        for _ in range(4):  # a prompt the model refuses as too long (413): what fits its context, or half
            prompt = {"model": TEXT_GPT, "prompt": FILLER * (words // 18 + 1), "max_tokens": 1}
            long = asyncio.ensure_future(post(client, "/v1/generate", args.cap, prompt))
            await asyncio.wait({long}, timeout=2.0)  # a refusal comes at once
            if long.done() and long.result().status == 413:
                message = long.result().message or ""
                row.notes.append(f"{words:,} words: 413 ({short(message, 130)})")
                sizes = re.search(r"prompt has (\d+) tokens.*at most (\d+) tokens", message)
                words = int(0.95 * words * int(sizes[2]) / int(sizes[1])) if sizes else words // 2
                continue
            break
        row.case = f"8-token {TEXT_GPT} beside a {words:,}-word prompt"  # the words it ran with
        beside: list[Answer] = []
        started = time.monotonic()
        while not long.done() and time.monotonic() - started < args.beside_s:
            beside.append(await post(client, "/v1/generate", 30, body(len(beside))))
        if not long.done():
            long.cancel()
            await asyncio.wait({long}, timeout=10)
            row.notes.append(f"long prompt still in flight after {args.beside_s:g} s: cancelled")
        long_answer = long.result() if long.done() and not long.cancelled() else None
    ok_alone = [answer.seconds for answer in alone if answer.status == 200]
    ok_beside = [answer.seconds for answer in beside if answer.status == 200]
    row.got = f"long {long_answer.label if long_answer else 'cancelled'}; short {tally(alone + beside)}"
    row.answer_s = long_answer.seconds if long_answer else None
    if ok_alone and ok_beside:
        ratio = statistics.median(ok_beside) / statistics.median(ok_alone)
        row.notes.insert(
            0,
            f"median alone {1e3 * statistics.median(ok_alone):.0f} ms, beside "
            f"{1e3 * statistics.median(ok_beside):.0f} ms (max {1e3 * max(ok_beside):.0f}, "
            f"{len(ok_beside)} requests): {ratio:.1f}x (target <= 3x)",
        )
        row.extra["ratio"] = ratio
    row.extra.update(words=words, alone_s=ok_alone, beside_s=ok_beside)


# --- 6. burst ----------------------------------------------------------------------------------------------------


async def raw_request(
    host: str, port: int, request: bytes, timeout: float, barrier: Barrier
) -> tuple[int | str, float]:
    """One request on a connection of its own (opened first); the status and seconds from the request's write to
    its status line."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
    except (OSError, asyncio.TimeoutError) as error:
        barrier.arrive()
        return f"connect {type(error).__name__}", 0.0
    try:
        await barrier.wait()
        started = time.perf_counter()
        writer.write(request)
        line = await asyncio.wait_for(reader.readline(), timeout)
        seconds = time.perf_counter() - started
        status: int | str = int(line.split()[1]) if line.startswith(b"HTTP/") else "no status"
        await asyncio.wait_for(reader.read(), timeout)
        return status, seconds
    except asyncio.TimeoutError:
        return "timeout", timeout
    except OSError as error:
        return type(error).__name__, 0.0
    finally:
        writer.close()


class Barrier:
    """Every connection opened, then every request written at once."""

    def __init__(self, parties: int) -> None:
        self.parties, self.arrived, self.event = parties, 0, asyncio.Event()

    def arrive(self) -> None:
        self.arrived += 1
        if self.arrived >= self.parties:
            self.event.set()

    async def wait(self) -> None:
        self.arrive()
        await asyncio.wait_for(self.event.wait(), 30)


def scenario_burst(target: Target, args: argparse.Namespace) -> list[Row]:
    h2load = shutil.which("h2load") if args.burst_client != "python" else None
    if args.burst_client == "h2load" and h2load is None:
        raise SystemExit("--burst-client h2load: h2load is not on PATH (Debian/Ubuntu: apt-get install nghttp2-client)")
    client = "h2load" if h2load else "python"

    def burst(row: Row) -> None:
        row.notes.append(f"client: {client}")
        cpu = cpu_seconds(target.api_pid) if target.api_pid else None
        results = h2load_burst(h2load, target.url, args) if h2load else run_async(burst_requests(target.url, args))
        if cpu is not None and target.api_pid and alive(target.api_pid):
            time.sleep(1.0)  # the admitted requests' answers end within it (16 tokens each)
            row.notes.append(f"API process CPU {1e3 * (cpu_seconds(target.api_pid) - cpu):.0f} ms")
        statuses = Counter(status for status, _ in results)
        row.got = ", ".join(f"{status} x{count}" for status, count in sorted(statuses.items(), key=str))
        row.answer_s = max(seconds for _, seconds in results)
        refused = [seconds for status, seconds in results if status == 429]
        served = [seconds for status, seconds in results if status == 200]
        if refused:
            row.notes.append(
                f"429s: p50 {1e3 * percentile(refused, 50):.0f} ms, max {1e3 * max(refused):.0f} ms "
                "from sending (target <= 100 ms)"
            )
        if served:
            row.notes.append(f"200s: p50 {percentile(served, 50):.1f} s, max {max(served):.1f} s")
        row.extra.update(refused_s=refused, served_s=served, statuses={str(k): v for k, v in statuses.items()})

    case = f"{args.burst} generates at once, 16 tokens, own connections"
    return [
        measured(target, "burst", case if args.bursts == 1 else f"{case}, burst {index + 1}", burst)
        for index in range(args.bursts)
    ]


def h2load_burst(h2load: str, url: str, args: argparse.Namespace) -> list[tuple[int | str, float]]:
    """The burst from ``h2load --h1``: ``args.burst`` connections, one request each, sent as each connects (the same
    body for all); the status and seconds from the request's write to the response's last byte, from its log."""
    with tempfile.TemporaryDirectory() as folder:
        body, log = Path(folder) / "body.json", Path(folder) / "requests.log"
        body.write_text(json.dumps({"model": TEXT_LRNN, "prompt": "Hello", "max_tokens": 16}))
        command = [h2load, "--h1", "-c", str(args.burst), "-n", str(args.burst), "-d", str(body)]
        command += ["-H", "Content-Type: application/json", f"--log-file={log}", f"{url}/v1/generate"]
        with suppress(subprocess.TimeoutExpired):  # what it logged by then counts; the rest: "timeout"
            subprocess.run(command, capture_output=True, timeout=args.cap + 40, check=False)
        lines = log.read_text().splitlines() if log.exists() else []
    results: list[tuple[int | str, float]] = []
    for line in lines:  # start (us since the epoch), status, microseconds to the end of the response
        _, status, micros = line.split("\t")
        results.append((int(status) if int(status) > 0 else "error", int(micros) / 1e6))
    return results + [("timeout", float(args.cap))] * (args.burst - len(results))


async def burst_requests(url: str, args: argparse.Namespace) -> list[tuple[int | str, float]]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    barrier = Barrier(args.burst)
    requests = []
    for index in range(args.burst):
        body = json.dumps({"model": TEXT_LRNN, "prompt": f"Hello {index}", "max_tokens": 16}).encode()
        head = (
            f"POST /v1/generate HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        requests.append(head.encode() + body)
    tasks = [asyncio.ensure_future(raw_request(host, port, request, args.cap, barrier)) for request in requests]
    done, pending = await asyncio.wait(tasks, timeout=args.cap + 40)
    for task in pending:
        task.cancel()
    return [task.result() if task in done and not task.exception() else ("timeout", float(args.cap)) for task in tasks]


# --- table -------------------------------------------------------------------------------------------------------


def format_row(row: Row) -> str:
    def number(value: float | None, spec: str) -> str:
        if value is None:
            return "-"
        text = format(value, spec)
        if text.startswith("-") and not any(digit in text for digit in "123456789"):  # "-0": +0
            text = ("+" if "+" in spec else "") + text[1:]
        return text

    health = number(row.health_worst_ms, ",.0f")
    if row.health_timeouts:
        health = f"**{health} ({row.health_timeouts} timeout{'s' if row.health_timeouts > 1 else ''})**"
    rss = f"{number(row.rss_peak_mib, '+,.0f')} / {number(row.rss_after_mib, '+,.0f')} / {number(row.hwm_mib, '+,.0f')}"
    return (
        f"| {row.scenario} | {row.case} | {row.got} | {number(row.answer_s, ',.2f')} | {health} | "
        f"{row.health_statuses} | {rss} | {'; '.join(row.notes)} |"
    )


HEADER = (
    "| scenario | case | client got | time to answer (s) | worst /health (ms) | /health statuses | "
    "API RSS peak / after / VmHWM (MiB) | notes |\n|---|---|---|---:|---:|---|---:|---|"
)


def say(text: str) -> None:
    """Progress, on stderr."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", help=f"scenarios, comma-separated: {', '.join(SCENARIOS)}")
    parser.add_argument("--url", help="a running server to test instead of starting one")
    parser.add_argument("--api-pid", type=int, help="with --url: the API process (RSS, and its child the engine)")
    parser.add_argument("--engine-pid", type=int, help="with --url: the engine process to stop in 'stall'")
    parser.add_argument("--engine-timeout", type=float, help="REGULARLM_ENGINE_TIMEOUT_S of the started server")
    parser.add_argument(
        "--server-cwd",
        type=Path,
        help="run python -m server from this checkout (e.g. a git archive of main) instead of this one",
    )
    parser.add_argument("--start-timeout", type=float, default=600, help="seconds the started server may take")
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        help="NAME=VALUE: a REGULARLM_* setting of the started server, e.g. max_job_seconds=1800",
    )
    parser.add_argument("--json", type=Path, help="write the rows here as JSON")
    parser.add_argument("--cap", type=float, default=60.0, help="seconds a scenario's requests may take")
    parser.add_argument(
        "--settle",
        type=float,
        default=180.0,
        help="after each case, the longest to wait for "
        "/health to be fast again; then a server this benchmark started is restarted",
    )
    parser.add_argument("--health-timeout", type=float, default=2.0, help="timeout of each /health poll (s)")
    parser.add_argument("--poll-interval", type=float, default=0.05, help="seconds between /health polls")
    parser.add_argument("--stops", type=int, default=100_000, help="stop strings of the 'stop' scenario")
    parser.add_argument(
        "--max-stop", type=int, help="stop strings the server allows (default: from its refusal, else 256)"
    )
    parser.add_argument("--token-ids", type=int, default=8_000_000)
    parser.add_argument("--one-token-prompts", type=int, default=2_000_000)
    parser.add_argument("--bias-keys", type=int, default=1_000_000)
    parser.add_argument("--stall-s", type=float, default=20.0, help="the longest the engine is kept stopped")
    parser.add_argument("--transduce-symbols", type=int, default=1_000_000)
    parser.add_argument("--prompt-words", type=int, default=50_000)
    parser.add_argument("--short-requests", type=int, default=10, help="8-token requests alone (beside-long)")
    parser.add_argument("--beside-s", type=float, default=30.0, help="the longest shorts are sent beside the prefill")
    parser.add_argument("--burst", type=int, default=500)
    parser.add_argument("--bursts", type=int, default=1, help="bursts sent in turn to the same server, a row each")
    parser.add_argument(
        "--burst-client",
        choices=["auto", "h2load", "python"],
        default="auto",
        help="what sends the burst: h2load (nghttp2-client), this process (asyncio, all written at once after every "
        "connection opened), or h2load where it is on PATH (auto)",
    )
    add_server_arguments(parser)
    args = parser.parse_args()
    chosen = [name for option in args.only or [",".join(SCENARIOS)] for name in option.split(",") if name]
    unknown = sorted(set(chosen) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenario {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    if args.burst < 1 or args.bursts < 1:
        parser.error(f"--burst and --bursts must be at least 1 (got {args.burst} and {args.bursts})")
    if args.engine_timeout is not None and not args.url:
        args.stall_s = max(args.stall_s, args.engine_timeout + 10)
    runners = {
        "stop": scenario_stop,
        "token-ids": scenario_token_ids,
        "stall": scenario_stall,
        "body-cap": scenario_body_cap,
        "beside-long": scenario_beside_long,
        "burst": scenario_burst,
    }

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    timeout = f"; engine timeout {args.engine_timeout:g} s" if args.engine_timeout is not None else ""
    print(f"# {machine(args.device)}, load {os.getloadavg()[0]:.1f}; server torch threads {args.threads}{timeout}")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as folder:
        models = None
        if not args.url:
            models = Path(folder)
            for model_id in MODELS:
                (models / model_id).symlink_to(SHIPPED_CHECKPOINTS / model_id)
        target = Target(args, models)
        try:
            started = time.monotonic()
            target.start()
            say(
                f"server up and warm in {time.monotonic() - started:.0f} s: {target.url} (API process "
                f"{target.api_pid}, engine process {target.engine_pid})"
            )
            print(HEADER, flush=True)
            for name in SCENARIOS:
                if name not in chosen:
                    continue
                say(f"{name} ...")
                for row in runners[name](target, args):
                    rows.append(row)
                    print(format_row(row), flush=True)
        finally:
            target.close()
    if args.json:
        report = {
            "machine": machine(args.device),
            "args": {k: str(v) for k, v in vars(args).items()},
            "rows": [asdict(row) for row in rows],
        }
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
