"""The model check catches broken rules. Each test breaks one rule the way a plausible bug
would (monkeypatch) and replays through the machine the story Hypothesis found for it (shrunk,
its bundle values unpacked): the story passes with the rule intact and fails an invariant with
it broken. On demand, the search finds the first in random examples too:
TIDEWATER_MODEL_EXAMPLES=3000 runs test_the_search_catches_a_resent_state_taken_as_news (found
in 64 s on 2026-11-24; README, Tests and their helpers). It finds the second rarely: in one
run of four of 2,000 examples. The third (a reassignment completing too soon) it finds at
once: test_the_search_catches_a_reassignment_completed_too_soon (16 s on 2026-11-24).

Not caught, and why (review 12's other broken variants):
- a lower min.insync.replicas that clears no ELR (core.elr_changes_for_configs returning
  nothing): since the leaders hold the HW while the ELR committed with their ISR is not empty,
  a stale ELR stalls the HW until the next ISR change, and loses nothing;
- a leader that stays leader in a new leader epoch and resets nothing (its followers' fetch
  state, its epoch start offset): its epoch cache gets the new epoch at its next append
  anyway, and the followers' old catch-up times only make the ISR shrink sooner or later."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis.stateful import run_state_machine_as_test

from tests.model import replication_model
from tests.model.replication_model import (
    EXAMPLES_ON_DEMAND,
    Replay,
    ReplicationModel,
    model_settings,
)
from tidewater.controller import core
from tidewater.controller.model import ClusterModel, TopicPartition
from tidewater.errors import TidewaterError
from tidewater.replication.partition import AlterIsrProposal, IsrState, LeaderAndIsr, Partition

Story = Callable[[Replay], None]


def accept_the_same_partition_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    """check_newer takes the state a replica has (a resend) as news: a leader's proposal in
    flight is superseded by its own state again."""
    check_newer = Partition.check_newer

    def broken(self: Partition, state: LeaderAndIsr) -> None:
        same = (state.leader, state.leader_epoch, state.partition_epoch)
        if same != (self.leader, self.leader_epoch, self.partition_epoch):
            check_newer(self, state)

    monkeypatch.setattr(Partition, "check_newer", broken)


def apply_superseded_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """An AlterIsr answer is applied in the leader epoch it names even after a LeaderAndIsr
    superseded the proposal (its state may be older than the one applied since)."""
    on_alter_isr_result = Partition.on_alter_isr_result

    def broken(
        self: Partition,
        proposal: AlterIsrProposal,
        committed: LeaderAndIsr | None,
        error: TidewaterError | None,
        now_ms: int,
    ) -> bool:
        if committed is None or not self.is_leader or committed.leader_epoch != self.leader_epoch:
            return on_alter_isr_result(self, proposal, committed, error, now_ms)
        self.isr_state = IsrState(
            frozenset(committed.isr), committed.partition_epoch, elr=committed.elr
        )
        return self.maybe_increment_high_watermark(now_ms)

    monkeypatch.setattr(Partition, "on_alter_isr_result", broken)


def complete_before_every_target_is_in_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """complete_reassignment waits for one target in the ISR, not every one: the others
    become the replicas without the committed records."""
    complete_reassignment = core.complete_reassignment

    def broken(
        model: ClusterModel, tp: TopicPartition, controller_epoch: int, *, in_grace: bool = False
    ) -> core.ReassignmentStep | None:
        record = model.partitions[tp]
        target = model.topics[tp[0]].reassignments[tp[1]].target
        if not set(target) & set(record.isr):
            return None
        # The rule as if every target were in the ISR; those that are not stay out of it.
        model.partitions[tp] = record.with_(isr=tuple(dict.fromkeys(record.isr + target)))
        try:
            step = complete_reassignment(model, tp, controller_epoch, in_grace=in_grace)
        finally:
            model.partitions[tp] = record
        if step is None:
            return None
        after = step.change.after
        isr = tuple(b for b in after.isr if b in record.isr)
        change = replace(step.change, before=record, after=after.with_(isr=isr))
        return replace(step, change=change)

    monkeypatch.setattr(core, "complete_reassignment", broken)


def resent_state_supersedes_a_proposal(state: Replay) -> None:
    state.create_cluster(min_insync_replicas=2)
    (request,) = state.time_passes(ms=1500).values
    state.set_min_insync_replicas(value=1)
    answer = state.controller_handles_alter_isr(answer_lost=False, request=request)
    state.leader_gets_alter_isr_answer(answer=answer)
    (request,) = state.fetch(follower=2).values
    state.controller_fails_over(heartbeats=[])
    state.heartbeat(broker=1)
    state.deliver_control_messages(all_queued=False, broker=1)
    state.produce(acks_all=False, broker=1)
    state.deliver_control_messages(all_queued=False, broker=1)
    state.heartbeat(broker=2)
    state.controller_handles_alter_isr(answer_lost=False, request=request)


def answer_arrives_after_a_newer_state(state: Replay) -> None:
    state.create_cluster(min_insync_replicas=2)
    state.produce(acks_all=False, broker=1)
    (request,) = state.time_passes(ms=1500).values
    answer = state.controller_handles_alter_isr(answer_lost=False, request=request)
    state.set_min_insync_replicas(value=1)
    state.deliver_control_messages(all_queued=False, broker=1)
    state.leader_gets_alter_isr_answer(answer=answer)


def a_reassignment_adds_a_replica_after_a_commit(state: Replay) -> None:
    state.create_cluster(min_insync_replicas=1)
    state.produce(acks_all=False, broker=1)
    for follower in (2, 3, 2, 3):  # the second fetches tell the leader they hold r1
        state.fetch(follower=follower)
    state.reassign(replicas=(1, 4), controller_fails="")


# Each broken rule, a story that shows it, and the invariant's words when it does (the story
# must fail for that reason, not another assertion's).
BROKEN_RULES = [
    (
        accept_the_same_partition_epoch,
        resent_state_supersedes_a_proposal,
        "ISR member 2 .* lacks the committed offsets",
    ),
    (
        apply_superseded_answers,
        answer_arrives_after_a_newer_state,
        "partition epoch moved back",
    ),
    (
        complete_before_every_target_is_in_sync,
        a_reassignment_adds_a_replica_after_a_commit,
        "completed while its target 4 lacks the committed offsets",
    ),
]


def replay(story: Story) -> None:
    story(Replay())


def lower_values(machine: ReplicationModel) -> list[int]:
    return list(range(1, machine.controller.min_insync_replicas))


@pytest.mark.parametrize(("break_rule", "story", "invariant"), BROKEN_RULES)
def test_the_story_passes_with_the_rules_intact(
    break_rule: object, story: Story, invariant: str
) -> None:
    replay(story)


@pytest.mark.parametrize(("break_rule", "story", "invariant"), BROKEN_RULES)
def test_the_story_fails_with_the_rule_broken(
    break_rule: Callable[[pytest.MonkeyPatch], None],
    story: Story,
    invariant: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    break_rule(monkeypatch)
    with pytest.raises(AssertionError, match=invariant):
        replay(story)


@pytest.mark.skipif(not EXAMPLES_ON_DEMAND, reason="on demand: TIDEWATER_MODEL_EXAMPLES")
@pytest.mark.timeout(0)  # as long as its examples take
def test_the_search_catches_a_resent_state_taken_as_news(monkeypatch: pytest.MonkeyPatch) -> None:
    accept_the_same_partition_epoch(monkeypatch)
    # Lowered only: the broken rule shows in the changes of the ISR or ELR alone that a lower
    # value makes; a raise holds the leaders' HW (the ELR) and takes examples from the search.
    monkeypatch.setattr(replication_model, "new_min_insync_replicas", lower_values)
    # Nor reassignments: the broken rule shows without them, and they take steps from it.
    monkeypatch.setattr(replication_model, "MAX_REASSIGNMENTS", 0)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(ReplicationModel, settings=model_settings())


@pytest.mark.skipif(not EXAMPLES_ON_DEMAND, reason="on demand: TIDEWATER_MODEL_EXAMPLES")
@pytest.mark.timeout(0)  # as long as its examples take
def test_the_search_catches_a_reassignment_completed_too_soon(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    complete_before_every_target_is_in_sync(monkeypatch)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(ReplicationModel, settings=model_settings())
