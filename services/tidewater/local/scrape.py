"""Reading a process's Prometheus endpoint as Prometheus would (for the tests and tools)."""

from __future__ import annotations

import asyncio
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tidewater.local.etcd import HOST


class Scrape:
    """One scrape: every sample by name and labels."""

    def __init__(self, text: str) -> None:
        self.samples = {
            (sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def __call__(self, name: str, **labels: object) -> float:
        """The value of the sample `name{labels}`, which must be there."""
        key = (name, frozenset((k, str(v)) for k, v in labels.items()))
        if key not in self.samples:
            raise KeyError(f"no sample {name}{labels} in the scrape")
        return self.samples[key]

    def since(self, earlier: Scrape, name: str, **labels: object) -> float:
        """How much a sample grew since an earlier scrape."""
        return self(name, **labels) - earlier(name, **labels)


async def scrape(port: int, host: str = HOST, timeout_s: float = 10.0) -> Scrape:
    """GET http://HOST:PORT/metrics."""

    def get() -> str:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as r:
            return r.read().decode()

    return Scrape(await asyncio.to_thread(get))
