"""The metrics endpoint itself: served over real HTTP on 127.0.0.1, read on the event loop,
closed cleanly; and absent (not even imported) when a service runs without it."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from tidewater.local.scrape import scrape
from tidewater.telemetry.metrics import MetricsEndpoint


async def test_a_scrape_reads_state_on_the_event_loop_and_serves_every_kind() -> None:
    endpoint = MetricsEndpoint("tidewater-test", "127.0.0.1", 0, {"tidewater.test.id": 7})
    port = int(endpoint.address.rpartition(":")[2])
    loop_thread = threading.get_ident()
    read_on: list[int] = []
    state = {"queue": 3, "sent": 0}

    def queue() -> float:
        read_on.append(threading.get_ident())
        return state["queue"]

    endpoint.gauge("tidewater.test.queue", "items waiting", queue)
    endpoint.counter("tidewater.test.sent", "items sent", lambda: [(state["sent"], {"kind": "a"})])
    latency = endpoint.histogram("tidewater.test.latency", "latency", "ms", [1, 10])
    try:
        state["sent"] = 5
        latency.record(4.0, {"request": "Produce"})
        scraped = await scrape(port)
    finally:
        endpoint.close()
    assert read_on == [loop_thread]
    assert scraped("tidewater_test_queue") == 3
    assert scraped("tidewater_test_sent_total", kind="a") == 5
    bucket = "tidewater_test_latency_milliseconds_bucket"
    assert scraped(bucket, request="Produce", le="1") == 0
    assert scraped(bucket, request="Produce", le="10") == 1
    [target] = [dict(labels) for name, labels in scraped.samples if name == "target_info"]
    assert target["service_name"] == "tidewater-test"
    assert target["tidewater_test_id"] == "7"
    # Closed: nothing listens any more.
    with pytest.raises(OSError):
        await scrape(port, timeout_s=2)


def test_services_without_metrics_never_load_the_metrics_sdk() -> None:
    code = (
        "import sys, tidewater.cli, tidewater.broker.server, tidewater.controller.server, "
        "tidewater.metadata.server\n"
        "print(sorted(m for m in sys.modules if m.startswith(("
        "'prometheus_client', 'opentelemetry.sdk.metrics', 'opentelemetry.exporter.prometheus', "
        "'tidewater.telemetry.metrics'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"
