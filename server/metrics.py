"""Prometheus metrics with vLLM's names, definitions and buckets, prefixed ``regularlm_`` (Prometheus reserves ':' for
recording rules).

Definitions: queue time = arrival -> first scheduled; TTFT = arrival -> first token; ITL = the gap between consecutive
tokens; TPOT = (last token - first token) / (tokens - 1); E2E = arrival -> finished; model execute time = one engine
call of a model. A model's counters and gauges exist at 0 from its load, its histograms from their first observation.
Each app has its own registry; the engine process's updates are recorded (:class:`RecordingMetrics`) and replayed into
it.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "regularlm_"
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
# From 1 ms, lower than vLLM's: small models on a CPU decode a token in about a millisecond.
TOKEN_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
MODEL = ("model_name",)
FINISH_REASONS = ("stop", "length", "abort", "error")  # how a request can end (``ServerMetrics.finished``)


@dataclass
class RequestTimes:
    """One request's timestamps (``time.monotonic()``), filled in by the engine as it goes."""

    model: str
    arrival: float = field(default_factory=time.monotonic)
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    generated: int = 0


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

        # the collectors labelled by model alone: those whose series exist from load, and the histograms
        self._from_load: list[Counter | Gauge] = []
        self._histograms: list[Histogram] = []

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            self._histograms.append(Histogram(PREFIX + name, doc, MODEL, registry=self.registry, buckets=buckets))
            return self._histograms[-1]

        def counter(name: str, doc: str) -> Counter:
            made = Counter(PREFIX + name, doc, MODEL, registry=self.registry)
            self._from_load.append(made)
            return made

        def gauge(name: str, doc: str) -> Gauge:
            made = Gauge(PREFIX + name, doc, MODEL, registry=self.registry)
            self._from_load.append(made)
            return made

        self.e2e_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish, seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled, seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first token, seconds.", TTFT_BUCKETS
        )
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "Mean gap between a request's tokens, seconds.", TOKEN_LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Gap between consecutive generated tokens, seconds.", TOKEN_LATENCY_BUCKETS
        )
        self.model_execute_time = histogram(
            "model_execute_time_seconds",
            "Engine calls of a model (a prefill, decode step or transduce batch with its sampling), seconds.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled or scored.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.transduced_symbols = counter("transduced_symbols", "Input symbols transduced.")
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests.", (*MODEL, "finished_reason"), registry=self.registry
        )
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the state cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the state cache.")
        self.requests_running = gauge("num_requests_running", "Requests being computed.")
        self.requests_waiting = gauge("num_requests_waiting", "Requests queued, not yet scheduled.")
        # attribute name -> collector: what a recorded figure names (``RecordingMetrics``, ``replay``)
        self.collectors = {
            name: value for name, value in vars(self).items() if isinstance(value, (Counter, Gauge, Histogram))
        }

    def child(self, collector: Histogram | Counter | Gauge, *labels: str) -> Any:
        """``collector.labels(*labels)``, remembered."""
        key = (id(collector), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = collector.labels(*labels)
        return found

    def register_models(self, model_ids: list[str]) -> None:
        """Create the models' counters and gauges at 0 (each finish reason of ``request_success`` too); not their
        histograms."""
        for collector in self._from_load:
            for model in model_ids:
                collector.labels(model)
        for model in model_ids:
            for reason in FINISH_REASONS:
                self.request_success.labels(model, reason)

    def unregister_model(self, model_id: str) -> None:
        """Drop every series of a model that is no longer served."""
        for collector in [*self._from_load, *self._histograms]:
            with contextlib.suppress(KeyError):  # a histogram the model never observed
                collector.remove(model_id)
        for reason in FINISH_REASONS:
            with contextlib.suppress(KeyError):
                self.request_success.remove(model_id, reason)
        for key in [key for key in self._children if key[1][:1] == (model_id,)]:
            del self._children[key]

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def queued(self, requests: list[RequestTimes]) -> None:
        """The requests were admitted."""
        for times in requests:
            self.child(self.requests_waiting, times.model).inc()

    def scheduled(self, times: RequestTimes) -> None:
        times.scheduled = time.monotonic()
        self.child(self.queue_time, times.model).observe(times.scheduled - times.arrival)
        self.child(self.requests_waiting, times.model).dec()
        self.child(self.requests_running, times.model).inc()

    def tokens(self, model: str, requests: list[RequestTimes]) -> None:
        """One generated token for each of the requests, all of ``model`` and at one time."""
        now = time.monotonic()
        gaps: dict[float, int] = {}
        for times in requests:
            if times.first_token is None:
                times.first_token = now
                self.child(self.time_to_first_token, model).observe(now - times.arrival)
            else:
                assert times.last_token is not None  # set with first_token
                gap = now - times.last_token
                gaps[gap] = gaps.get(gap, 0) + 1
            times.last_token = now
            times.generated += 1
        latency = self.child(self.inter_token_latency, model)
        for gap, count in gaps.items():
            self.observe_many(latency, gap, count)
        self.child(self.generation_tokens, model).inc(len(requests))

    def model_executed(self, model: str, seconds: float) -> None:
        self.child(self.model_execute_time, model).observe(seconds)

    def finished(self, times: RequestTimes, reason: str) -> None:
        """Called once per request that was admitted, however it ended (``reason``: stop, length, abort, error)."""
        if times.scheduled is None:
            self.child(self.requests_waiting, times.model).dec()
        else:
            self.child(self.requests_running, times.model).dec()
        end = time.monotonic()
        self.child(self.e2e_latency, times.model).observe(end - times.arrival)
        if times.generated > 1:
            assert times.first_token is not None and times.last_token is not None  # set by tokens()
            tpot = (times.last_token - times.first_token) / (times.generated - 1)
            self.child(self.time_per_output_token, times.model).observe(tpot)
        self.child(self.request_success, times.model, reason).inc()

    def observe_many(self, histogram: Any, value: float, count: int) -> None:
        observe_many(histogram, value, count)

    def replay(self, figures: list[Figure]) -> None:
        """Apply the figures a :class:`RecordingMetrics` recorded."""
        for name, labels, operation, value, count in figures:
            child = self.child(self.collectors[name], *labels)
            if operation == "observe":
                observe_many(child, value, count)
            elif operation == "inc":
                child.inc(value)
            else:
                child.dec(value)


# One recorded metric update: (collector attribute, labels, "inc" | "dec" | "observe", value, count of observations)
Figure = tuple[str, tuple[str, ...], str, float, int]


class RecordingMetrics(ServerMetrics):
    """The engine process's metrics: each update recorded as a :data:`Figure` until ``take``; registering models is the
    API process's."""

    def __init__(self) -> None:
        super().__init__()
        self.names = {id(collector): name for name, collector in self.collectors.items()}
        self.figures: list[Figure] = []

    def child(self, collector: Histogram | Counter | Gauge, *labels: str) -> Any:
        key = (id(collector), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = _RecordedChild(self.figures, self.names[id(collector)], labels)
        return found

    def observe_many(self, histogram: Any, value: float, count: int) -> None:
        histogram.observe(value, count)

    def register_models(self, model_ids: list[str]) -> None:
        pass

    def unregister_model(self, model_id: str) -> None:
        pass

    def take(self) -> list[Figure]:
        """The figures recorded since the last call (worker thread)."""
        figures, self.figures[:] = list(self.figures), []
        return figures


class _RecordedChild:
    def __init__(self, figures: list[Figure], name: str, labels: tuple[str, ...]) -> None:
        self.figures, self.name, self.labels = figures, name, labels

    def inc(self, amount: float = 1.0) -> None:
        self.figures.append((self.name, self.labels, "inc", amount, 1))

    def dec(self, amount: float = 1.0) -> None:
        self.figures.append((self.name, self.labels, "dec", amount, 1))

    def observe(self, value: float, count: int = 1) -> None:
        self.figures.append((self.name, self.labels, "observe", value, count))


def observe_many(histogram: Any, value: float, count: int) -> None:
    """``count`` observations of ``value`` in a labelled histogram child at the cost of one (through prometheus_client's
    private fields; tests/server/test_metrics.py checks it against ``observe``)."""
    histogram._raise_if_not_observable()
    histogram._sum.inc(value * count)
    histogram._buckets[bisect.bisect_left(histogram._upper_bounds, value)].inc(count)
