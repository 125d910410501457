"""What the controller knows: brokers, topics and every partition's LeaderAndIsr.

Loaded from etcd on becoming active and kept in step with every committed write. Plain data;
the rules that change it are in core.py.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from typing import Any

TopicPartition = tuple[str, int]
NO_LEADER = -1
# An ISR member's broker epoch in an AlterIsr proposal that the leader does not know: not checked.
NO_BROKER_EPOCH = -1


@dataclass
class BrokerState:
    broker_id: int
    host: str
    port: int
    rack: str
    incarnation_id: str
    # The etcd revision of the registration: a restarted broker registers anew and gets a
    # larger epoch, so requests from (or meant for) its previous life are refused.
    epoch: int
    last_heartbeat_ms: int = 0
    # Fenced until its first heartbeat to this controller, and again after a missed session.
    fenced: bool = True
    shutting_down: bool = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def usable(self) -> bool:
        """Alive for leadership and ISR membership."""
        return not self.fenced and not self.shutting_down

    def to_json(self) -> dict[str, Any]:
        return {
            "broker_id": self.broker_id,
            "host": self.host,
            "port": self.port,
            "rack": self.rack,
            "incarnation_id": self.incarnation_id,
        }


@dataclass(frozen=True)
class PartitionRecord:
    """A partition's LeaderAndIsr as stored in etcd; partition_epoch is the key's mod_revision."""

    leader: int
    leader_epoch: int
    isr: tuple[int, ...]
    controller_epoch: int
    partition_epoch: int = 0
    # Eligible leader replicas (KIP-966): out of the ISR, yet holding every committed record,
    # as they left it while it was below min.insync.replicas (and the HW does not advance
    # then). Never an ISR member; empty while the ISR is at or above min.insync.replicas.
    elr: tuple[int, ...] = ()
    # The last leader before the ISR became empty (Kafka's LastKnownElr, at most one member);
    # empty while the partition has a leader.
    last_known_elr: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "leader": self.leader,
            "leader_epoch": self.leader_epoch,
            "isr": list(self.isr),
            "controller_epoch": self.controller_epoch,
            "elr": list(self.elr),
            "last_known_elr": list(self.last_known_elr),
        }

    @classmethod
    def from_json(cls, value: dict[str, Any], partition_epoch: int) -> PartitionRecord:
        """A record stored by a version without ELR has none."""
        return cls(
            leader=int(value["leader"]),
            leader_epoch=int(value["leader_epoch"]),
            isr=tuple(int(b) for b in value["isr"]),
            controller_epoch=int(value["controller_epoch"]),
            partition_epoch=partition_epoch,
            elr=tuple(int(b) for b in value.get("elr", ())),
            last_known_elr=tuple(int(b) for b in value.get("last_known_elr", ())),
        )

    def with_(self, **changes: Any) -> PartitionRecord:
        return replace(self, **changes)


@dataclass(frozen=True)
class Reassignment:
    """A partition moving from `original` to `target` replicas (KIP-455). Until the target
    replicas are all in the ISR, the partition is assigned to both."""

    original: tuple[int, ...]
    target: tuple[int, ...]

    @property
    def replicas(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(self.target + self.original))

    @property
    def adding(self) -> tuple[int, ...]:
        return tuple(b for b in self.target if b not in self.original)

    @property
    def removing(self) -> tuple[int, ...]:
        return tuple(b for b in self.original if b not in self.target)

    def to_json(self) -> dict[str, list[int]]:
        return {"original": list(self.original), "target": list(self.target)}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Reassignment:
        return cls(tuple(value["original"]), tuple(value["target"]))


@dataclass
class TopicState:
    name: str
    configs: dict[str, str]
    # partition → assigned replicas (AR), preferred leader first
    assignment: dict[int, tuple[int, ...]]
    reassignments: dict[int, Reassignment] = field(default_factory=dict)
    # Given at creation and kept for the topic's life (KIP-516): a topic created again under a
    # deleted one's name has another, so clients tell its partitions from the old topic's.
    topic_id: uuid.UUID = field(default_factory=uuid.uuid4)

    def to_json(self) -> dict[str, Any]:
        return {
            "topic_id": str(self.topic_id),
            "configs": self.configs,
            "assignment": {str(p): list(r) for p, r in sorted(self.assignment.items())},
            "reassignments": {str(p): r.to_json() for p, r in sorted(self.reassignments.items())},
        }

    @classmethod
    def from_json(cls, name: str, value: dict[str, Any]) -> TopicState:
        """A topic stored without an id (by a version without topic ids) gets a new one: the
        controller that loads it stores it."""
        return cls(
            topic_id=uuid.UUID(value["topic_id"]) if "topic_id" in value else uuid.uuid4(),
            name=name,
            configs={str(k): str(v) for k, v in value.get("configs", {}).items()},
            assignment={int(p): tuple(int(b) for b in r) for p, r in value["assignment"].items()},
            reassignments={
                int(p): Reassignment.from_json(r) for p, r in value.get("reassignments", {}).items()
            },
        )

    @property
    def unclean_leader_election_enable(self) -> bool:
        return self.configs.get("unclean.leader.election.enable", "false").lower() == "true"


@dataclass(frozen=True)
class TopicDeletion:
    """A deleted topic whose replicas have not all confirmed deleting their logs
    (StopReplica with delete). Until they have, no topic may take its name: a broker that was
    down at deletion would otherwise serve its old log as the new topic's."""

    partitions: int
    # Brokers that hold a replica and have not confirmed yet.
    pending: frozenset[int]

    def to_json(self) -> dict[str, Any]:
        return {"partitions": self.partitions, "pending": sorted(self.pending)}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> TopicDeletion:
        return cls(int(value["partitions"]), frozenset(int(b) for b in value["pending"]))


@dataclass
class ClusterModel:
    brokers: dict[int, BrokerState] = field(default_factory=dict)
    topics: dict[str, TopicState] = field(default_factory=dict)
    partitions: dict[TopicPartition, PartitionRecord] = field(default_factory=dict)
    deletions: dict[str, TopicDeletion] = field(default_factory=dict)
    # The controller's own min.insync.replicas (`--min-insync-replicas`, as Kafka's KRaft
    # controller's static config): the value of a topic without its own. Not stored in etcd;
    # set it to the brokers' default, which the controller does not see.
    min_insync_replicas: int = 1

    def min_insync_replicas_of(self, topic: TopicState) -> int:
        """The topic's override, else the controller's default."""
        return int(topic.configs.get("min.insync.replicas", self.min_insync_replicas))

    def replicas(self, tp: TopicPartition) -> tuple[int, ...]:
        return self.topics[tp[0]].assignment[tp[1]]

    def usable_brokers(self) -> set[int]:
        return {b.broker_id for b in self.brokers.values() if b.usable}

    def unfenced_brokers(self) -> set[int]:
        """The live ones: the usable and those still serving through a controlled shutdown."""
        return {b.broker_id for b in self.brokers.values() if not b.fenced}

    def partitions_of(self, topic: str) -> list[TopicPartition]:
        return [(topic, p) for p in sorted(self.topics[topic].assignment)]

    def reassigning(self) -> list[TopicPartition]:
        """Partitions with a reassignment in flight."""
        return sorted((t.name, p) for t in self.topics.values() for p in t.reassignments)

    def partitions_on(self, broker_id: int) -> list[TopicPartition]:
        return [tp for tp in self.partitions if broker_id in self.replicas(tp)]
