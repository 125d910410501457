"""The model check of the replication and controller rules (tests/model/replication_model.py):
whatever happens in whatever order, nothing committed or acknowledged is lost.

The default run is the same examples every time, about ten seconds; longer, with new examples
every run: TIDEWATER_MODEL_EXAMPLES=2000 pytest tests/model (README, Tests and their
helpers)."""

from __future__ import annotations

import pytest
from hypothesis.stateful import run_state_machine_as_test

from tests.model.replication_model import (
    EXAMPLES_ON_DEMAND,
    Replay,
    ReplicationModel,
    model_settings,
)

# A run on demand takes as long as its examples do.
pytestmark = [pytest.mark.timeout(0)] if EXAMPLES_ON_DEMAND else []


def test_no_committed_or_acknowledged_record_is_lost() -> None:
    run_state_machine_as_test(ReplicationModel, settings=model_settings())


def test_a_min_isr_raise_before_the_leader_has_it_loses_nothing() -> None:
    """Review 12's bug, as the machine found it (shrunk by hand): the controller takes the
    raise at once, the leader later. Its ISR shrink commits the followers into the ELR by the
    new value; the leader, still at 1, advanced the HW alone past them until it learned the
    ELR with the ISR (the AlterIsr answer's)."""
    state = Replay()
    state.create_cluster(min_insync_replicas=1)
    state.set_min_insync_replicas(value=2)
    (request,) = state.time_passes(ms=1500).values
    answer = state.controller_handles_alter_isr(request=request, answer_lost=False)
    state.leader_gets_alter_isr_answer(answer=answer)
    state.produce(broker=1, acks_all=True)
    assert state.machine.controller.record.elr == (2, 3)


def test_a_reassignment_no_target_could_lead_yet_stays_in_flight() -> None:
    """Found by the machine with reassignments (shrunk by hand): a new controller that has not
    heard from any broker yet takes a reassignment whose target is in the ISR already. Its
    completion must move the leadership off the fenced leader and finds no target that could
    lead: complete_reassignment raised NO_REPLICA_ONLINE after the start had committed (the
    operator was told it failed; an AlterIsr whose ISR change committed was answered with the
    error). It stays in flight now, and completes once the grace period is over."""
    state = Replay()
    state.create_cluster(min_insync_replicas=1)
    state.controller_fails_over(heartbeats=[])
    state.reassign(replicas=(1,), controller_fails="")
    controller = state.machine.controller
    assert controller.model.topics["orders"].reassignments
    state.grace_period_ends()
    assert not controller.model.topics["orders"].reassignments
    assert (controller.replicas, controller.record.isr) == ((1,), (1,))


def test_a_cancel_cut_short_leaves_no_dropped_replica_leading() -> None:
    """Found by the machine with reassignments (shrunk by hand), when a cancel was three
    writes: the first dropped the replicas it was adding from the assignment, the second took
    them out of the leadership and ISR. A failover between the two left broker 4, dropped,
    leading with ISR [3, 4]; broker 3 stopped in the grace period, which ended by fencing it
    (ISR [4]), and nobody could move 4's leadership; once it restarted, the stray log rule
    deleted its log, the only ISR member's. A cancel is one txn now (review 15 L1): cut short
    after it, 4 is out of the assignment, the leadership and the ISR together, and broker 3
    leads. The StopReplica never reached 4: the next controller's FULL view, once 4
    heartbeats, finds its log stray."""
    state = Replay()
    state.create_cluster(min_insync_replicas=1)
    state.reassign(replicas=(4, 2), controller_fails="")
    for broker in (1, 3, 4):
        state.deliver_control_messages(broker=broker, all_queued=True)
    for follower in (None, 3, 4):  # the ISR shrinks to [1], then 3 and 4 join
        if follower is None:
            (request,) = state.time_passes(ms=1500).values
        else:
            (request,) = state.fetch(follower=follower).values
        answer = state.controller_handles_alter_isr(request=request, answer_lost=False)
        state.leader_gets_alter_isr_answer(answer=answer)
    state.stop(broker=1, how="kill", lose_unflushed=0)
    state.session_expires(broker=1)  # broker 4 leads, ISR [3, 4]
    state.reassign(replicas=None, controller_fails="starting")
    controller = state.machine.controller
    assert (controller.replicas, controller.record.leader, controller.record.isr) == (
        (1, 2, 3),
        3,
        (3,),
    )
    assert not controller.model.topics["orders"].reassignments
    assert state.machine.brokers[4].partition is not None
    state.heartbeat(broker=4)
    state.deliver_control_messages(broker=4, all_queued=True)
    assert state.machine.brokers[4].partition is None
