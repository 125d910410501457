"""`tidewater topics create | list | describe | delete`, through the SDK's Admin client."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid

from tidewater.client.admin import Admin
from tidewater.errors import RequestTimedOut, UnknownTopicOrPartition
from tidewater.tools.options import (
    add_connection_options,
    bootstrap,
    key_value,
    request_timeout_s,
)
from tidewater.v1 import metadata_pb2
from tidewater.v1.errors_pb2 import ErrorCode


def add_parser(commands: argparse._SubParsersAction) -> None:
    topics = commands.add_parser("topics", help="create, list, describe and delete topics")
    actions = topics.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="create a topic (waits until it has leaders)")
    create.add_argument("--topic", required=True)
    create.add_argument("--partitions", type=int, default=1, help="default 1")
    create.add_argument("--replication-factor", type=int, default=3, help="default 3")
    create.add_argument(
        "--config",
        type=key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a topic config, e.g. --config min.insync.replicas=2 (repeatable)",
    )
    actions.add_parser("list", help="topic names, one per line")
    describe = actions.add_parser(
        "describe", help="partitions with leader, leader epoch, replicas and ISR"
    )
    describe.add_argument("--topic", help="one topic (default: every topic)")
    describe.add_argument("--json", action="store_true", help="print JSON")
    delete = actions.add_parser("delete", help="delete a topic and its data")
    delete.add_argument("--topic", required=True)
    for action in (create, actions.choices["list"], describe, delete):
        add_connection_options(action)
        action.set_defaults(run=run)


async def run(args: argparse.Namespace) -> int:
    timeout_s = request_timeout_s(args)
    async with Admin((), bootstrap(args), request_timeout_s=timeout_s) as admin:
        if args.action == "create":
            topic_id = await admin.create_topic(
                args.topic, args.partitions, args.replication_factor, dict(args.config)
            )
            await _wait_for_leaders(admin, args.topic, args.partitions, timeout_s)
            print(f"Created topic {args.topic} (topic id {topic_id}).")
        elif args.action == "delete":
            await admin.delete_topics([args.topic])
            print(f"Deleted topic {args.topic}.")
        elif args.action == "list":
            response = await admin.describe_topics()
            for topic in sorted(t.topic for t in response.topics):
                print(topic)
        else:
            response = await admin.describe_topics([args.topic] if args.topic else [])
            topics = sorted(response.topics, key=lambda t: t.topic)
            for topic in topics:
                if topic.error_code == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION:
                    raise UnknownTopicOrPartition(f"topic {topic.topic!r} does not exist")
            print(json.dumps(describe_json(topics), indent=2) if args.json else _table(topics))
    return 0


async def _wait_for_leaders(admin: Admin, topic: str, partitions: int, timeout_s: float) -> None:
    """Until the metadata service serves every partition with a leader: a produce right after
    `topics create` finds the topic."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = await admin.describe_topics([topic])
        served = response.topics[0]
        if (
            served.error_code == ErrorCode.NONE
            and sum(p.leader >= 0 for p in served.partitions) >= partitions
        ):
            return
        if time.monotonic() > deadline:
            raise RequestTimedOut(
                f"topic {topic!r} was created but has no leaders in the metadata service "
                f"after {timeout_s:g}s"
            )
        await asyncio.sleep(0.05)


def describe_json(topics: list[metadata_pb2.TopicMetadata]) -> dict[str, object]:
    return {
        "topics": [
            {
                "topic": t.topic,
                "topic_id": _topic_id(t),
                "partitions": [
                    {
                        "partition": p.partition,
                        "leader": p.leader,
                        "leader_epoch": p.leader_epoch,
                        "replicas": list(p.replicas),
                        "isr": list(p.isr),
                        "offline_replicas": list(p.offline_replicas),
                    }
                    for p in t.partitions
                ],
            }
            for t in topics
        ]
    }


def _table(topics: list[metadata_pb2.TopicMetadata]) -> str:
    """Kafka's kafka-topics --describe layout."""
    lines = []
    for t in topics:
        replication = len(t.partitions[0].replicas) if t.partitions else 0
        lines.append(
            f"Topic: {t.topic}\tTopicId: {_topic_id(t)}\tPartitionCount: {len(t.partitions)}\t"
            f"ReplicationFactor: {replication}"
        )
        for p in t.partitions:
            lines.append(
                f"\tTopic: {t.topic}\tPartition: {p.partition}\tLeader: {p.leader}\t"
                f"LeaderEpoch: {p.leader_epoch}\tReplicas: {_ids(p.replicas)}\t"
                f"Isr: {_ids(p.isr)}\tOffline: {_ids(p.offline_replicas)}"
            )
    return "\n".join(lines)


def _topic_id(topic: metadata_pb2.TopicMetadata) -> str:
    return str(uuid.UUID(bytes=topic.topic_id)) if topic.topic_id else ""


def _ids(ids: object) -> str:
    return ",".join(str(i) for i in ids)  # type: ignore[attr-defined]
