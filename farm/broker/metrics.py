"""Prometheus metrics of a broker, served over HTTP on an opt-in port (``--metrics-port``).

Names and labels follow Prometheus' conventions: a ``farm_`` prefix, base
units (seconds), ``_total`` on counters, and ``worker``/``device``/``host``
labels on per-worker series.  The PooledPredictor callbacks of fb-caffe-exts
(github.com/facebookarchive/fb-caffe-exts) map onto them: ``onJobEnqueued(queueSize, delay)`` is
``farm_chunks_waiting``
and ``farm_chunk_queue_seconds``, ``onJobDequeued`` is
``farm_worker_chunks_in_flight``, and ``onJobProcessed(time)`` is
``farm_chunk_compute_seconds`` with the per-worker ``_total`` counters.

The broker loop updates counters and histograms as events happen; gauges are
read at scrape time through the callable the broker gives (``FarmState.counts``:
single reads of the loop's dicts, atomic under the GIL) and the broker's clock.
Series of a worker that leaves are removed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import start_http_server

from farm.summary import network_seconds

if TYPE_CHECKING:
    from farm.broker.registry import WorkerEntry
    from farm.broker.state import FarmCounts

#: Latency buckets, in seconds: 0.5 ms to 30 s.
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
WORKER_LABELS = ("worker", "device", "host")
JOB_STATES = ("queued", "running")


class BrokerMetrics:
    """The broker's metrics in a registry of their own; ``serve`` starts the HTTP endpoint."""

    def __init__(
        self,
        clock: Callable[[], float],
        counts: Callable[[], FarmCounts],
        traffic: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """``clock``: the broker's; ``counts``: the farm's numbers now, ``traffic`` its
        socket's (``Traffic.describe``; both read at scrape time, from the HTTP server's
        thread)."""
        disable_created_metrics()  # no *_created series: they double the output, say little
        self.clock = clock
        self.registry = CollectorRegistry()
        per_worker: dict[str, Any] = {"labelnames": WORKER_LABELS, "registry": self.registry}
        self.images = Counter("farm_worker_images", "Images computed by the worker.", **per_worker)
        self.chunks = Counter("farm_worker_chunks", "Chunks computed by the worker.", **per_worker)
        self.compute = Counter(
            "farm_worker_compute_seconds",
            "Seconds the worker spent computing chunks.",
            **per_worker,
        )
        self.failures = Counter(
            "farm_worker_chunk_failures",
            "Chunk attempts that failed on the worker (or were lost with it).",
            **per_worker,
        )
        self.queue_latency = self.latency(
            "farm_chunk_queue_seconds",
            "Seconds from a chunk's assignment to the start of its "
            "compute (input fetched from the client, queued on the worker).",
        )
        self.transfer_latency = self.latency(
            "farm_chunk_transfer_seconds",
            "Seconds a chunk spent on the network between broker and worker, both ways.",
        )
        self.compute_latency = self.latency(
            "farm_chunk_compute_seconds", "Seconds of compute per chunk."
        )
        self.images_delivered = Counter(
            "farm_images_delivered",
            "Images whose outputs went back to clients.",
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "farm_worker_chunks_in_flight",
            "Chunks assigned to the worker and not yet answered.",
            **per_worker,
        )
        self.heartbeat_age = Gauge(
            "farm_worker_heartbeat_age_seconds",
            "Seconds since the broker last heard from the worker.",
            **per_worker,
        )
        self.quarantined, self.strikes = self.trust_gauges(per_worker)
        self.registry.register(_LiveCollector(counts, traffic))
        self.server: Any = None

    @staticmethod
    def trust_gauges(per_worker: dict[str, Any]) -> tuple[Gauge, Gauge]:
        """Per worker: quarantined (0/1), and its answers that failed the checks."""
        quarantined = Gauge(
            "farm_worker_quarantined",
            "1 while the worker is quarantined (its answers failed the broker's checks: it "
            "gets no more tasks), else 0.",
            **per_worker,
        )
        strikes = Gauge(
            "farm_worker_strikes",
            "Answers of the worker that failed the broker's checks.",
            **per_worker,
        )
        return quarantined, strikes

    def latency(self, name: str, documentation: str) -> Histogram:
        """A histogram of seconds, in ``LATENCY_BUCKETS``, in this registry."""
        return Histogram(name, documentation, buckets=LATENCY_BUCKETS, registry=self.registry)

    def serve(self, host: str, port: int) -> str:
        """Start the HTTP endpoint (port 0: a free one); return its URL."""
        self.server, _ = start_http_server(port, host, registry=self.registry)
        return f"http://{host}:{self.server.server_port}/metrics"

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    # ------------------------------------------------------------ events

    def worker_joined(self, entry: WorkerEntry) -> None:
        labels = labels_of(entry)
        self.in_flight.labels(*labels).set_function(lambda: len(entry.in_flight))
        self.heartbeat_age.labels(*labels).set_function(lambda: self.clock() - entry.last_seen)
        self.quarantined.labels(*labels).set_function(lambda: float(entry.quarantined is not None))
        self.strikes.labels(*labels).set_function(lambda: entry.strikes)
        for counter in (self.images, self.chunks, self.compute, self.failures):
            counter.labels(*labels)  # present at 0 from the start

    def worker_left(self, entry: WorkerEntry) -> None:
        labels = labels_of(entry)
        for metric in (
            self.images,
            self.chunks,
            self.compute,
            self.failures,
            self.in_flight,
            self.heartbeat_age,
            self.quarantined,
            self.strikes,
        ):
            try:
                metric.remove(*labels)
            except KeyError:
                pass

    def chunk_done(
        self,
        entry: WorkerEntry,
        items: int,
        compute: float,
        timings: dict[str, float],
        queued_s: float,
        round_trip_s: float,
    ) -> None:
        """``compute``: the seconds the broker credited (``results.credited_compute``: the
        worker's shares and speeds count the same); ``timings``: what the worker reported;
        ``queued_s``: assignment to TASK sent; ``round_trip_s``: TASK sent to RESULT back."""
        labels = labels_of(entry)
        queued = queued_s + float(timings.get("receive", 0.0))
        transfer = network_seconds(round_trip_s, timings)
        self.images.labels(*labels).inc(items)
        self.chunks.labels(*labels).inc()
        self.compute.labels(*labels).inc(compute)
        self.compute_latency.observe(compute)
        self.queue_latency.observe(max(0.0, queued))
        self.transfer_latency.observe(max(0.0, transfer))
        self.images_delivered.inc(items)

    def chunk_failed(self, entry: WorkerEntry) -> None:
        self.failures.labels(*labels_of(entry)).inc()


def labels_of(entry: WorkerEntry) -> tuple[str, str, str]:
    return entry.name, entry.device, entry.host


class _LiveCollector:
    """Series read from the farm's numbers at scrape time: jobs by state, workers, and
    every counter of ``FarmStats`` (recoveries and refusals alike) as
    ``farm_broker_events_total{event=...}``."""

    def __init__(
        self, counts: Callable[[], FarmCounts], traffic: Callable[[], dict[str, Any]] | None
    ) -> None:
        self.counts, self.traffic = counts, traffic

    def collect(self) -> Iterator[Any]:
        counts = self.counts()
        by_state = GaugeMetricFamily(
            "farm_jobs", "Jobs the broker holds, by state.", labels=["state"]
        )
        for state in JOB_STATES:
            by_state.add_metric([state], counts.jobs.get(state, 0))
        yield by_state
        yield GaugeMetricFamily(
            "farm_workers", "Workers registered with the broker.", value=counts.workers
        )
        yield GaugeMetricFamily(
            "farm_chunks_waiting",
            "Chunks assigned whose input the broker is still fetching from the client.",
            value=counts.chunks_waiting,
        )
        ended = CounterMetricFamily(
            "farm_jobs_ended", "Jobs that ended, by outcome.", labels=["outcome"]
        )
        for outcome, count in counts.outcomes.items():
            ended.add_metric([outcome], count)
        yield ended
        events = CounterMetricFamily(
            "farm_broker_events",
            "Failures the broker saw and recovered from, and what it refused to trust "
            "(refused messages and fetches, bad answers, quarantined workers, parked jobs), "
            "by kind.",
            labels=["event"],
        )
        for name, value in counts.stats.items():
            events.add_metric([name], value)
        yield events
        if self.traffic is not None:
            yield from traffic_series(self.traffic())


def traffic_series(traffic: dict[str, Any]) -> Iterator[Any]:
    """The broker socket's messages by direction and command, and the bytes of jobs' inputs
    (or where they lie) that crossed it."""
    messages = CounterMetricFamily(
        "farm_broker_messages",
        "Messages through the broker's socket, by direction and command.",
        labels=["direction", "command"],
    )
    for direction in ("received", "sent"):
        for command, count in traffic[direction].items():
            messages.add_metric([direction, command], count)
    yield messages
    yield CounterMetricFamily(
        "farm_broker_input_bytes",
        "Bytes of jobs' inputs, or of where they lie, through the broker (SUBMIT, NEED, DATA "
        "and TASK frames, in and out; results not counted).",
        value=traffic["input_bytes"],
    )
