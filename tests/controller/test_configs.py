"""Topic configs on a real cluster: IncrementalAlterConfigs changes a live topic's configs and
its brokers apply them to their existing logs (retention, min.insync.replicas, unclean leader
election); refused and validate_only changes change nothing; DescribeConfigs tells overrides
from defaults, also after a controller failover (the configs are in etcd)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from tests.controller.cluster import Cluster, Eventually
from tidewater.local.fetch import list_offsets
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode

SET, DELETE = cpb.CONFIG_OPERATION_SET, cpb.CONFIG_OPERATION_DELETE
DYNAMIC, DEFAULT = cpb.CONFIG_SOURCE_DYNAMIC_TOPIC_CONFIG, cpb.CONFIG_SOURCE_DEFAULT_CONFIG


def changes(topic: str, *configs: tuple[str, int, str]) -> cpb.AlterConfigsTopic:
    return cpb.AlterConfigsTopic(
        topic=topic,
        configs=[cpb.AlterableConfig(name=n, operation=op, value=v) for n, op, v in configs],
    )


async def alter(
    cluster: Cluster, *topics: cpb.AlterConfigsTopic, validate_only: bool = False
) -> list[tuple[int, str]]:
    """Each topic's (error code, message)."""
    response = await cluster.call_controller(
        "IncrementalAlterConfigs",
        cpb.IncrementalAlterConfigsRequest(topics=topics, validate_only=validate_only),
    )
    assert response.error_code == ErrorCode.NONE, response.error_message
    return [(t.error_code, t.error_message) for t in response.topics]


async def alter_ok(cluster: Cluster, topic: str, *configs: tuple[str, int, str]) -> None:
    [(code, message)] = await alter(cluster, changes(topic, *configs))
    assert code == ErrorCode.NONE, message


async def describe(cluster: Cluster, *topics: str) -> dict[str, cpb.DescribeConfigsResult]:
    response = await cluster.call_controller(
        "DescribeConfigs", cpb.DescribeConfigsRequest(topics=topics)
    )
    return {t.topic: t for t in response.topics}


def entries(result: cpb.DescribeConfigsResult) -> dict[str, tuple[str, int]]:
    return {e.name: (e.value, e.source) for e in result.entries}


async def earliest(cluster: Cluster, broker_id: int, topic: str) -> int:
    response = await cluster.broker_stub(broker_id).ListOffsets(
        list_offsets(topic, 0, pb.OFFSET_SPEC_EARLIEST)
    )
    return response.partitions[0].offset


def segment_files(cluster: Cluster, broker_id: int, topic: str) -> list[Path]:
    return sorted((cluster.root / f"broker-{broker_id}" / f"{topic}-0").glob("*.log"))


async def test_altering_retention_makes_a_live_topics_broker_delete_old_segments(
    make_cluster: Callable[..., Awaitable[Cluster]], eventually: Eventually
) -> None:
    cluster = await make_cluster(broker_ids=())
    await cluster.start_broker(1, **{"log.retention.check.interval.ms": "100"})
    await eventually(lambda: cluster.has_alive_brokers({1}), 30)
    await cluster.create_topic("aging", assignments=[[1]], **{"segment.bytes": "2000"})
    await eventually(lambda: cluster.produced("aging", 0, b"first"), 20)
    await cluster.produce_all("aging", 0, [bytes(300) + bytes([i]) for i in range(20)])
    assert len(segment_files(cluster, 1, "aging")) > 2
    assert await earliest(cluster, 1, "aging") == 0  # the default retention: 7 days

    await alter_ok(cluster, "aging", ("retention.ms", SET, "1"))

    # Every segment but the active one goes at the broker's next retention check.
    await eventually(lambda: len(segment_files(cluster, 1, "aging")) == 1, 20)
    [active] = segment_files(cluster, 1, "aging")
    assert await earliest(cluster, 1, "aging") == int(active.stem) > 0


async def test_min_insync_replicas_applies_to_the_next_acks_all_produce(
    cluster: Cluster, eventually: Eventually
) -> None:
    await cluster.create_topic("guarded", assignments=[[1, 2, 3]])
    await eventually(lambda: cluster.produced("guarded", 0, b"x"), 20)
    cluster.brokers[3].kill()
    cluster.brokers[2].kill()

    async def isr_is_leader_alone() -> bool:
        state = (await cluster.partitions("guarded"))[0]
        return (state["leader"], state["isr"]) == (1, [1])

    await eventually(isr_is_leader_alone, 20)
    alone = await cluster.send(1, "guarded", 0, b"alone")
    assert alone is not None and alone.error_code == ErrorCode.NONE, alone

    await alter_ok(cluster, "guarded", ("min.insync.replicas", SET, "2"))

    async def answers(code: int) -> bool:
        result = await cluster.send(1, "guarded", 0, b"acks=all")
        return result is not None and result.error_code == code

    await eventually(lambda: answers(ErrorCode.NOT_ENOUGH_REPLICAS), 20)
    await alter_ok(cluster, "guarded", ("min.insync.replicas", DELETE, ""))
    await eventually(lambda: answers(ErrorCode.NONE), 20)


async def test_enabling_unclean_leader_election_elects_an_offline_partition(
    cluster: Cluster, eventually: Eventually
) -> None:
    await cluster.create_topic("lossy", assignments=[[1, 2]])
    await eventually(lambda: cluster.produced("lossy", 0, b"x"), 20)
    # Broker 2 drops out of the ISR, then its only member dies: offline, with broker 2 back.
    cluster.brokers[2].kill()
    await eventually(lambda: _state_is(cluster, "lossy", leader=1, isr=[1]), 20)
    cluster.brokers[1].kill()
    # The ISR empties (KIP-966): 1 is an eligible leader replica and the last known leader.
    await eventually(lambda: _state_is(cluster, "lossy", leader=-1, isr=[]), 20)
    await cluster.start_broker(2)
    await eventually(lambda: cluster.has_alive_brokers({2}), 30)
    assert await _state_is(cluster, "lossy", leader=-1, isr=[])

    await alter_ok(cluster, "lossy", ("unclean.leader.election.enable", SET, "true"))

    await eventually(lambda: _state_is(cluster, "lossy", leader=2, isr=[2]), 20)
    await eventually(lambda: cluster.produced("lossy", 0, b"after"), 20)


async def _state_is(cluster: Cluster, topic: str, leader: int, isr: list[int]) -> bool:
    state = (await cluster.partitions(topic))[0]
    return (state["leader"], state["isr"]) == (leader, isr)


async def test_refused_and_validate_only_changes_change_nothing(cluster: Cluster) -> None:
    await cluster.create_topic("strict", 1, 1, **{"retention.ms": "1000"})
    stored = (await cluster.store.load_topics())["strict"]
    cases = [
        (changes("strict", ("no.such.config", SET, "1")), ErrorCode.INVALID_CONFIG),
        (changes("strict", ("no.such.config", DELETE, "")), ErrorCode.INVALID_CONFIG),
        (changes("strict", ("retention.ms", SET, "soon")), ErrorCode.INVALID_CONFIG),
        (
            changes("strict", ("segment.ms", SET, "5"), ("min.insync.replicas", SET, "0")),
            ErrorCode.INVALID_CONFIG,
        ),
        (
            changes("strict", ("retention.ms", SET, "5"), ("retention.ms", DELETE, "")),
            ErrorCode.INVALID_REQUEST,
        ),
        (changes("missing", ("retention.ms", SET, "5")), ErrorCode.UNKNOWN_TOPIC_OR_PARTITION),
    ]
    for topic, code in cases:
        [(got, message)] = await alter(cluster, topic)
        assert (got, bool(message)) == (code, True), (topic, message)
    twice = changes("strict", ("retention.ms", SET, "5"))
    assert [c for c, _ in await alter(cluster, twice, twice)] == [ErrorCode.INVALID_REQUEST] * 2
    dry = await alter(
        cluster,
        changes("strict", ("retention.ms", DELETE, ""), ("segment.ms", SET, "5")),
        changes("strict2", ("retention.ms", SET, "5")),
        validate_only=True,
    )
    assert [c for c, _ in dry] == [ErrorCode.NONE, ErrorCode.UNKNOWN_TOPIC_OR_PARTITION]
    [(code, _)] = await alter(
        cluster, changes("strict", ("retention.ms", SET, "-5")), validate_only=True
    )
    assert code == ErrorCode.INVALID_CONFIG

    assert (await cluster.store.load_topics())["strict"] == stored
    assert dict((await describe(cluster, "strict"))["strict"].configs) == {"retention.ms": "1000"}


async def test_describe_configs_tells_overrides_from_defaults_across_a_failover(
    cluster: Cluster, eventually: Eventually
) -> None:
    await cluster.create_topic(
        "described", 1, 1, **{"retention.ms": "1000", "segment.bytes": "4096"}
    )
    await cluster.create_topic("plain", 1, 1)
    await alter_ok(
        cluster, "described", ("min.insync.replicas", SET, "2"), ("segment.bytes", DELETE, "")
    )
    expected = {"retention.ms": ("1000", DYNAMIC), "min.insync.replicas": ("2", DYNAMIC)}

    def check(described: dict[str, cpb.DescribeConfigsResult]) -> None:
        result = described["described"]
        assert result.error_code == ErrorCode.NONE
        assert dict(result.configs) == {"retention.ms": "1000", "min.insync.replicas": "2"}
        got = entries(result)
        assert {k: v for k, v in got.items() if v[1] == DYNAMIC} == expected
        assert got["segment.bytes"] == (str(1 << 30), DEFAULT)
        assert got["unclean.leader.election.enable"] == ("false", DEFAULT)
        assert all(source == DEFAULT for _, source in entries(described["plain"]).values())

    everything = await describe(cluster)
    assert {"described", "plain"} <= set(everything)
    check(everything)
    missing = (await describe(cluster, "plain", "missing"))["missing"]
    assert (missing.error_code, list(missing.entries)) == (ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, [])

    active = await cluster.store.active_controller()
    assert active is not None
    standby = next(c for c in cluster.controllers if c != active[0])
    stub = cluster.controller_stub(standby)
    for call, request in (
        (stub.DescribeConfigs, cpb.DescribeConfigsRequest()),
        (stub.IncrementalAlterConfigs, cpb.IncrementalAlterConfigsRequest()),
    ):
        response = await call(request, timeout=5)
        assert response.error_code == ErrorCode.NOT_CONTROLLER
        assert response.controller.controller_id == active[0]

    cluster.controllers[active[0]].kill()

    async def described_by_the_new_controller() -> dict[str, cpb.DescribeConfigsResult]:
        now = await cluster.store.active_controller()
        return await describe(cluster) if now is not None and now[0] == standby else {}

    check(await eventually(described_by_the_new_controller, cluster.lease_ttl_s + 10))
