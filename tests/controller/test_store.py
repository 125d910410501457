"""ControllerStore against a real etcd: election, lease loss, fencing, partition epochs, producer
id blocks; and the EtcdProcess that runs etcd."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import socket
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aetcd
import pytest

from tidewater.controller.store import PARTITIONS_PER_TXN, ControllerStore
from tidewater.errors import NotController, StoreUnavailable
from tidewater.local.etcd import ETCD_BINARY, EtcdProcess

Connect = Callable[..., Awaitable[ControllerStore]]
WAIT_S = 15.0
# etcd grants at least 2 s whatever is asked (1.5 election timeouts, rounded up).
SHORT_TTL_S = 2


def leader_and_isr(leader: int, leader_epoch: int, isr: list[int], epoch: int = 1) -> dict:
    return {"leader": leader, "leader_epoch": leader_epoch, "isr": isr, "controller_epoch": epoch}


class TcpProxy:
    """Forwards connections to etcd. pause() holds every byte in flight, as a network partition
    would; resume() heals it."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.address = ""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def pause(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._connections):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        upstream_reader, upstream_writer = await asyncio.open_connection(*self._target)
        try:
            await asyncio.gather(
                self._pipe(reader, upstream_writer), self._pipe(upstream_reader, writer)
            )
        finally:
            writer.close()
            upstream_writer.close()
            self._connections.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        writer.close()


@pytest.fixture
async def proxy(etcd: EtcdProcess) -> AsyncIterator[TcpProxy]:
    proxy = TcpProxy(etcd.endpoint)
    await proxy.start()
    yield proxy
    proxy.resume()
    await proxy.close()


async def won(task: asyncio.Task[int]) -> int:
    return await asyncio.wait_for(asyncio.shield(task), WAIT_S)


# -- election ----------------------------------------------------------------------------------


async def test_one_of_two_campaigners_wins_then_the_other_after_resign(
    connect_store: Connect,
) -> None:
    a, b = await connect_store(), await connect_store()
    tasks = {
        1: asyncio.create_task(a.campaign(1, "127.0.0.1:9101", 5)),
        2: asyncio.create_task(b.campaign(2, "127.0.0.1:9102", 5)),
    }
    try:
        done, _ = await asyncio.wait(
            tasks.values(), timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED
        )
        assert len(done) == 1
        winner_id = next(i for i, t in tasks.items() if t in done)
        loser_id = 3 - winner_id
        winner, loser = (a, b) if winner_id == 1 else (b, a)
        assert tasks[winner_id].result() == 1
        assert await a.active_controller() == (winner_id, f"127.0.0.1:910{winner_id}", 1)
        assert not tasks[loser_id].done()

        await winner.resign()
        assert winner.lost.is_set()
        assert await won(tasks[loser_id]) == 2
        assert not loser.lost.is_set()
        assert await winner.active_controller() == (loser_id, f"127.0.0.1:910{loser_id}", 2)
    finally:
        for task in tasks.values():
            task.cancel()


async def test_a_standby_waits_quietly_after_etcd_compacted_the_election_history(
    connect_store: Connect, etcd: EtcdProcess, caplog: pytest.LogCaptureFixture
) -> None:
    # Production etcd compacts its history (--auto-compaction-*): a standby must not watch
    # from the revision the active controller was elected at, which is gone by then.
    active, standby = await connect_store(), await connect_store()
    assert await active.campaign(1, "127.0.0.1:9101", 5) == 1
    host, _, port = etcd.endpoint.rpartition(":")
    async with aetcd.Client(host, int(port)) as raw:
        for i in range(3):
            put = await raw.put(f"elsewhere/{i}".encode(), b"x")
        await raw.compact(put.header.revision)
    watches = 0
    watching = asyncio.Event()
    wait_for_vacancy = standby._wait_for_vacancy

    async def counted(from_revision: int) -> None:
        nonlocal watches
        watches += 1
        watching.set()
        await wait_for_vacancy(from_revision)

    standby._wait_for_vacancy = counted  # type: ignore[method-assign]
    caplog.set_level(logging.WARNING, logger="tidewater.controller.store")
    standby_won = asyncio.create_task(standby.campaign(2, "127.0.0.1:9102", 5))
    try:
        await asyncio.wait_for(watching.wait(), WAIT_S)
        await active.resign()
        assert await won(standby_won) == 2
        assert watches == 1  # woken by the resignation, not by a failed watch
        assert not caplog.records
    finally:
        standby_won.cancel()


async def test_a_campaign_warns_once_per_etcd_outage(
    connect_store: Connect, proxy: TcpProxy, caplog: pytest.LogCaptureFixture
) -> None:
    store = await connect_store(proxy.address, request_timeout_s=0.3)
    caplog.set_level(logging.DEBUG, logger="tidewater.controller.store")

    def said(level: int) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == level]

    proxy.pause()
    campaign = asyncio.create_task(store.campaign(1, "127.0.0.1:9101", 5))
    try:
        async with asyncio.timeout(WAIT_S):
            while len(said(logging.DEBUG)) < 3:  # three more failed attempts
                await asyncio.sleep(0.05)
        proxy.resume()
        assert await won(campaign) == 1
    finally:
        campaign.cancel()
    (warning,) = said(logging.WARNING)
    assert warning.startswith("controller 1 campaign: ")
    assert said(logging.INFO) == ["controller 1 campaign: etcd answers again"]


async def test_lease_expiry_sets_lost_and_the_standby_wins(
    connect_store: Connect, proxy: TcpProxy
) -> None:
    # The first controller reaches etcd through a proxy that the test can partition.
    first = await connect_store(proxy.address, request_timeout_s=1.0)
    standby = await connect_store()
    assert await first.campaign(1, "127.0.0.1:9101", SHORT_TTL_S) == 1
    standby_won = asyncio.create_task(standby.campaign(2, "127.0.0.1:9102", SHORT_TTL_S))
    try:
        proxy.pause()
        await asyncio.wait_for(first.lost.wait(), WAIT_S)
        assert await won(standby_won) == 2
        assert await standby.active_controller() == (2, "127.0.0.1:9102", 2)

        # Healed, the first controller's writes are refused: it was deposed.
        proxy.resume()
        with pytest.raises(NotController):
            await first.write_partitions(1, [("t", 0, None, leader_and_isr(1, 0, [1]))])
        assert await standby.load_partitions() == {}
    finally:
        standby_won.cancel()


async def test_deposed_controller_writes_fail_and_change_nothing(connect_store: Connect) -> None:
    old, new = await connect_store(), await connect_store()
    assert await old.campaign(1, "127.0.0.1:9101", 5) == 1
    [written] = await old.write_partitions(1, [("t", 0, None, leader_and_isr(1, 0, [1, 2]))])
    await old.put_topic(1, "t", {"configs": {}, "assignment": {"0": [1, 2]}})
    await old.resign()
    assert await new.campaign(2, "127.0.0.1:9102", 5) == 2
    topics, partitions = await new.load_topics(), await new.load_partitions()

    with pytest.raises(NotController):
        await old.write_partitions(
            1,
            [
                ("t", 0, written.new_mod_revision, leader_and_isr(2, 1, [2])),
                ("t", 1, None, leader_and_isr(1, 0, [1])),
            ],
        )
    with pytest.raises(NotController):
        await old.put_topic(1, "t", {"configs": {"x": "y"}, "assignment": {"0": [3]}})
    with pytest.raises(NotController):
        await old.delete_topic(1, "t", {"partitions": 1, "pending": [1, 2]})
    with pytest.raises(NotController):
        await old.put_broker(1, 7, {"host": "h", "port": 1})
    with pytest.raises(NotController):
        await old.allocate_producer_ids(1, 1000)

    assert await new.load_topics() == topics
    assert await new.load_partitions() == partitions
    assert await new.load_deletions() == {}
    assert await new.load_brokers() == {}
    assert await new.allocate_producer_ids(2, 1000) == 0


async def test_writes_before_any_election_are_refused(connect_store: Connect) -> None:
    store = await connect_store()
    with pytest.raises(NotController):
        await store.put_topic(0, "t", {"assignment": {}})
    assert await store.active_controller() is None


# -- partition state ---------------------------------------------------------------------------


async def test_stale_partition_epoch_fails_only_that_partition(connect_store: Connect) -> None:
    store = await connect_store()
    epoch = await store.campaign(1, "127.0.0.1:9101", 5)
    created = await store.write_partitions(
        epoch,
        [("t", 0, None, leader_and_isr(1, 0, [1, 2])), ("t", 1, None, leader_and_isr(2, 0, [2]))],
    )
    assert all(r.ok for r in created)
    p1_epoch = created[1].new_mod_revision

    results = await store.write_partitions(
        epoch,
        [
            ("t", 0, created[0].new_mod_revision, leader_and_isr(2, 1, [2])),
            ("t", 1, p1_epoch - 1, leader_and_isr(1, 1, [1])),
            ("t", 2, 12345, leader_and_isr(1, 0, [1])),
        ],
    )

    assert results[0].ok
    assert results[0].new_mod_revision > created[0].new_mod_revision
    assert not results[1].ok
    assert (results[1].new_mod_revision, results[1].current_value) == (
        p1_epoch,
        leader_and_isr(2, 0, [2]),
    )
    assert not results[2].ok
    assert (results[2].new_mod_revision, results[2].current_value) == (0, None)
    assert await store.load_partitions() == {
        ("t", 0): (leader_and_isr(2, 1, [2]), results[0].new_mod_revision),
        ("t", 1): (leader_and_isr(2, 0, [2]), p1_epoch),
    }


async def test_create_of_an_existing_partition_fails(connect_store: Connect) -> None:
    store = await connect_store()
    epoch = await store.campaign(1, "127.0.0.1:9101", 5)
    [first] = await store.write_partitions(epoch, [("t", 0, None, leader_and_isr(1, 0, [1]))])
    [again] = await store.write_partitions(epoch, [("t", 0, None, leader_and_isr(2, 0, [2]))])
    assert not again.ok
    assert (again.new_mod_revision, again.current_value) == (
        first.new_mod_revision,
        leader_and_isr(1, 0, [1]),
    )


async def test_a_retried_identical_write_counts_as_success(connect_store: Connect) -> None:
    store = await connect_store()
    epoch = await store.campaign(1, "127.0.0.1:9101", 5)
    [created] = await store.write_partitions(epoch, [("t", 0, None, leader_and_isr(1, 0, [1]))])
    update = ("t", 0, created.new_mod_revision, leader_and_isr(1, 1, [1, 2]))
    [first] = await store.write_partitions(epoch, [update])

    # The same write again (its answer was lost, say): the partition epoch no longer matches,
    # but etcd already holds exactly this LeaderAndIsr.
    [retried] = await store.write_partitions(epoch, [update])

    assert retried == first
    assert retried.ok
    assert await store.load_partitions() == {
        ("t", 0): (leader_and_isr(1, 1, [1, 2]), first.new_mod_revision)
    }


async def test_a_topic_is_written_with_its_partitions_or_not_at_all(
    connect_store: Connect,
) -> None:
    """A reassignment's step writes the partition's state and the topic's assignment in one
    txn. The topic was written even when the partition's compare failed (review 17 M1): etcd
    held an assignment without a replica its partition's state still named leader. Now the
    topic goes only with its partitions, and a failed compare raises, so the controller
    resigns and its successor loads what etcd holds."""
    store = await connect_store()
    epoch = await store.campaign(1, "127.0.0.1:9101", 5)
    await store.put_topic(epoch, "t", {"configs": {}, "assignment": {"0": [1, 2]}})
    [created] = await store.write_partitions(epoch, [("t", 0, None, leader_and_isr(1, 0, [1]))])
    moved = {"configs": {}, "assignment": {"0": [2]}}
    stale = ("t", 0, created.new_mod_revision - 1, leader_and_isr(2, 1, [2]))
    with pytest.raises(StoreUnavailable, match="t-0"):
        await store.write_partitions(epoch, [stale], topic=("t", moved))
    assert (await store.load_topics())["t"]["assignment"] == {"0": [1, 2]}
    update = ("t", 0, created.new_mod_revision, leader_and_isr(2, 1, [2]))
    [written] = await store.write_partitions(epoch, [update], topic=("t", moved))
    assert written.ok
    assert (await store.load_topics())["t"] == moved
    # With no partitions to write, the topic on its own (a config change that moves no ELR).
    await store.write_partitions(epoch, [], topic=("t", {**moved, "configs": {"a": "b"}}))
    assert (await store.load_topics())["t"]["configs"] == {"a": "b"}


async def test_300_partition_writes_take_the_fewest_txns(connect_store: Connect) -> None:
    store = await connect_store()
    epoch = await store.campaign(1, "127.0.0.1:9101", 5)
    updates = [("big", p, None, leader_and_isr(p % 3, 0, [p % 3])) for p in range(300)]
    txns, ops = store.txns, store.txn_ops

    results = await store.write_partitions(epoch, updates)

    assert all(r.ok for r in results)
    assert store.txns - txns == math.ceil(300 / PARTITIONS_PER_TXN) == math.ceil(300 / 128) == 3
    assert store.txn_ops - ops == 300
    loaded = await store.load_partitions()
    assert {tp: value for tp, (value, _) in loaded.items()} == {
        ("big", p): value for _, p, _, value in updates
    }
    assert {tp: loaded[tp][1] for tp in loaded} == {
        ("big", p): r.new_mod_revision for p, r in enumerate(results)
    }


# -- topics, brokers, producer ids --------------------------------------------------------------


async def test_delete_topic_removes_its_partitions_only(connect_store: Connect) -> None:
    store = await connect_store()
    epoch = await store.campaign(1, "127.0.0.1:9101", 5)
    for name in ("orders", "orders2"):
        await store.put_topic(epoch, name, {"configs": {}, "assignment": {"0": [1], "1": [2]}})
        await store.write_partitions(
            epoch, [(name, p, None, leader_and_isr(p + 1, 0, [p + 1])) for p in (0, 1)]
        )

    deletion = {"partitions": 2, "pending": [1, 2]}
    assert await store.delete_topic(epoch, "orders", deletion)
    assert not await store.delete_topic(epoch, "orders", deletion)

    assert list(await store.load_topics()) == ["orders2"]
    assert sorted(await store.load_partitions()) == [("orders2", 0), ("orders2", 1)]
    # Pending until every replica's broker has deleted its logs.
    assert await store.load_deletions() == {"orders": deletion}
    await store.put_deletion(epoch, "orders", {"partitions": 2, "pending": [2]})
    assert await store.load_deletions() == {"orders": {"partitions": 2, "pending": [2]}}
    await store.put_deletion(epoch, "orders", None)
    assert await store.load_deletions() == {}


async def test_broker_registrations_get_growing_epochs(connect_store: Connect) -> None:
    store = await connect_store()
    epoch = await store.campaign(1, "127.0.0.1:9101", 5)
    first = await store.put_broker(epoch, 1, {"host": "127.0.0.1", "port": 9201})
    second = await store.put_broker(epoch, 2, {"host": "127.0.0.1", "port": 9202})
    again = await store.put_broker(epoch, 1, {"host": "127.0.0.1", "port": 9301})
    assert first < again

    assert await store.load_brokers() == {
        1: {"host": "127.0.0.1", "port": 9301, "epoch": again},
        2: {"host": "127.0.0.1", "port": 9202, "epoch": second},
    }
    assert await store.delete_broker(epoch, 2)
    assert list(await store.load_brokers()) == [1]


async def test_producer_id_blocks_never_overlap(connect_store: Connect) -> None:
    a, b = await connect_store(), await connect_store()
    epoch = await a.campaign(1, "127.0.0.1:9101", 5)

    # Two connections allocating at once race on the same key.
    firsts = await asyncio.gather(
        *(store.allocate_producer_ids(epoch, 100) for _ in range(15) for store in (a, b))
    )
    assert sorted(firsts) == [100 * i for i in range(30)]

    # A new controller continues after the last block.
    await a.resign()
    assert await b.campaign(2, "127.0.0.1:9102", 5) == 2
    assert await b.allocate_producer_ids(2, 1000) == 3000
    assert await b.allocate_producer_ids(2, 1000) == 4000


async def test_values_are_json_readable_with_etcdctl(
    connect_store: Connect, etcd: EtcdProcess, cluster_name: str
) -> None:
    store = await connect_store()
    # A long lease: a loaded machine that misses a keepalive must not drop the controller key.
    epoch = await store.campaign(3, "127.0.0.1:9103", 60)
    await store.put_topic(epoch, "t", {"configs": {}, "assignment": {"0": [1]}})
    await store.write_partitions(epoch, [("t", 0, None, leader_and_isr(1, 0, [1], epoch))])
    await store.allocate_producer_ids(epoch, 1000)

    lines = subprocess.run(
        [
            str(ETCD_BINARY.with_name("etcdctl")),
            f"--endpoints={etcd.endpoint}",
            "get",
            "--prefix",
            f"/tidewater/{cluster_name}/",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    ).stdout.splitlines()

    prefix = f"/tidewater/{cluster_name}/"
    stored = {
        key.removeprefix(prefix): json.loads(value)
        for key, value in zip(lines[0::2], lines[1::2], strict=True)
    }
    assert stored == {
        "controller": {"id": 3, "endpoint": "127.0.0.1:9103"},
        "controller_epoch": 1,
        "partitions/t/0": leader_and_isr(1, 0, [1], 1),
        "producer_ids": 1000,
        "topics/t": {"configs": {}, "assignment": {"0": [1]}},
    }


async def test_connect_fails_over_to_a_live_endpoint(etcd: EtcdProcess, cluster_name: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    store = await ControllerStore.connect([dead, etcd.endpoint], cluster_name)
    try:
        assert await store.campaign(1, "127.0.0.1:9101", 5) == 1
    finally:
        await store.close()


# -- the etcd process --------------------------------------------------------------------------


async def test_etcd_process_pauses_restarts_and_cleans_up() -> None:
    with EtcdProcess() as process:
        pid, data_dir = process.pid, process.data_dir
        store = await ControllerStore.connect([process.endpoint], request_timeout_s=1.0)
        try:
            epoch = await store.campaign(1, "127.0.0.1:9101", 30)
            await store.put_topic(epoch, "kept", {"assignment": {}})

            process.pause()
            try:
                with pytest.raises(StoreUnavailable):
                    await store.load_topics()
            finally:
                process.resume()
            assert await store.load_topics() == {"kept": {"assignment": {}}}

            # A crash and a restart: same endpoint, same data.
            await store.resign()
            process.kill()
            process.start()
            assert await store.load_topics() == {"kept": {"assignment": {}}}
            restarted_pid = process.pid
        finally:
            await store.close()

    assert restarted_pid != pid
    for gone in (pid, restarted_pid):
        with pytest.raises(ProcessLookupError):
            os.kill(gone, 0)
    assert not data_dir.exists()


async def test_a_load_larger_than_grpcs_default_message_limit_succeeds(
    connect_store: Connect,
) -> None:
    """Review 34 #1: gRPC's default 4 MiB answer limit made the load of a cluster past ~28,000
    partitions fail (RESOURCE_EXHAUSTED), and every controller resigned and campaigned again
    in a loop. Here six topic records of ~0.9 MiB each, 5.5 MiB in one answer."""
    store = await connect_store()
    epoch = await store.campaign(1, "127.0.0.1:9101", 5)
    assignment = {str(p): [1, 2, 3] for p in range(55_000)}
    for i in range(6):
        await store.put_topic(epoch, f"big-{i}", {"configs": {}, "assignment": assignment})
    topics = await store.load_topics()
    assert sorted(topics) == [f"big-{i}" for i in range(6)]


async def test_a_topic_written_with_many_partitions_goes_in_the_first_txn(
    connect_store: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 34 #3: past etcd's ops per txn the topic's value went with the last updates,
    so a failover between txns could keep the old min.insync.replicas with ELRs cleared for
    the new one. Cut short after the first txn now, the value is written with its updates."""
    store = await connect_store()
    epoch = await store.campaign(1, "127.0.0.1:9101", 5)
    updates = [("t", p, None, leader_and_isr(1, 0, [1])) for p in range(PARTITIONS_PER_TXN + 5)]
    write_chunk = store._write_partition_chunk
    written: list[int] = []

    async def failing_after_one(*args: Any) -> Any:
        if written:
            raise StoreUnavailable("etcd txn: a test")
        written.append(1)
        return await write_chunk(*args)

    monkeypatch.setattr(store, "_write_partition_chunk", failing_after_one)
    with pytest.raises(StoreUnavailable):
        await store.write_partitions(epoch, updates, ("t", {"configs": {"x": "1"}}))
    assert (await store.load_topics())["t"]["configs"] == {"x": "1"}
    assert len(await store.load_partitions()) == PARTITIONS_PER_TXN


async def test_an_etcd_member_whose_name_does_not_resolve_is_left_out(
    etcd: EtcdProcess, cluster_name: str
) -> None:
    """Review 37 #2: one member's name gone from DNS stopped every controller from starting,
    though the other members were up."""
    store = await ControllerStore.connect([etcd.endpoint, "member-2.invalid:2379"], cluster_name)
    try:
        assert await store.campaign(1, "127.0.0.1:9101", 5) >= 1
    finally:
        await store.close()
    with pytest.raises(StoreUnavailable, match=r"member-2\.invalid:2379.*member-3\.invalid:2379"):
        await ControllerStore.connect(["member-2.invalid:2379", "member-3.invalid:2379"], "x")


async def test_a_campaign_finding_the_key_held_by_itself_revokes_that_lease(
    connect_store: Connect,
) -> None:
    """Review 34 #6: an election txn applied whose answer was lost (or this controller's
    previous life, restarted) left the key under a lease nobody kept alive; the campaign
    waited it out, a whole TTL, while everyone named this controller as active."""
    previous, restarted = await connect_store(), await connect_store()
    assert await previous.campaign(1, "127.0.0.1:9101", 30) == 1
    # Well within the 30 s TTL it would have waited out.
    epoch = await asyncio.wait_for(restarted.campaign(1, "127.0.0.1:9101", 30), 10)
    assert epoch == 2
    # The previous life, were it still running, hears of it at its next keepalive.
    await asyncio.wait_for(previous.lost.wait(), 25)
