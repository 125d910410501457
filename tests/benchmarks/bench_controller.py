"""Controller failover times on a real cluster: etcd, two controller processes and three broker
processes on loopback, each scenario on a fresh cluster (its own etcd prefix and processes).

    .venv/bin/python tests/benchmarks/bench_controller.py [--partitions 100,1000]
        [--controller-partitions 100] [--lease-ttl 2] [--only broker,controller]
        [--work-dir DIR]

- broker: broker.session.timeout.ms 1000 on the controllers, heartbeats every 200 ms; a topic
  of N partitions, RF=3, leaders spread; kill -9 the broker leading most of them and poll etcd
  every 20 ms until none names it leader. Goal: under 2 s, growing less than linearly with N.
- controller: kill -9 the active controller, then at once a broker (so the new controller has
  leaders to elect); time until etcd names the new controller, until the new controller's first
  LeaderAndIsr is accepted by a broker (its log), and until the broker's partitions have new
  leaders in etcd. Goal: first accepted LeaderAndIsr within lease TTL + 0.5 s.

Before each kill the cluster is settled: every broker alive, every partition led by its
preferred replica with a full ISR, and every broker's log showing it applied each partition's
current leader epoch (a preferred election is run if a setup hiccup moved leaders). Topics are
created while the controllers run with a 30 s session timeout, and the controllers are then
restarted with 1 s: a broker applying LeaderAndIsr for 1,000 new partitions does not heartbeat
for longer than 1 s, so under a 1 s timeout from the start the cluster never settles (brokers
are fenced, partitions go offline and come back, over and over).

Where the time went comes from the processes' own log timestamps (millisecond resolution, same
clock as the kill time). Every child is killed on the way out; with --work-dir the logs are
kept there.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from tidewater.broker.controller_client import ControllerClient
from tidewater.controller.store import PARTITIONS_PER_TXN, ControllerStore
from tidewater.local.etcd import EtcdProcess
from tidewater.local.process import ManagedProcess, broker_process, controller_args
from tidewater.local.wait import eventually
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode

CONTROLLERS = (1, 2)
# RF=3 on three brokers: every broker hosts every partition.
BROKERS = (1, 2, 3)
SESSION_TIMEOUT_MS = 1000
# Topics are created under this session timeout: see create_topic.
SETUP_SESSION_TIMEOUT_MS = 30_000
HEARTBEAT_MS = 200
BROKER_SETTINGS = {"broker.heartbeat.interval.ms": str(HEARTBEAT_MS)}
TOPIC = "bench"
NO_LEADER = -1
POLL_S = 0.02
# Settling reads every broker log; slower polling leaves the CPU to the brokers.
SETTLE_POLL_S = 0.25
MAX_PREFERRED_ELECTIONS = 3
BROKER_GOAL_S = 2.0
CONTROLLER_GOAL_MARGIN_S = 0.5
SETUP_TIMEOUT_S = 180.0
FAILOVER_TIMEOUT_S = 30.0
SECTIONS = ("broker", "controller")

LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ [\w.]+: (.*)$")
ACCEPTED = re.compile(r"LeaderAndIsr for (\d+) partitions accepted by broker (\d+)")
BECAME = re.compile(rf"became (?:leader|follower) of {TOPIC}-(\d+) at epoch (\d+)")
# Controller log lines that show where failover time goes.
MILESTONES = re.compile(
    r"is active at epoch|fencing broker|is alive|LeaderAndIsr|lease .* lost|refused|"
    r"UNCLEAN|lost a race"
)

States = dict[int, dict[str, Any]]
Events = list[tuple[float, str]]


# -- waiting and logs --------------------------------------------------------------------------


def log_size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def log_events(path: Path, since: int) -> Events:
    """(wall-clock time, message) of each log line written after byte `since`."""
    with path.open("rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    events = []
    for line in text.splitlines():
        match = LOG_LINE.match(line)
        if match:
            stamp = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            events.append((stamp, match[2]))
    return events


def accepted_lines(events: Events) -> list[tuple[float, int, int]]:
    """(time, broker id, partition count) of each LeaderAndIsr a broker accepted."""
    found = []
    for stamp, message in events:
        match = ACCEPTED.search(message)
        if match:
            found.append((stamp, int(match[2]), int(match[1])))
    return found


def applied_epochs(broker: ManagedProcess, since: int) -> dict[tuple[int, int], float]:
    """(partition, leader epoch) -> when the broker's log says it became leader or follower of
    that partition of TOPIC at that epoch."""
    found: dict[tuple[int, int], float] = {}
    for stamp, message in log_events(broker.log_file, since):
        match = BECAME.match(message)
        if match:
            found.setdefault((int(match[1]), int(match[2])), stamp)
    return found


def first_event(events: Events, needle: str) -> float | None:
    return next((stamp for stamp, message in events if needle in message), None)


def since(stamp: float | None, origin: float | None) -> float | None:
    return None if stamp is None or origin is None else stamp - origin


# -- output ------------------------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "meets" if ok else "MISSES"


def row(label: str, value: float | None, note: str = "") -> None:
    shown = "    n/a" if value is None else f"{value:7.3f}"
    print(f"  {label:<56}{shown} s   {note}".rstrip())


def print_aftermath(victim: int, states: States, events: Events, killed_at: float) -> None:
    in_isr = sum(victim in s["isr"] for s in states.values())
    print(f"  partitions still listing broker {victim} in their ISR: {in_isr}")
    print("  controller log after the kill (s since kill -9):")
    shown = [(stamp, message) for stamp, message in events if MILESTONES.search(message)]
    for stamp, message in shown[:14]:
        print(f"      {stamp - killed_at:+7.3f} s  {message}")
    if len(shown) > 14:
        print(f"      ... {len(shown) - 14} more")


# -- the cluster -------------------------------------------------------------------------------


@dataclass
class Cluster:
    root: Path
    name: str
    etcd_endpoint: str
    lease_ttl_s: int
    store: ControllerStore
    admin: ControllerClient
    controllers: dict[int, ManagedProcess] = field(default_factory=dict)
    brokers: dict[int, ManagedProcess] = field(default_factory=dict)

    async def start_controller(self, controller_id: int, listen: str, session_ms: int) -> str:
        proc = ManagedProcess(
            f"controller-{controller_id}",
            controller_args(
                controller_id, self.etcd_endpoint, self.name, listen, self.lease_ttl_s, session_ms
            ),
            self.root,
        )
        self.controllers[controller_id] = proc
        return await asyncio.to_thread(proc.start)

    async def start_broker(self, broker_id: int, controllers: str) -> None:
        proc = broker_process(broker_id, self.root, {"controllers": controllers, **BROKER_SETTINGS})
        self.brokers[broker_id] = proc
        await asyncio.to_thread(proc.start)

    async def restart_controllers(self, session_ms: int) -> None:
        """Each controller stopped and started again on its address with another session
        timeout: the standby first, then the active one, whose SIGTERM resigns so the
        restarted standby takes over at once."""
        active = await self.active_controller()
        for controller_id in sorted(self.controllers, key=lambda c: c == active):
            old = self.controllers[controller_id]
            await asyncio.to_thread(old.stop)
            await self.start_controller(controller_id, old.address, session_ms)

    def kill_all(self) -> None:
        for proc in [*self.brokers.values(), *self.controllers.values()]:
            proc.kill()

    async def alive_brokers(self) -> set[int]:
        try:
            response = await self.admin.call("DescribeCluster", cpb.DescribeClusterRequest())
        except Exception:  # a controller starting up or failing over: nobody alive yet
            return set()
        return {b.broker.broker_id for b in response.brokers if b.status == cpb.BROKER_STATUS_ALIVE}

    async def active_controller(self) -> int | None:
        active = await self.store.active_controller()
        return active[0] if active else None

    async def create_topic(self, partitions: int) -> None:
        response = await self.admin.call(
            "CreateTopics",
            cpb.CreateTopicsRequest(
                topics=[
                    cpb.CreatableTopic(
                        name=TOPIC, num_partitions=partitions, replication_factor=len(BROKERS)
                    )
                ]
            ),
        )
        result = response.topics[0]
        if result.error_code != ErrorCode.NONE:
            raise RuntimeError(f"CreateTopics: {result.error_message}")

    async def elect_preferred_leaders(self) -> None:
        """Per-partition outcomes are not checked: the caller waits for the resulting state."""
        await self.admin.call(
            "ElectLeaders", cpb.ElectLeadersRequest(election_type=cpb.ELECTION_TYPE_PREFERRED)
        )

    async def assignment(self) -> dict[int, list[int]]:
        """Partition -> replicas, preferred leader first."""
        topic = (await self.store.load_topics())[TOPIC]
        return {int(p): list(replicas) for p, replicas in topic["assignment"].items()}

    async def partitions(self) -> States:
        found = await self.store.load_partitions()
        return {p: value for (t, p), (value, _) in found.items() if t == TOPIC}

    def log_marks(self) -> dict[Path, int]:
        procs = [*self.controllers.values(), *self.brokers.values()]
        return {p.log_file: log_size(p.log_file) for p in procs}

    async def settled(self, marks: dict[Path, int], assignment: dict[int, list[int]]) -> bool:
        """Every broker alive; every partition with a leader and a full ISR; every broker's log
        (since `marks`) shows it applied each partition's current leader epoch."""
        if await self.alive_brokers() != set(BROKERS):
            return False
        states = await self.partitions()
        if len(states) != len(assignment) or any(
            s["leader"] == NO_LEADER or sorted(s["isr"]) != sorted(assignment[p])
            for p, s in states.items()
        ):
            return False
        wanted = {(p, s["leader_epoch"]) for p, s in states.items()}
        return all(
            wanted <= applied_epochs(b, marks[b.log_file]).keys() for b in self.brokers.values()
        )


@asynccontextmanager
async def running_cluster(
    root: Path, etcd: EtcdProcess, lease_ttl_s: int
) -> AsyncIterator[Cluster]:
    """Two controllers (session timeout SETUP_SESSION_TIMEOUT_MS) and three brokers, all
    brokers alive; every process killed on exit."""
    name = f"bench-{uuid.uuid4().hex[:8]}"
    async with AsyncExitStack() as stack:
        store = await ControllerStore.connect([etcd.endpoint], name)
        stack.push_async_callback(store.close)
        admin = ControllerClient([])
        stack.push_async_callback(admin.close)
        cluster = Cluster(root, name, etcd.endpoint, lease_ttl_s, store, admin)
        stack.callback(cluster.kill_all)
        for controller_id in CONTROLLERS:
            address = await cluster.start_controller(
                controller_id, "127.0.0.1:0", SETUP_SESSION_TIMEOUT_MS
            )
            admin.addresses.append(address)
        for broker_id in BROKERS:
            await cluster.start_broker(broker_id, ",".join(admin.addresses))

        async def all_alive() -> bool:
            return await cluster.alive_brokers() == set(BROKERS)

        await eventually(all_alive, SETUP_TIMEOUT_S, POLL_S)
        yield cluster


@dataclass(frozen=True)
class Setup:
    controller_id: int
    settle_s: float
    # Broker -> seconds from its first to its last 'became' line for the new partitions: its
    # LeaderAndIsr handler runs that long without yielding to the event loop.
    apply_s: dict[int, float]
    fencings: list[str]
    preferred_elections: int

    def describe(self, partitions: int) -> str:
        spans = ", ".join(f"{b}: {s:.2f} s" for b, s in sorted(self.apply_s.items()))
        fencings = f" ({'; '.join(self.fencings)})" if self.fencings else ""
        return (
            f"setup (session timeout {SETUP_SESSION_TIMEOUT_MS} ms, then both controllers "
            f"restarted with {SESSION_TIMEOUT_MS} ms): settled in {self.settle_s:.1f} s; "
            f"brokers applied the LeaderAndIsr for {partitions} new partitions in {spans}; "
            f"{len(self.fencings)} fencing(s){fencings}; "
            f"{self.preferred_elections} preferred election(s)"
        )


async def settle(cluster: Cluster, marks: dict[Path, int]) -> int:
    """Wait until the cluster settled with every leader its preferred replica, running preferred
    elections if something moved leaders; returns how many it ran."""
    assignment = await cluster.assignment()
    elections = 0
    while True:

        async def cluster_settled() -> bool:
            return await cluster.settled(marks, assignment)

        await eventually(cluster_settled, SETUP_TIMEOUT_S, SETTLE_POLL_S)
        states = await cluster.partitions()
        if all(states[p]["leader"] == replicas[0] for p, replicas in assignment.items()):
            return elections
        if elections == MAX_PREFERRED_ELECTIONS:
            raise RuntimeError(f"leaders not spread after {elections} preferred elections")
        await cluster.elect_preferred_leaders()
        elections += 1


async def create_topic(cluster: Cluster, partitions: int) -> Setup:
    """Create TOPIC under the setup session timeout, then restart the controllers with
    SESSION_TIMEOUT_MS; returns once settled again."""
    marks = cluster.log_marks()
    started = time.monotonic()
    await cluster.create_topic(partitions)
    elections = await settle(cluster, marks)
    await cluster.restart_controllers(SESSION_TIMEOUT_MS)
    elections += await settle(cluster, marks)
    apply_s = {}
    for broker_id, broker in cluster.brokers.items():
        created = [
            t
            for (_, epoch), t in applied_epochs(broker, marks[broker.log_file]).items()
            if epoch == 0
        ]
        apply_s[broker_id] = max(created) - min(created)
    fencings = [
        message
        for proc in cluster.controllers.values()
        for _, message in log_events(proc.log_file, marks[proc.log_file])
        if message.startswith("fencing broker")
    ]
    controller_id = await cluster.active_controller()
    assert controller_id is not None
    return Setup(controller_id, time.monotonic() - started, apply_s, fencings, elections)


def pick_victim(states: States) -> tuple[int, set[int]]:
    """The broker leading the most partitions, and those partitions."""
    leaders = {p: int(s["leader"]) for p, s in states.items()}
    victim = Counter(leaders.values()).most_common(1)[0][0]
    return victim, {p for p, leader in leaders.items() if leader == victim}


async def wait_for_new_leaders(
    cluster: Cluster, victim: int, led: set[int]
) -> tuple[float, float, States]:
    """Poll etcd until no partition of `led` names `victim` (or nobody) leader; returns the
    wall-clock times the first and the last had moved (when the poll answered) and the final
    states."""
    deadline = time.monotonic() + FAILOVER_TIMEOUT_S
    first: float | None = None
    while True:
        states = await cluster.partitions()
        answered = time.time()
        moved = sum(states[p]["leader"] not in (victim, NO_LEADER) for p in led)
        if moved and first is None:
            first = answered
        if moved == len(led):
            assert first is not None
            return first, answered, states
        if time.monotonic() > deadline:
            raise TimeoutError(f"{moved} of {len(led)} partitions have new leaders")
        await asyncio.sleep(POLL_S)


@dataclass(frozen=True)
class Applied:
    """One surviving broker's side of a failover, from its log and the controller's."""

    first: float  # it applied the first new leader epoch
    last: float  # ... and the last
    accepted: float  # the controller logged that LeaderAndIsr as accepted


async def wait_until_applied(
    cluster: Cluster,
    survivors: list[int],
    controller_log: Path,
    marks: dict[Path, int],
    states: States,
    led: set[int],
) -> dict[int, Applied]:
    """Wait until every survivor applied the new leader epoch of every partition in `led` and
    the controller logged the LeaderAndIsr that carried the last of them as accepted."""
    wanted = {(p, int(states[p]["leader_epoch"])) for p in led}
    applied: dict[int, Applied] = {}

    def survivors_applied_the_new_epochs() -> bool:
        accepted = accepted_lines(log_events(controller_log, marks[controller_log]))
        for broker_id in survivors:
            broker = cluster.brokers[broker_id]
            seen = applied_epochs(broker, marks[broker.log_file])
            if not wanted <= seen.keys():
                return False
            stamps = [seen[key] for key in wanted]
            # The controller logs the acceptance after the broker logged applying it.
            after = [t for t, b, _ in accepted if b == broker_id and t >= max(stamps)]
            if not after:
                return False
            applied[broker_id] = Applied(min(stamps), max(stamps), after[0])
        return True

    await eventually(survivors_applied_the_new_epochs, FAILOVER_TIMEOUT_S, POLL_S)
    return applied


def print_applied(applied: dict[int, Applied], killed_at: float) -> None:
    for broker_id, a in sorted(applied.items()):
        row(
            f"kill -9 -> broker {broker_id} applied the new epochs (its log)",
            a.last - killed_at,
            f"first at {a.first - killed_at:.3f} s: {a.last - a.first:.3f} s in its handler",
        )
        row(
            f"kill -9 -> broker {broker_id}'s LeaderAndIsr accepted (controller log)",
            a.accepted - killed_at,
        )


# -- scenarios ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class BrokerFailover:
    partitions: int
    total_s: float
    after_fencing_s: float | None
    # Brokers fenced while applying the failover's LeaderAndIsr: the new leaders did not last.
    fenced_survivors: list[int]

    @property
    def meets_goal(self) -> bool:
        return self.total_s < BROKER_GOAL_S and not self.fenced_survivors


async def broker_failover(
    root: Path, etcd: EtcdProcess, lease_ttl_s: int, partitions: int
) -> BrokerFailover:
    async with running_cluster(root / f"broker-failover-{partitions}", etcd, lease_ttl_s) as cl:
        setup = await create_topic(cl, partitions)
        victim, led = pick_victim(await cl.partitions())
        survivors = [b for b in BROKERS if b != victim]
        controller_log = cl.controllers[setup.controller_id].log_file
        marks = cl.log_marks()
        killed_at = time.time()
        cl.brokers[victim].kill()
        first_at, all_at, states = await wait_for_new_leaders(cl, victim, led)
        applied = await wait_until_applied(cl, survivors, controller_log, marks, states, led)
        events = log_events(controller_log, marks[controller_log])
    fenced_at = first_event(events, f"fencing broker {victim}:")
    fenced_survivors = [b for b in survivors if first_event(events, f"fencing broker {b}:")]
    result = BrokerFailover(
        partitions, all_at - killed_at, since(all_at, fenced_at), fenced_survivors
    )
    txns = -(-partitions // PARTITIONS_PER_TXN)  # every partition has a replica on the victim
    print(
        f"\nbroker failover: {partitions} partitions RF=3, kill -9 of broker {victim}, "
        f"leader of {len(led)}"
    )
    print(f"  {setup.describe(partitions)}")
    row(
        "kill -9 -> fenced (controller log)",
        since(fenced_at, killed_at),
        f"session timeout {SESSION_TIMEOUT_MS / 1000} s, heartbeat {HEARTBEAT_MS} ms",
    )
    row("fenced -> first new leader in etcd (poll)", since(first_at, fenced_at))
    row(
        "fenced -> all new leaders in etcd (poll)",
        result.after_fencing_s,
        f"{partitions} partition changes, {txns} etcd txn(s) of <= {PARTITIONS_PER_TXN}",
    )
    row(
        f"kill -9 -> all {len(led)} new leaders in etcd",
        result.total_s,
        f"goal < {BROKER_GOAL_S} s and no survivor fenced: {verdict(result.meets_goal)}",
    )
    print_applied(applied, killed_at)
    print(f"  surviving brokers fenced while applying the failover: {fenced_survivors or 'none'}")
    print_aftermath(victim, states, events, killed_at)
    return result


@dataclass(frozen=True)
class ControllerFailover:
    new_active_s: float
    first_accepted_s: float
    new_leaders_s: float


async def controller_failover(
    root: Path, etcd: EtcdProcess, lease_ttl_s: int, partitions: int
) -> ControllerFailover:
    async with running_cluster(root / "controller-failover", etcd, lease_ttl_s) as cl:
        setup = await create_topic(cl, partitions)
        old_id = setup.controller_id
        victim, led = pick_victim(await cl.partitions())
        survivors = [b for b in BROKERS if b != victim]
        marks = cl.log_marks()
        killed_at = time.time()
        cl.controllers[old_id].kill()
        broker_killed_at = time.time()
        cl.brokers[victim].kill()

        async def new_active_controller() -> int | None:
            active = await cl.active_controller()
            return None if active == old_id else active

        new_id = await eventually(new_active_controller, FAILOVER_TIMEOUT_S, POLL_S)
        new_active_at = time.time()
        _, all_at, states = await wait_for_new_leaders(cl, victim, led)
        new_log = cl.controllers[new_id].log_file
        applied = await wait_until_applied(cl, survivors, new_log, marks, states, led)
        events = log_events(new_log, marks[new_log])
    first_accepted_at, first_broker, _ = min(accepted_lines(events))
    first_accepted = first_accepted_at - killed_at
    goal = lease_ttl_s + CONTROLLER_GOAL_MARGIN_S
    print(
        f"\ncontroller failover: lease TTL {lease_ttl_s} s, {partitions} partitions RF=3; "
        f"kill -9 of active controller {old_id}, then of broker {victim} "
        f"(+{(broker_killed_at - killed_at) * 1000:.0f} ms), leader of {len(led)}"
    )
    print(f"  {setup.describe(partitions)}")
    row(f"kill -9 -> controller {new_id} active in etcd (poll)", new_active_at - killed_at)
    row(
        "kill -9 -> 'is active' (new controller log)",
        since(first_event(events, "is active at epoch"), killed_at),
        f"lease refreshed every TTL/3, so it expires {lease_ttl_s * 2 / 3:.2f}-{lease_ttl_s} s "
        "after the kill, + etcd's 0.5 s expiry tick",
    )
    row(
        f"kill -9 -> first LeaderAndIsr accepted (broker {first_broker})",
        first_accepted,
        f"goal <= TTL + {CONTROLLER_GOAL_MARGIN_S} = {goal} s: {verdict(first_accepted <= goal)}",
    )
    row(
        f"kill -9 -> broker {victim}'s {len(led)} partitions: new leaders in etcd",
        all_at - killed_at,
        "(after the new controller's grace of one session timeout)",
    )
    print_applied(applied, killed_at)
    print_aftermath(victim, states, events, killed_at)
    return ControllerFailover(new_active_at - killed_at, first_accepted, all_at - killed_at)


# -- main --------------------------------------------------------------------------------------


def print_growth(small: BrokerFailover, large: BrokerFailover) -> tuple[float, float]:
    """Growth of kill -> new leaders between two partition counts; (growth, linear growth)."""
    linear = large.partitions / small.partitions
    growth = large.total_s / small.total_s
    print(
        f"\ngrowth {small.partitions} -> {large.partitions} partitions (linear would be "
        f"x{linear:.0f}): kill -9 -> new leaders x{growth:.2f}"
    )
    if small.after_fencing_s and large.after_fencing_s:
        print(
            f"  fenced -> new leaders x{large.after_fencing_s / small.after_fencing_s:.2f} "
            f"({small.after_fencing_s * 1000:.0f} ms -> {large.after_fencing_s * 1000:.0f} ms)"
        )
    return growth, linear


async def main(
    partition_counts: list[int],
    controller_partitions: int,
    lease_ttl_s: int,
    sections: set[str],
    work_dir: Path,
) -> None:
    brokers: list[BrokerFailover] = []
    controller: ControllerFailover | None = None
    print(
        f"3 brokers, 2 controllers, lease TTL {lease_ttl_s} s, broker.session.timeout.ms "
        f"{SESSION_TIMEOUT_MS}, broker.heartbeat.interval.ms {HEARTBEAT_MS}, etcd poll every "
        f"{POLL_S * 1000:.0f} ms"
    )
    with EtcdProcess(work_dir / "etcd" / "data") as etcd:
        if "broker" in sections:
            for partitions in partition_counts:
                brokers.append(await broker_failover(work_dir, etcd, lease_ttl_s, partitions))
        if "controller" in sections:
            controller = await controller_failover(
                work_dir, etcd, lease_ttl_s, controller_partitions
            )
    summary = []
    if brokers:
        parts = ", ".join(f"{b.partitions} partitions {b.total_s:.2f} s" for b in brokers)
        fenced = sum(len(b.fenced_survivors) for b in brokers)
        ok = all(b.meets_goal for b in brokers)
        summary.append(
            f"broker failover {parts}, {fenced} survivor(s) fenced "
            f"(goal < {BROKER_GOAL_S} s, none fenced: {verdict(ok)})"
        )
        if len(brokers) > 1:
            growth, linear = print_growth(brokers[0], brokers[-1])
            summary.append(f"growth x{growth:.2f} for x{linear:.0f} ({verdict(growth < linear)})")
    if controller is not None:
        goal = lease_ttl_s + CONTROLLER_GOAL_MARGIN_S
        first = controller.first_accepted_s
        summary.append(
            f"controller failover (TTL {lease_ttl_s} s): new active "
            f"{controller.new_active_s:.2f} s, first LeaderAndIsr {first:.2f} s "
            f"(goal <= {goal} s: {verdict(first <= goal)}), new leaders "
            f"{controller.new_leaders_s:.2f} s"
        )
    print(f"\nSUMMARY controller: {'; '.join(summary)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--partitions", default="100,1000", help="comma-separated counts")
    parser.add_argument("--controller-partitions", type=int, default=100)
    parser.add_argument("--lease-ttl", type=int, default=2, help="controller lease TTL, s")
    parser.add_argument("--only", default=",".join(SECTIONS), help="broker,controller")
    parser.add_argument("--work-dir", type=Path, help="keep the processes' logs here")
    args = parser.parse_args()
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    if not only <= set(SECTIONS):
        parser.error(f"--only takes {', '.join(SECTIONS)}")
    counts = [int(n) for n in args.partitions.split(",") if n.strip()]
    if args.work_dir and args.work_dir.exists() and any(args.work_dir.iterdir()):
        parser.error(f"--work-dir {args.work_dir} is not empty")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        asyncio.run(main(counts, args.controller_partitions, args.lease_ttl, only, work))
