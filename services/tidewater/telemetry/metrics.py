"""OpenTelemetry metrics for one process, served as a Prometheus scrape endpoint
(`--metrics-port`): http://HOST:PORT/metrics.

Each service declares its instruments on the `MetricsEndpoint` it gets from `start_metrics`.
Gauges and counters of state the process keeps anyway are observable: their callbacks read
that state when Prometheus scrapes, so the request paths do no bookkeeping for them. The
scrape runs on prometheus-client's HTTP thread while the state belongs to the asyncio loop, so
every callback runs on the loop (a consistent read, never a dict changing under it). With no
port there is no endpoint, the services skip their few hot-path records, and the process never
imports this module (nor OpenTelemetry).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Histogram, Observation
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

from tidewater.rpc.address import ListenFailed

log = logging.getLogger(__name__)

Attributes = Mapping[str, str | int]
# What an observable instrument's read returns: one value, or one value per attribute set.
Reading = float | Iterable[tuple[float, Attributes]]
# Request latency buckets in ms: sub-millisecond appends up to the 30 s request timeout.
LATENCY_BUCKETS_MS = (
    0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000,
)  # fmt: skip


class MetricsEndpoint:
    """A MeterProvider whose PrometheusMetricReader is served over HTTP on its own thread."""

    def __init__(
        self, service_name: str, host: str, port: int, attributes: Attributes | None = None
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._registry = CollectorRegistry()
        ProcessCollector(registry=self._registry)
        self._reader = PrometheusMetricReader(scope_info_enabled=False, registry=self._registry)
        resource = Resource.create(
            {
                "service.name": service_name,
                "service.instance.id": uuid.uuid4().hex,
                **(attributes or {}),
            }
        )
        # Exemplars would tie samples to traces at a cost on every record; scrapes don't use them.
        self._provider = MeterProvider(
            metric_readers=[self._reader],
            resource=resource,
            exemplar_filter=AlwaysOffExemplarFilter(),
        )
        self.meter = self._provider.get_meter(service_name)
        try:
            self._server, self._thread = start_http_server(port, host, self._registry)
        except OSError as e:  # as the gRPC port's: the process exits naming the address
            self._provider.shutdown()
            raise ListenFailed(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        self.address = f"{host}:{self._server.server_port}"
        log.info("metrics on http://%s/metrics", self.address)

    def gauge(
        self, name: str, description: str, read: Callable[[], Reading], unit: str = ""
    ) -> None:
        self.meter.create_observable_gauge(
            name, [self._callback(read)], unit=unit, description=description
        )

    def counter(
        self, name: str, description: str, read: Callable[[], Reading], unit: str = ""
    ) -> None:
        """A monotonic count the process keeps (a plain int): read at scrape time."""
        self.meter.create_observable_counter(
            name, [self._callback(read)], unit=unit, description=description
        )

    def histogram(
        self, name: str, description: str, unit: str, boundaries: Sequence[float]
    ) -> Histogram:
        return self.meter.create_histogram(
            name,
            unit=unit,
            description=description,
            explicit_bucket_boundaries_advisory=list(boundaries),
        )

    def _callback(
        self, read: Callable[[], Reading]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe() -> list[Observation]:
            reading = read()
            if isinstance(reading, int | float):
                return [Observation(reading)]
            return [Observation(value, dict(attributes)) for value, attributes in reading]

        def callback(options: CallbackOptions) -> Iterable[Observation]:
            # The SDK gives each callback what is left of the scrape's time: a stalled loop
            # fails the scrape (Prometheus shows the target down) instead of hanging it.
            return self._on_loop(observe, options.timeout_millis / 1000)

        return callback

    def _on_loop(self, fn: Callable[[], list[Observation]], timeout_s: float) -> list[Observation]:
        """Run fn on the event loop and wait for it: scrapes come on the HTTP server's thread."""
        future: concurrent.futures.Future[list[Observation]] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except Exception as e:  # handed to the scrape, which leaves this instrument out
                future.set_exception(e)

        self._loop.call_soon_threadsafe(run)
        return future.result(timeout_s)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._provider.shutdown()
