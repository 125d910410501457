"""Epoch-driven replication scenarios on the simulated cluster. Each ends by checking what a
user relies on: no acknowledged record is lost, and every replica holds the same batches
(offsets, leader epochs, payloads)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.replication.in_memory import Batch, Cluster


def assert_no_acked_record_lost(c: Cluster) -> None:
    """Every acks=all batch that was acknowledged is on every live replica, unless retention
    deleted it."""
    for broker in c.live:
        log = broker.log
        for batch in c.acked:
            if batch.last_offset >= log.log_start_offset:
                assert batch in log.batches, f"broker {broker.broker_id} lost {batch}"


def assert_logs_identical(c: Cluster) -> None:
    logs = c.logs()
    leader_log = logs[c.state.leader]
    assert all(log == leader_log for log in logs.values()), logs


def payloads(c: Cluster) -> set[str]:
    return {r for broker in c.live for batch in broker.log.batches for r in batch.payload}


@dataclass
class Consumer:
    """Reads from the leader up to its HW, from where it left off, as a client does."""

    position: int = 0
    seen: list[Batch] = field(default_factory=list)

    def poll(self, c: Cluster) -> None:
        leader = c.leader
        assert self.position <= leader.log.log_end_offset, "the leader lacks what was read"
        for batch in leader.log.read(self.position, max_offset=leader.partition.high_watermark):
            assert batch.base_offset == self.position
            self.seen.append(batch)
            self.position = batch.last_offset + 1


def test_basic_workflow() -> None:
    c = Cluster(3)
    c.elect(1)
    batches = [c.produce(f"m{i}") for i in range(3)]
    assert c.acked == []

    # Round 1: the followers copy the batches; the leader learns they have them only when
    # they ask for more.
    c.fetch(2)
    c.fetch(3)
    assert c.brokers[2].log.batches == c.brokers[3].log.batches == batches
    assert c.leader.partition.high_watermark == 0

    # Round 2: the HW moves once every ISR member has reported, and the produces complete.
    c.fetch(2)
    assert c.leader.partition.high_watermark == 0
    c.fetch(3)
    assert c.leader.partition.high_watermark == 3
    assert c.acked == batches
    assert c.brokers[3].partition.high_watermark == 3
    assert c.brokers[2].partition.high_watermark == 0

    # Round 3: the followers' HWs follow the leader's.
    c.fetch(2)
    assert c.brokers[2].partition.high_watermark == 3
    assert_logs_identical(c)


def test_acks_all_waits_for_a_dead_follower_until_it_leaves_the_isr() -> None:
    c = Cluster(3)
    lag = c.config.replica_lag_time_max_ms
    c.elect(1)
    c.produce("a")
    c.replicate()
    c.crash(3)
    b = c.produce("b")
    c.replicate()
    assert b not in c.acked, "3 is still in the ISR and does not have b"
    c.advance(lag)
    c.check_isr()
    assert b not in c.acked
    c.advance(1)
    c.check_isr()
    assert c.state.isr == (1, 2)
    assert c.acked[-1] == b


def test_no_divergent_logs_after_a_leader_change_while_followers_lag() -> None:
    c = Cluster(3)
    c.elect(1)
    c.produce("a")
    c.produce("b")
    c.replicate()
    c.produce("c", acks=1)
    c.fetch(2)  # only 2 copies c
    c.produce("d", acks=1)  # only the leader has d
    c.crash(1)
    c.elect(3)  # 3 has neither c nor d
    c.produce("e")
    c.replicate()  # 2 finds its c diverges, drops it, copies e
    c.restart(1)
    c.replicate()  # so does 1 with c and d

    assert [b.payload for b in c.acked] == [("a",), ("b",), ("e",)]
    assert_no_acked_record_lost(c)
    assert_logs_identical(c)
    assert payloads(c) == {"a", "b", "e"}
    assert c.state.isr == (1, 2, 3)


def test_consumer_offsets_never_go_backwards_across_leader_changes() -> None:
    c = Cluster(3)
    consumer = Consumer()
    steps = [
        lambda: c.elect(1),
        lambda: c.produce("a"),
        lambda: c.produce("b"),
        c.replicate,
        lambda: c.produce("c", acks=1),
        lambda: c.fetch(2),
        lambda: c.elect(3),  # 3 lacks c, which 1 and 2 hold beyond the HW
        lambda: c.produce("d"),
        lambda: c.fetch(1),
        c.replicate,
        lambda: c.produce("e", acks=1),
        lambda: c.fetch(1),
        lambda: c.elect(2),  # 2 lacks e
        lambda: c.produce("f"),
        c.replicate,
        lambda: c.elect(1),
        lambda: c.produce("g"),
        c.replicate,
    ]
    for step in steps:
        step()
        consumer.poll(c)

    # It read everything, in order, and nothing it read was replaced afterwards.
    assert consumer.seen == c.leader.log.batches
    assert [b.payload for b in consumer.seen] == [("a",), ("b",), ("d",), ("f",), ("g",)]
    assert_no_acked_record_lost(c)
    assert_logs_identical(c)


def test_survives_a_fast_leader_change() -> None:
    c = Cluster(3)
    c.elect(1)
    for i in range(4):
        c.produce(f"m{i}")
    c.replicate()
    c.produce("m4", acks=1)
    c.produce("m5", acks=1)
    c.fetch(2)  # 2 copies m4 and m5; 3 stays at 4
    c.crash(1, lose_from=4)  # 1 never flushed m4 and m5
    c.elect(3)  # epoch 1 starts at 4
    c.produce("x", acks=1)  # 3 writes x at 4, alone
    c.crash(3)
    c.elect(2)  # epoch 2 starts at 6: 2 never heard of epoch 1
    y = c.produce("y")
    c.restart(1)
    c.restart(3)
    assert c.brokers[3].log.batches[4].payload == ("x",)
    assert c.leader.log.batches[4].payload == ("m4",)

    c.replicate()

    assert c.acked[-1] == y
    assert_no_acked_record_lost(c)
    assert_logs_identical(c)
    assert "x" not in payloads(c)
    assert c.state.isr == (1, 2, 3)


def test_follower_truncates_epoch_by_epoch_after_quick_leader_changes() -> None:
    c = Cluster(3)
    c.elect(1)  # epoch 0 writes 0..3 everywhere
    for i in range(4):
        c.produce(f"m{i}")
    c.replicate()
    # Four leader changes with nobody fetching: each leader writes alone.
    writes = {2: ["b0", "b1", "b2"], 1: [f"a{i}" for i in range(8)]}
    for leader in (2, 1):  # epoch 1 on 2 at 4..6, epoch 2 on 1 at 4..11
        c.elect(leader)
        for record in writes[leader]:
            c.produce(record, acks=1)
    c.elect(2)  # epoch 3 on 2 at 7..8
    c.produce("b3", acks=1)
    c.produce("b4", acks=1)
    c.elect(1)  # epoch 4 on 1 from 12
    c.produce("a8", acks=1)
    c.produce("a9", acks=1)

    # 2 (epochs 0, 1, 3) asks about 3: the leader (epochs 0, 2, 4) answers epoch 2, which 2
    # never had, so 2 cuts epoch 3 and asks about epoch 1; epoch 0 is where they agree.
    ends = []
    for _ in range(3):
        c.fetch(2)
        ends.append(c.brokers[2].log.log_end_offset)
    assert ends == [7, 4, 14]

    c.replicate()
    assert_no_acked_record_lost(c)
    assert_logs_identical(c)
    assert not any(r.startswith("b") for r in payloads(c))


def test_follower_behind_the_leaders_log_start_starts_over_there() -> None:
    c = Cluster(2)
    c.elect(1)
    for i in range(4):
        c.produce(f"m{i}")
    c.replicate()
    c.crash(2)
    c.produce("n0")
    c.advance(c.config.replica_lag_time_max_ms + 1)
    c.check_isr()
    for i in range(1, 4):
        c.produce(f"n{i}")
    c.leader.log.advance_log_start(6)  # retention deleted 0..5
    c.restart(2)  # its log ends at 4
    c.replicate()

    assert c.logs()[2][0] == 6
    assert [b.payload for b in c.brokers[2].log.batches] == [("n2",), ("n3",)]
    assert_no_acked_record_lost(c)
    assert_logs_identical(c)
    assert c.state.isr == (1, 2)


def test_the_earliest_offset_does_not_move_back_when_a_follower_takes_over() -> None:
    c = Cluster(2)
    c.elect(1)
    c.produce("m0", "m1", "m2")
    c.produce("m3", "m4", "m5")
    c.produce("m6", "m7")
    c.replicate()
    c.leader.log.advance_log_start(6)  # the leader's retention deleted the first two batches
    c.replicate()  # an idle partition: the answers carry the log start offset alone
    assert c.logs()[2][0] == 6
    c.elect(2)
    assert c.leader.log.log_start_offset == 6
    assert_logs_identical(c)


def test_no_message_loss_after_a_follower_restart_and_a_leader_failure() -> None:
    # The first anomaly of HW-based truncation (002_b247bb521d694d9c.txt, KIP-101):
    # 1. A (1) leads, B (2) follows. m0 and m1 are produced with acks=all.
    # 2. B copies m1, and on its next fetch the leader's HW reaches 2: m1 is acknowledged.
    #    B's HW on disk is still 1: the periodic checkpoint ran before it learned of 2.
    # 3. B restarts. With HW-based truncation it would cut its log to that HW, dropping m1.
    # 4. A fails before B fetches again; B is elected (it is in the ISR).
    # 5. A comes back as a follower and must copy B: with HW-based truncation m1, acknowledged,
    #    is gone from both. With leader epochs B keeps m1 at restart, its epoch 1 starts at 2,
    #    and A, whose epoch 0 ends at 2 as B's does, keeps m1 too.
    c = Cluster(2)
    c.elect(1)
    m0 = c.produce("m0")
    c.replicate()
    m1 = c.produce("m1")
    c.fetch(2)
    c.checkpoint_high_watermarks()
    c.fetch(2)
    assert c.acked == [m0, m1]

    c.crash(2)
    c.restart(2)
    b = c.brokers[2]
    assert b.partition.high_watermark == 1 and m1 in b.log.batches, "stale HW, m1 kept"
    c.crash(1)
    c.elect(2)
    c.restart(1)
    c.replicate()
    m2 = c.produce("m2")
    c.replicate()

    assert c.acked == [m0, m1, m2]
    assert_no_acked_record_lost(c)
    assert_logs_identical(c)
    assert c.state.isr == (1, 2)


def test_no_divergence_after_every_replica_restarts() -> None:
    # The second anomaly of HW-based truncation (002_b247bb521d694d9c.txt, KIP-101):
    # 1. A (1) leads, B (2) follows. m0 and m1 are produced with acks=all and committed; B
    #    last checkpointed HW 1, A checkpointed 2.
    # 2. x is produced with acks=1: A writes it at 2, B copies it; the HW stays at 2. Then
    #    x2 (acks=1) at 3, on A only.
    # 3. Power failure: both crash and lose their unflushed tails: A loses x2, B loses x.
    # 4. B comes back first and is elected; y is produced at the next free offset.
    # 5. A comes back holding x at offset 2, where B holds y: different data at one offset.
    #    With HW-based truncation, B would have cut m1 at its restart (its HW said 1) and
    #    written y at 1, and A, whose HW is 2, would keep m1 there: divergent logs for good,
    #    and an acknowledged record lost. With leader epochs, B keeps m1; A learns that epoch
    #    0 ended at 2 on the leader and drops x; the logs end identical.
    c = Cluster(2)
    c.elect(1)
    m0 = c.produce("m0")
    c.replicate()
    m1 = c.produce("m1")
    c.fetch(2)
    c.checkpoint_high_watermarks(2)
    c.fetch(2)
    c.checkpoint_high_watermarks(1)
    assert c.acked == [m0, m1]
    c.produce("x", acks=1)
    c.fetch(2)
    c.produce("x2", acks=1)

    c.crash(1, lose_from=3)
    c.crash(2, lose_from=2)
    c.restart(2)
    assert c.brokers[2].partition.high_watermark == 1
    c.elect(2)
    y = c.produce("y")
    c.restart(1)
    a, b = c.brokers[1], c.brokers[2]
    assert a.partition.high_watermark == 2
    assert (a.log.batches[2].payload, b.log.batches[2].payload) == (("x",), ("y",))

    c.replicate()

    assert c.acked == [m0, m1, y]
    assert_no_acked_record_lost(c)
    assert_logs_identical(c)
    assert payloads(c) == {"m0", "m1", "y"}


def test_no_acked_record_lost_when_the_answer_to_an_isr_expansion_is_lost() -> None:
    c = Cluster(2)
    c.elect(1)
    c.produce("m0")
    c.advance(c.config.replica_lag_time_max_ms + 1)
    c.check_isr()
    assert c.state.isr == (1,)
    # 2 catches up; the controller commits {1, 2}, but its answer never reaches the leader.
    c.answers_to_lose = 1
    c.fetch(2)
    c.fetch(2)
    assert c.state.isr == (1, 2)
    # 2 stops fetching for longer than the lag time. Writes meanwhile are committed only once
    # 2 has them: the controller may elect 2 cleanly.
    written = [c.produce("m1")]
    c.advance(c.config.replica_lag_time_max_ms + 1)
    written.append(c.produce("m2"))
    assert not set(written) & set(c.acked)
    c.retry_alter_isr()
    assert (c.leader.partition.isr, c.leader.partition.partition_epoch) == (
        set(c.state.isr),
        c.state.partition_epoch,
    )
    c.crash(1)
    c.elect(2)
    assert_no_acked_record_lost(c)
