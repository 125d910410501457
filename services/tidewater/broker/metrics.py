"""The broker's metrics, named after Kafka's (README: Metrics).

State the broker keeps anyway (partitions, ISRs, purgatories, logs, fetchers, AlterIsr counts)
is read when Prometheus scrapes. Only requests record on their path, through `RequestMetrics`,
which exists only when metrics are on: three histogram records and a few int additions.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from tidewater.telemetry.metrics import LATENCY_BUCKETS_MS, MetricsEndpoint, Reading

if TYPE_CHECKING:
    from tidewater.broker.fetcher import ReplicaFetcher
    from tidewater.broker.replica_manager import ReplicaManager

# Kafka's request names: a fetch from a follower and one from a consumer are told apart.
PRODUCE, FETCH_CONSUMER, FETCH_FOLLOWER = "Produce", "FetchConsumer", "FetchFollower"
REQUESTS = (PRODUCE, FETCH_CONSUMER, FETCH_FOLLOWER)


class RequestMetrics:
    """Kafka's RequestMetrics per request type: the count, and the total, local and remote
    time — for a produce, local is the append and remote the wait in the produce purgatory
    (acks=all); for a fetch, local is the first read and remote the long poll in the fetch
    purgatory. And Kafka's BrokerTopicMetrics bytes: produced (in), served to consumers (out)
    and to followers (replication out)."""

    def __init__(self, endpoint: MetricsEndpoint) -> None:
        self.requests = dict.fromkeys(REQUESTS, 0)
        self.bytes_in = 0
        self.bytes_out = 0
        self.replication_bytes_out = 0
        self._attributes = {request: {"request": request} for request in REQUESTS}
        self._times = [
            endpoint.histogram(
                f"tidewater.request.{name}_time",
                f"{what} of a request, ms (Kafka's {name.capitalize()}TimeMs)",
                "ms",
                LATENCY_BUCKETS_MS,
            )
            for name, what in (
                ("total", "From arrival to response"),
                ("local", "The broker's own work (append; first read)"),
                ("remote", "Time in purgatory (acks=all replication; fetch long poll)"),
            )
        ]
        endpoint.counter(
            "tidewater.request.requests",
            "Requests handled, by type (Kafka's RequestsPerSec)",
            lambda: [(n, self._attributes[request]) for request, n in self.requests.items()],
        )
        endpoint.counter(
            "tidewater.broker_topic.bytes_in",
            "Record batch bytes appended by produce requests (Kafka's BytesInPerSec)",
            lambda: self.bytes_in,
        )
        endpoint.counter(
            "tidewater.broker_topic.bytes_out",
            "Record batch bytes served to consumers (Kafka's BytesOutPerSec)",
            lambda: self.bytes_out,
        )
        endpoint.counter(
            "tidewater.broker_topic.replication_bytes_out",
            "Record batch bytes served to followers (Kafka's ReplicationBytesOutPerSec)",
            lambda: self.replication_bytes_out,
        )

    def produced(self, started_ns: int, local_done_ns: int, done_ns: int, size: int) -> None:
        self.bytes_in += size
        self._record(PRODUCE, started_ns, local_done_ns, done_ns)

    def fetched(
        self, follower: bool, started_ns: int, local_done_ns: int, done_ns: int, size: int
    ) -> None:
        if follower:
            self.replication_bytes_out += size
            self._record(FETCH_FOLLOWER, started_ns, local_done_ns, done_ns)
        else:
            self.bytes_out += size
            self._record(FETCH_CONSUMER, started_ns, local_done_ns, done_ns)

    def _record(self, request: str, started_ns: int, local_done_ns: int, done_ns: int) -> None:
        self.requests[request] += 1
        attributes = self._attributes[request]
        total, local, remote = self._times
        total.record((done_ns - started_ns) / 1e6, attributes)
        local.record((local_done_ns - started_ns) / 1e6, attributes)
        remote.record((done_ns - local_done_ns) / 1e6, attributes)


def register_broker_metrics(endpoint: MetricsEndpoint, rm: ReplicaManager) -> RequestMetrics:
    """Declare every broker metric; returns what the request paths record into."""

    def leaders() -> list[int]:
        """Per partition this broker leads: how many ISR members it lacks of its replicas."""
        return [
            len(p.state.replicas) - len(p.state.isr)
            for p in rm.partitions.values()
            if p.state.is_leader
        ]

    endpoint.gauge(
        "tidewater.replica_manager.partition_count",
        "Partitions hosted on this broker, as leader or follower (Kafka's PartitionCount)",
        lambda: len(rm.partitions),
    )
    endpoint.gauge(
        "tidewater.replica_manager.leader_count",
        "Partitions this broker leads (Kafka's LeaderCount)",
        lambda: len(leaders()),
    )
    endpoint.gauge(
        "tidewater.replica_manager.under_replicated_partitions",
        "Partitions led here whose ISR is smaller than their replicas "
        "(Kafka's UnderReplicatedPartitions)",
        lambda: sum(1 for missing in leaders() if missing > 0),
    )
    endpoint.gauge(
        "tidewater.replica_manager.under_min_isr_partitions",
        "Partitions led here whose ISR is below min.insync.replicas, by this broker's value "
        "or the controller's (eligible leader replicas): acks=all is refused "
        "(Kafka's UnderMinIsrPartitionCount)",
        lambda: sum(
            1 for p in rm.partitions.values() if p.state.is_leader and p.state.under_min_isr
        ),
    )
    endpoint.counter(
        "tidewater.replica_manager.isr_shrinks",
        "ISR shrinks committed for partitions led here (Kafka's IsrShrinksPerSec)",
        lambda: rm.isr_shrinks,
    )
    endpoint.counter(
        "tidewater.replica_manager.isr_expands",
        "ISR expansions committed for partitions led here (Kafka's IsrExpandsPerSec)",
        lambda: rm.isr_expands,
    )
    endpoint.counter(
        "tidewater.alter_isr.requests",
        "AlterIsr RPCs sent to the controller: each carries a batch of ISR changes",
        lambda: rm.isr_channel.rpcs_sent,
    )
    endpoint.counter(
        "tidewater.alter_isr.partitions",
        "ISR changes sent to the controller in AlterIsr RPCs",
        lambda: rm.isr_channel.partitions_sent,
    )
    endpoint.gauge(
        "tidewater.purgatory.size",
        "Requests waiting in a purgatory: acks=all produces, long-polling fetches "
        "(Kafka's PurgatorySize)",
        lambda: [
            (rm.produce_purgatory.watched, {"operation": PRODUCE}),
            (rm.fetch_purgatory.watched, {"operation": "Fetch"}),
        ],
    )
    endpoint.gauge(
        "tidewater.log.size",
        "Bytes of a partition's log on disk (Kafka's Log Size)",
        lambda: [
            (p.log.size_bytes, {"topic": topic, "partition": partition})
            for (topic, partition), p in rm.partitions.items()
        ],
        unit="By",
    )
    endpoint.gauge(
        "tidewater.replica_fetcher.max_lag",
        "Per fetcher: the most messages any of its partitions is behind its leader's log end "
        "(Kafka's ReplicaFetcherManager MaxLag)",
        lambda: _fetcher_lags(rm.fetcher_manager.fetchers.values()),
    )
    return RequestMetrics(endpoint)


def _fetcher_lags(fetchers: Iterable[ReplicaFetcher]) -> Reading:
    return [
        (
            _max_lag(fetcher),
            {"source_broker_id": fetcher.source.broker_id, "fetcher_id": fetcher.fetcher_id},
        )
        for fetcher in fetchers
    ]


def _max_lag(fetcher: ReplicaFetcher) -> int:
    lag = 0
    for tp, state in fetcher.partitions.items():
        hosted = fetcher.lookup(tp)
        if hosted is not None and state.leader_end_offset >= 0:
            lag = max(lag, state.leader_end_offset - hosted.log.log_end_offset)
    return lag
