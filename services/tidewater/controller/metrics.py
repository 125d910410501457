"""The controller's metrics, named after Kafka's (README: Metrics), all read from the
controller's model and its etcd store when Prometheus scrapes. A standby reports itself
inactive and zeros: only the active controller's view counts, as in Kafka."""

from __future__ import annotations

from tidewater.controller.controller import Controller
from tidewater.controller.model import NO_LEADER
from tidewater.telemetry.metrics import MetricsEndpoint


def register_controller_metrics(endpoint: MetricsEndpoint, controller: Controller) -> None:
    def model_count(count: int) -> int:
        return count if controller.active else 0

    endpoint.gauge(
        "tidewater.controller.active_controller_count",
        "1 on the active controller, 0 on a standby (Kafka's ActiveControllerCount)",
        lambda: int(controller.active),
    )
    endpoint.gauge(
        "tidewater.controller.offline_partitions_count",
        "Partitions without a leader (Kafka's OfflinePartitionsCount)",
        lambda: model_count(
            sum(1 for r in controller.model.partitions.values() if r.leader == NO_LEADER)
        ),
    )
    endpoint.gauge(
        "tidewater.controller.global_topic_count",
        "Topics in the cluster (Kafka's GlobalTopicCount)",
        lambda: model_count(len(controller.model.topics)),
    )
    endpoint.gauge(
        "tidewater.controller.global_partition_count",
        "Partitions in the cluster (Kafka's GlobalPartitionCount)",
        lambda: model_count(len(controller.model.partitions)),
    )
    endpoint.gauge(
        "tidewater.controller.active_broker_count",
        "Registered brokers that are unfenced (Kafka's ActiveBrokerCount)",
        lambda: model_count(sum(1 for b in controller.model.brokers.values() if not b.fenced)),
    )
    endpoint.gauge(
        "tidewater.controller.fenced_broker_count",
        "Registered brokers that are fenced (Kafka's FencedBrokerCount)",
        lambda: model_count(sum(1 for b in controller.model.brokers.values() if b.fenced)),
    )
    endpoint.counter(
        "tidewater.controller.etcd_txns",
        "Write transactions sent to etcd: batched ISR changes share them",
        lambda: controller.store.txns,
    )
    endpoint.counter(
        "tidewater.controller.etcd_txn_ops",
        "Write operations in those transactions",
        lambda: controller.store.txn_ops,
    )
