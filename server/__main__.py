"""``python -m server [--host H] [--port P] [--models DIR [DIR ...]] [--no-shipped-models] [--device auto|cpu|cuda]``

Serves the shipped checkpoints and those under each DIR; other options come from REGULARLM_* variables
(``server/settings.py``). On SIGTERM or Ctrl-C it drains (/health 503) for at most ``drain_timeout_s``, answers what is
left 503 and exits 0 within ``drain_timeout_s`` + 5 s. Exit codes: 2 on bad options or when no model loads, 3 when the
engine process died.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from pathlib import Path
from types import FrameType

import uvicorn
from pydantic import ValidationError

from server.api.app import create_app, http_protocol
from server.engine.client import EngineClient
from server.engine.engine import Engine, EngineFront
from server.heap import freeze_startup_heap, tune_garbage_collector
from server.metrics import ServerMetrics
from server.settings import Settings

logger = logging.getLogger("server")
EXIT_NO_MODEL = 2
EXIT_ENGINE_DIED = 3
ANSWER_WAIT_S = 1.0  # past the drain timeout: how long the 503 answers get to reach their clients
CLOSE_WAIT_S = 2  # then: uvicorn's graceful shutdown of open connections (whole seconds)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain phase: the first SIGTERM/SIGINT marks the engine draining (/health 503, new
    requests 503) with the socket open until nothing is in flight or ``drain_timeout_s`` passes; then uvicorn shuts
    down. A second signal skips the wait, a third forces the exit."""

    def __init__(self, config: uvicorn.Config, engine: EngineFront, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.engine, self.drain_timeout_s = engine, drain_timeout_s
        self.draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.draining:
            self.force_exit = self.should_exit
            self.should_exit = True
            return
        self.draining = True
        self.engine.begin_drain()
        threading.Thread(target=self._exit_when_idle, name="regularlm-drain", daemon=True).start()

    def _exit_when_idle(self) -> None:
        self._wait_idle(self.drain_timeout_s)
        if self.engine.in_flight:
            logging.getLogger(__name__).warning(
                "drain_timeout_s (%g s) ran out with %d requests in flight: answering them 503",
                self.drain_timeout_s,
                self.engine.in_flight,
            )
            self.engine.abort_in_flight(
                f"the server is shutting down: its drain timeout ({self.drain_timeout_s:g} s) ran out"
            )
            self._wait_idle(ANSWER_WAIT_S)
        self.should_exit = True

    def _wait_idle(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.engine.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)

    def announce_when_ready(self) -> None:
        """Log "ready on http://HOST:PORT" once the socket listens and the engine serves (on a thread of its own)."""
        self.engine.wait_loaded()
        while not self.started and not self.should_exit:
            time.sleep(0.05)
        if self.engine.state == "ready" and self.started and not self.should_exit:
            logger.info("ready on %s", self.url())

    def url(self) -> str:
        host, port = self.config.host, self.config.port
        for listening in self.servers:  # the port bound (port 0: one the system chose)
            for sock in listening.sockets or ():
                port = sock.getsockname()[1]
                break
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class UvicornLines(logging.Filter):
    """Moves uvicorn's lifespan lines to DEBUG ("Uvicorn running on ..." comes before the models are ready; "ready on
    ..." says when requests are served) and names its logger "uvicorn"."""

    AT_DEBUG = (
        "Started server process",
        "Waiting for application",
        "Application startup complete",
        "Application shutdown complete",
        "Uvicorn running on",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        record.name = "uvicorn"
        if record.levelno == logging.INFO and str(record.msg).startswith(self.AT_DEBUG):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


def parse_settings(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(
        prog="python -m server",
        description="Serve regularlm checkpoints over HTTP: the shipped checkpoints/ and, beside them, those of "
        "--models. Every option is also a REGULARLM_* environment variable (server/settings.py); the command line "
        "wins.",
    )
    parser.add_argument("--host", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default 8000)")
    parser.add_argument(
        "--models",
        nargs="+",
        action="extend",
        type=Path,
        metavar="DIR",
        help="folders of checkpoint folders (or checkpoint folders) to serve beside the shipped checkpoints/ "
        "(REGULARLM_MODELS)",
    )
    parser.add_argument(
        "--no-shipped-models",
        action="store_true",
        help="serve only the --models folders, not the shipped checkpoints/ (REGULARLM_SHIPPED_MODELS=false)",
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], help="where the models run (default auto)")
    parser.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument(
        "--enforce-eager", action="store_true", help="decode without CUDA graphs (REGULARLM_CUDA_GRAPHS=false)"
    )
    parser.add_argument(
        "--engine-in-process",
        action="store_true",
        help="run the engine core on a thread of this process, not in a child (REGULARLM_ENGINE_PROCESS=false)",
    )
    parser.add_argument(
        "--access-log", action="store_true", help="log a line per request (uvicorn's; REGULARLM_ACCESS_LOG=true)"
    )
    args = parser.parse_args(argv)
    flags = ("enforce_eager", "engine_in_process", "access_log", "no_shipped_models")
    overrides = {name: value for name, value in vars(args).items() if value is not None and name not in flags}
    if args.enforce_eager:
        overrides["cuda_graphs"] = False
    if args.engine_in_process:
        overrides["engine_process"] = False
    if args.access_log:
        overrides["access_log"] = True
    if args.no_shipped_models:
        overrides["shipped_models"] = False
    try:
        return Settings(**overrides)
    except ValidationError as error:
        parser.error(str(error))


def main(argv: list[str] | None = None) -> int:
    settings = parse_settings(argv)
    tune_garbage_collector()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server: DrainingServer | None = None
    died: list[str] = []

    def stop_serving(message: str) -> None:
        if server is not None:
            server.should_exit = True

    def engine_died(message: str) -> None:
        died.append(message)
        threading.Timer(ANSWER_WAIT_S, stop_serving, (message,)).start()  # the 503 answers leave first

    engine: EngineFront
    if settings.engine_process is False:
        engine = Engine(
            settings, ServerMetrics(), on_load_failed=stop_serving, on_ready=freeze_startup_heap, on_died=engine_died
        )
    else:
        engine = EngineClient(
            settings,
            ServerMetrics(),
            on_load_failed=stop_serving,
            on_ready=freeze_startup_heap,
            on_engine_died=engine_died,
        )
    app = create_app(settings, engine)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,  # uvicorn's lines in the server's format (logging.basicConfig above)
        access_log=settings.access_log,
        timeout_graceful_shutdown=CLOSE_WAIT_S,
        # longer than clients keep idle connections
        timeout_keep_alive=settings.keep_alive_s,  # type: ignore[arg-type]  # uvicorn types it int; a float works
        http=http_protocol(app),  # httptools, or h11 without it
    )
    logging.getLogger("uvicorn.error").addFilter(UvicornLines())
    server = DrainingServer(config, engine, settings.drain_timeout_s)
    threading.Thread(target=server.announce_when_ready, name="regularlm-announce", daemon=True).start()
    server.run()
    if died:
        engine.stop()
        print(f"error: {died[0]}", file=sys.stderr)
        return EXIT_ENGINE_DIED
    if engine.state == "failed":
        print(f"error: {engine.detail}", file=sys.stderr)
        return EXIT_NO_MODEL
    if not engine.stop():  # the lifespan stopped it already, unless a model call still runs
        # a model call still runs on the worker thread: interpreter shutdown under it would abort (exit 134)
        logging.getLogger(__name__).warning("the engine's worker is still in a model call; exiting without it")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
