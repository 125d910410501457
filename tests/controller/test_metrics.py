"""The Prometheus endpoints of a real cluster (etcd, two controllers, three brokers), read as
an operator's dashboard would: controller activity, replication health, request counts,
bytes and latencies, log sizes and fetcher lag."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from tests.controller.cluster import Cluster, Eventually

URP = "tidewater_replica_manager_under_replicated_partitions"
OFFLINE = "tidewater_controller_offline_partitions_count"
ACTIVE = "tidewater_controller_active_controller_count"


async def test_controller_activity_and_replication_health(
    make_cluster: Callable[..., Awaitable[Cluster]], eventually: Eventually
) -> None:
    cluster = await make_cluster(metrics=True)
    active = await cluster.store.active_controller()
    assert active is not None
    standby = 2 if active[0] == 1 else 1
    assert (await cluster.metrics("controller", active[0]))(ACTIVE) == 1
    assert (await cluster.metrics("controller", standby))(ACTIVE) == 0

    await cluster.create_topic("orders", assignments=[(1, 2, 3)])
    await cluster.create_topic("solo", assignments=[(3,)])

    async def healthy() -> bool:
        controller = await cluster.metrics("controller", active[0])
        leader = await cluster.metrics("broker", 1)
        return (
            controller("tidewater_controller_global_partition_count") == 2
            and controller(OFFLINE) == 0
            and leader("tidewater_replica_manager_leader_count") == 1
            and leader(URP) == 0
        )

    await eventually(healthy, 20)
    # A standby knows nothing of the cluster: only the active controller's view counts.
    assert (await cluster.metrics("controller", standby))(OFFLINE) == 0

    cluster.brokers[3].kill()

    async def degraded() -> bool:
        controller = await cluster.metrics("controller", active[0])
        return (
            controller(OFFLINE) == 1
            and controller("tidewater_controller_fenced_broker_count") == 1
            and (await cluster.metrics("broker", 1))(URP) == 1
        )

    await eventually(degraded, 15)
    expands = (await cluster.metrics("broker", 1))("tidewater_replica_manager_isr_expands_total")

    await cluster.start_broker(3)
    await eventually(healthy, 20)
    leader = await cluster.metrics("broker", 1)
    assert leader("tidewater_replica_manager_isr_expands_total") >= expands + 1
    assert leader("tidewater_alter_isr_requests_total") >= 1


async def test_requests_bytes_latencies_log_size_and_fetcher_lag(
    make_cluster: Callable[..., Awaitable[Cluster]], eventually: Eventually
) -> None:
    cluster = await make_cluster(metrics=True)
    await cluster.create_topic("events", assignments=[(1, 2, 3)])
    await eventually(lambda: cluster.produced("events", 0, b"first"), 20)
    before = await cluster.metrics("broker", 1)

    values = [f"value-{i}".encode() * 10 for i in range(20)]
    for value in values:
        result = await cluster.send(1, "events", 0, value)
        assert result is not None and result.error_code == 0, result
    read = await cluster.read(1, "events", 0)
    assert set(values) <= set(read)

    after = await cluster.metrics("broker", 1)
    produced = after.since(before, "tidewater_request_requests_total", request="Produce")
    assert produced == len(values)
    bytes_in = after.since(before, "tidewater_broker_topic_bytes_in_total")
    assert bytes_in > sum(len(v) for v in values)
    assert after.since(before, "tidewater_broker_topic_bytes_out_total") > 0
    assert after("tidewater_request_requests_total", request="FetchConsumer") >= 1
    assert after("tidewater_request_requests_total", request="FetchFollower") >= len(values)
    # Every produce went into all three histograms; acks=all waited in the purgatory.
    for histogram in ("total", "local", "remote"):
        name = f"tidewater_request_{histogram}_time_milliseconds"
        assert after.since(before, f"{name}_count", request="Produce") == produced, name
        assert after.since(before, f"{name}_sum", request="Produce") > 0, name
    assert after("tidewater_purgatory_size", operation="Produce") == 0

    async def replicated() -> bool:
        sizes = [
            (await cluster.metrics("broker", b))(
                "tidewater_log_size_bytes", topic="events", partition=0
            )
            for b in (1, 2, 3)
        ]
        lags = [
            (await cluster.metrics("broker", b))(
                "tidewater_replica_fetcher_max_lag", source_broker_id=1, fetcher_id=0
            )
            for b in (2, 3)
        ]
        return sizes[0] >= bytes_in and len(set(sizes)) == 1 and lags == [0, 0]

    await eventually(replicated, 10)
