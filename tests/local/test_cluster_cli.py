"""`tidewater cluster up --detach | status | down`, run as a user would, with a round trip
through the SDK in between, and a restart on the same data dir keeping the data; the client
commands (`topics`, `produce`, `consume`, `bench`) and their errors on one running cluster."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.local.cluster_cli import COMMAND_TIMEOUT_S, kill_recorded, recorded_pids, tidewater
from tidewater.broker.controller_client import ControllerClient
from tidewater.client.consumer import Consumer
from tidewater.client.producer import Producer
from tidewater.local.scrape import scrape
from tidewater.v1 import controller_pb2 as cpb
from tidewater.v1.errors_pb2 import ErrorCode

pytestmark = pytest.mark.timeout(300)
TOPIC = "events"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def status(data_dir: Path) -> list[dict[str, Any]]:
    result = tidewater("cluster", "status", "--data-dir", str(data_dir), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)["processes"]


def up(data_dir: Path) -> list[dict[str, Any]]:
    result = tidewater("cluster", "up", "--detach", "--data-dir", str(data_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    processes = status(data_dir)
    for process in processes:
        assert process["address"] in result.stdout
        assert f"127.0.0.1:{process['metrics_port']}" in result.stdout
    metadata = [p["address"] for p in processes if p["role"] == "metadata"]
    assert f"Bootstrap (metadata service): {metadata[0]}" in result.stdout
    # The banner's way to connect works as printed.
    connect = re.search(r"Connect:  (from tidewater\.client import .*)", result.stdout)
    assert connect is not None, result.stdout
    subprocess.run([sys.executable, "-c", connect[1]], check=True, timeout=COMMAND_TIMEOUT_S)
    return processes


def down(data_dir: Path, pids: set[int]) -> None:
    result = tidewater("cluster", "down", "--data-dir", str(data_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (data_dir / "cluster.json").exists()
    # `down` waits for each process; the children are reaped by the supervisor as it exits.
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not {pid for pid in pids if alive(pid)}


async def create_topic(controllers: list[str]) -> None:
    client = ControllerClient(controllers)
    try:
        response = await client.call(
            "CreateTopics",
            cpb.CreateTopicsRequest(
                topics=[cpb.CreatableTopic(name=TOPIC, num_partitions=2, replication_factor=3)]
            ),
        )
    finally:
        await client.close()
    assert response.topics[0].error_code == ErrorCode.NONE, response.topics[0].error_message


async def produce(bootstrap: list[str], values: list[bytes]) -> None:
    async with Producer(bootstrap, delivery_timeout_ms=60000) as producer:
        futures = [await producer.send(TOPIC, value, partition=0) for value in values]
        await asyncio.wait_for(producer.flush(), 60)
        offsets = [(await future).offset for future in futures]
    assert offsets == sorted(offsets)


async def consume(bootstrap: list[str], count: int) -> list[bytes]:
    async with Consumer(bootstrap, auto_offset_reset="earliest") as consumer:
        consumer.assign([(TOPIC, 0)])
        values: list[bytes] = []

        async def read() -> None:
            while len(values) < count:
                values.extend(r.value or b"" for r in await consumer.poll(500))

        await asyncio.wait_for(read(), 60)
    return values


def ports(processes: list[dict[str, Any]]) -> dict[str, tuple[str, int]]:
    """Each process's address and metrics port, by its name in the supervisor's messages."""
    return {f"{p['role']} {p['id']}": (p["address"], p["metrics_port"]) for p in processes}


def addresses(processes: list[dict[str, Any]], role: str) -> list[str]:
    return [p["address"] for p in processes if p["role"] == role]


async def check_metrics(processes: list[dict[str, Any]]) -> None:
    """Every process serves Prometheus metrics on the port `status` shows."""
    scrapes = {(p["role"], p["id"]): await scrape(p["metrics_port"]) for p in processes}
    assert scrapes["etcd", 1]("etcd_server_has_leader") == 1
    assert scrapes["metadata", 1]("tidewater_metadata_ready") == 1
    assert scrapes["metadata", 1]("tidewater_metadata_live_brokers") == 3
    active = [
        scrapes["controller", c]("tidewater_controller_active_controller_count") for c in (1, 2)
    ]
    assert sorted(active) == [0, 1]
    produces = [
        scrapes["broker", b]("tidewater_request_requests_total", request="Produce")
        for b in (1, 2, 3)
    ]
    assert sum(produces) >= 1


async def test_up_round_trip_down_and_restart_keeps_the_data(data_dir: Path) -> None:
    processes = await asyncio.to_thread(up, data_dir)
    roles = sorted((p["role"], p["id"]) for p in processes)
    assert roles == [
        ("broker", 1),
        ("broker", 2),
        ("broker", 3),
        ("controller", 1),
        ("controller", 2),
        ("etcd", 1),
        ("metadata", 1),
    ]
    assert {p["health"] for p in processes} == {"SERVING"}
    bootstrap = addresses(processes, "metadata")

    await create_topic(addresses(processes, "controller"))
    values = [f"record-{i}".encode() for i in range(20)]
    await produce(bootstrap, values)
    assert await consume(bootstrap, len(values)) == values
    await check_metrics(processes)

    first_pids = recorded_pids(data_dir)
    await asyncio.to_thread(down, data_dir, first_pids)

    # The same data dir brings the same cluster back: the topic and its records are there, on
    # the same ports (a scrape configuration keeps working), but for a port another process
    # took meanwhile, which the supervisor's log names.
    first_ports = ports(processes)
    processes = await asyncio.to_thread(up, data_dir)
    assert {p["health"] for p in processes} == {"SERVING"}
    log = (data_dir / "cluster.log").read_text()
    moved = {
        name: (was, ports(processes)[name])
        for name, was in first_ports.items()
        if ports(processes)[name] != was and f"tidewater: {name}: " not in log
    }
    assert not moved, "started on other ports, saying nothing"
    more = [b"after-restart"]
    bootstrap = addresses(processes, "metadata")
    await produce(bootstrap, more)
    assert await consume(bootstrap, len(values) + 1) == values + more
    await asyncio.to_thread(down, data_dir, recorded_pids(data_dir))


def test_status_and_down_without_a_cluster(tmp_path: Path) -> None:
    result = tidewater("cluster", "status", "--data-dir", str(tmp_path))
    assert result.returncode == 1
    assert "no cluster recorded" in result.stderr
    result = tidewater("cluster", "down", "--data-dir", str(tmp_path))
    assert result.returncode == 0
    assert "no cluster recorded" in result.stdout


# -- the client commands, on one cluster for the module -----------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """A running local cluster; yields the `--data-dir` option that points commands at it.
    `cluster down` at the end must succeed; whatever is left is killed."""
    data_dir = tmp_path_factory.mktemp("client") / "cluster"
    try:
        up(data_dir)
        yield ["--data-dir", str(data_dir)]
        down(data_dir, recorded_pids(data_dir))
    finally:
        kill_recorded(data_dir)


def ok(*args: str, stdin: str = "") -> str:
    result = tidewater(*args, stdin=stdin)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def consume_json(cluster: list[str], *args: str) -> list[dict[str, Any]]:
    out = ok("consume", "--format", "json", "--timeout-ms", "1000", *args, *cluster)
    return [json.loads(line) for line in out.splitlines()]


def test_topics_produce_consume_round_trip(cluster: list[str], tmp_path: Path) -> None:
    topic = "cli-events"
    created = ok("topics", "create", "--topic", topic, "--partitions", "2", *cluster)
    found = re.fullmatch(rf"Created topic {topic} \(topic id ([0-9a-f-]{{36}})\)\.\n", created)
    assert found, created
    topic_id = found[1]
    assert topic in ok("topics", "list", *cluster).splitlines()
    described = json.loads(ok("topics", "describe", "--topic", topic, "--json", *cluster))
    assert described["topics"][0]["topic_id"] == topic_id
    partitions = described["topics"][0]["partitions"]
    assert [p["partition"] for p in partitions] == [0, 1]
    for p in partitions:
        assert sorted(p["replicas"]) == [1, 2, 3]
        assert sorted(p["isr"]) == [1, 2, 3]
        assert p["leader"] in p["replicas"]
        assert p["leader_epoch"] >= 0
        # Full ISRs: no eligible leader replicas (KIP-966), no last known leader.
        assert (p["eligible_leader_replicas"], p["last_known_elr"]) == ([], [])
    text = ok("topics", "describe", "--topic", topic, *cluster)
    assert f"Topic: {topic}\tTopicId: {topic_id}\tPartitionCount: 2\tReplicationFactor: 3" in text
    assert "\tElr: \tLastKnownElr: \n" in text + "\n"

    lines = [f"key-{i % 5}:value-{i}" for i in range(30)]
    ok("produce", "--topic", topic, "--key-separator", ":", *cluster, stdin="\n".join(lines))
    records = consume_json(cluster, "--topic", topic, "--from-beginning")
    assert sorted((r["key"], r["value"]) for r in records) == sorted(
        tuple(line.split(":")) for line in lines
    )
    # One key, one partition; each partition in offset order, keys in the order sent.
    partition_of = {r["key"]: r["partition"] for r in records}
    assert all(partition_of[r["key"]] == r["partition"] for r in records)
    for partition in (0, 1):
        offsets = [r["offset"] for r in records if r["partition"] == partition]
        assert offsets == list(range(len(offsets)))

    # From a file, to a chosen partition; read back raw from an offset and from a time.
    before = int(time.time() * 1000)
    source = tmp_path / "more.txt"
    source.write_text("late-1\nlate-2\n")
    ok(
        "produce",
        "--topic",
        topic,
        "--file",
        str(source),
        "--partition",
        "1",
        "--acks",
        "1",
        "--compression",
        "zstd",
        *cluster,
    )
    at_end = len([r for r in records if r["partition"] == 1])
    raw = ok(
        "consume",
        "--topic",
        topic,
        "--partition",
        "1",
        "--offset",
        str(at_end),
        "--timeout-ms",
        "1000",
        *cluster,
    )
    assert raw == "late-1\nlate-2\n"
    since = consume_json(cluster, "--topic", topic, "--from-timestamp", str(before))
    assert [r["value"] for r in since] == ["late-1", "late-2"]
    assert (
        ok("consume", "--topic", topic, "--from-beginning", "--max-messages", "3", *cluster).count(
            "\n"
        )
        == 3
    )

    assert ok("topics", "delete", "--topic", topic, *cluster) == f"Deleted topic {topic}.\n"
    deadline = time.monotonic() + 30
    while topic in ok("topics", "list", *cluster).splitlines():
        assert time.monotonic() < deadline, "the deleted topic is still listed"
        time.sleep(0.2)


def test_topics_alter_configs_and_describe_round_trip(cluster: list[str]) -> None:
    topic = "cli-configs"
    ok("topics", "create", "--topic", topic, "--config", "retention.ms=3600000", *cluster)
    altered = ok(
        "topics", "alter-configs", "--topic", topic, "--set", "min.insync.replicas=2",
        "--set", "segment.bytes=1048576", "--delete", "retention.ms", *cluster,
    )  # fmt: skip
    assert altered == f"Altered the configs of topic {topic}.\n"
    text = ok("topics", "describe", "--topic", topic, *cluster)
    assert "\tConfigs: min.insync.replicas=2,segment.bytes=1048576\n" in text, text

    def configs() -> dict[str, tuple[str, str]]:
        described = json.loads(ok("topics", "describe", "--topic", topic, "--json", *cluster))
        return {c["name"]: (c["value"], c["source"]) for c in described["topics"][0]["configs"]}

    before = configs()
    assert before["min.insync.replicas"] == ("2", "DYNAMIC_TOPIC_CONFIG")
    assert before["segment.bytes"] == ("1048576", "DYNAMIC_TOPIC_CONFIG")
    assert before["retention.ms"] == ("604800000", "DEFAULT_CONFIG")
    checked = ok(
        "topics", "alter-configs", "--topic", topic, "--set", "retention.ms=1",
        "--validate-only", *cluster,
    )  # fmt: skip
    assert checked == f"Checked the configs of topic {topic}.\n"
    assert configs() == before
    ok("topics", "alter-configs", "--topic", topic, "--delete", "min.insync.replicas", *cluster)
    assert configs()["min.insync.replicas"] == ("1", "DEFAULT_CONFIG")


def test_bench_produce_and_consume(cluster: list[str]) -> None:
    ok("topics", "create", "--topic", "cli-bench", "--partitions", "3", *cluster)
    out = ok(
        "bench",
        "produce",
        "--topic",
        "cli-bench",
        "--num-records",
        "2000",
        "--record-size",
        "100",
        "--throughput",
        "-1",
        "--acks",
        "all",
        *cluster,
    )
    assert out.startswith("2000 records sent, ")
    for field in ("records/sec", "MiB/sec", "ms p50", "ms p95", "ms p99,", "ms p99.9", "ms max"):
        assert field in out
    out = ok("bench", "consume", "--topic", "cli-bench", "--num-records", "2000", *cluster)
    assert out.startswith("2000 records consumed, ")
    assert "records/sec" in out and "ms p99.9" in out


def test_topics_reassign_moves_a_partition_and_lists_it_until_done(cluster: list[str]) -> None:
    """Review 37 #3: moving a partition (adding or decommissioning a broker) had no command,
    only the SDK's Admin.reassign. As kafka-reassign-partitions."""
    topic = "cli-moving"
    ok("topics", "create", "--topic", topic, "--replication-factor", "2", *cluster)

    def replicas() -> list[int]:
        described = json.loads(ok("topics", "describe", "--topic", topic, "--json", *cluster))
        return list(described["topics"][0]["partitions"][0]["replicas"])

    before = replicas()
    (spare,) = {1, 2, 3} - set(before)
    target = [spare, before[0]]
    moved = ok(
        "topics", "reassign", "--topic", topic, "--partition", "0",
        "--replicas", ",".join(map(str, target)), *cluster,
    )  # fmt: skip
    assert f"Moving {topic}-0 to brokers {spare},{before[0]}" in moved
    deadline = time.monotonic() + 60
    while replicas() != target:  # the new replica catches up, then the old one goes
        assert time.monotonic() < deadline, replicas()
        time.sleep(0.2)
    assert f"{topic}-0" not in ok("topics", "reassignments", *cluster)
    refused = fails("topics", "reassign", "--topic", topic, "--partition", "0", "--cancel",
                    *cluster)  # fmt: skip
    assert "NO_REASSIGNMENT_IN_PROGRESS" in refused


def fails(*args: str, stdin: str = "", status: int = 1) -> str:
    """The command exits with `status` and says why on one line of stderr."""
    result = tidewater(*args, stdin=stdin)
    assert result.returncode == status, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("tidewater"), result.stderr
    return result.stderr


@pytest.fixture(scope="module")
def error_topics(cluster: list[str]) -> list[str]:
    """cli-errors, and cli-small whose max.message.bytes is 1000."""
    existing = ok("topics", "list", *cluster).splitlines()
    if "cli-errors" not in existing:
        ok("topics", "create", "--topic", "cli-errors", *cluster)
    if "cli-small" not in existing:
        ok("topics", "create", "--topic", "cli-small", "--config", "max.message.bytes=1000",
           *cluster)  # fmt: skip
    return cluster


@pytest.mark.parametrize(
    ("args", "stdin", "expected"),
    [
        (["produce", "--topic", "nope"], "x\n", "UNKNOWN_TOPIC_OR_PARTITION: topic 'nope'"),
        (["consume", "--topic", "nope"], "", "UNKNOWN_TOPIC_OR_PARTITION: topic 'nope'"),
        (["topics", "describe", "--topic", "nope"], "", "UNKNOWN_TOPIC_OR_PARTITION"),
        (["topics", "describe", "--topic", "bad!"], "", "INVALID_TOPIC: topic name 'bad!'"),
        (["topics", "delete", "--topic", "nope"], "", "UNKNOWN_TOPIC_OR_PARTITION"),
        (["consume", "--topic", "cli-errors", "--partition", "5"], "", "not partition 5"),
        (["produce", "--topic", "cli-errors"], "x" * 2_000_000, "MESSAGE_TOO_LARGE"),
        (["produce", "--topic", "cli-small"], "x" * 2000, "MESSAGE_TOO_LARGE"),
        (["produce", "--topic", "cli-errors", "--key-separator", ":"], "nokey", "line 1 has no"),
        (["topics", "create", "--topic", "t", "--replication-factor", "4"], "", "INVALID_REPLI"),
        (["topics", "create", "--topic", "t", "--config", "retention.ms=x"], "", "INVALID_CONFIG"),
        (["topics", "create", "--topic", "cli-errors"], "", "TOPIC_ALREADY_EXISTS"),
        (
            ["produce", "--topic", "bad name!"],
            "x",
            "INVALID_TOPIC: topic name 'bad name!' has characters outside [a-zA-Z0-9._-]\n",
        ),
        (
            ["topics", "alter-configs", "--topic", "cli-errors", "--set", "no.such=1"],
            "",
            "INVALID_CONFIG: unknown topic config: no.such",
        ),
        (
            ["topics", "alter-configs", "--topic", "cli-errors", "--set", "retention.ms=x"],
            "",
            "INVALID_CONFIG: retention.ms",
        ),
        (
            ["topics", "alter-configs", "--topic", "nope", "--delete", "retention.ms"],
            "",
            "UNKNOWN_TOPIC_OR_PARTITION",
        ),
    ],
)
def test_bad_input_is_one_clear_line(
    cluster: list[str], args: list[str], stdin: str, expected: str
) -> None:
    for topic, configs in (
        ("cli-errors", []),
        ("cli-small", ["--config", "max.message.bytes=1000"]),
    ):
        if topic not in ok("topics", "list", *cluster).splitlines():
            ok("topics", "create", "--topic", topic, *configs, *cluster)
    assert expected in fails(*args, *cluster, stdin=stdin)


BENCH_PRODUCE = ["bench", "produce", "--topic", "t", "--num-records", "10", "--record-size", "1",
                 "--throughput", "-1"]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["produce", "--topic", "t", "--acks", "2"], "argument --acks: acks must be all, -1, 0"),
        (["produce", "--topic", "t", "--compression", "snappy"], "invalid choice: 'snappy'"),
        (["produce", "--topic", "t", "--linger-ms", "-1"], "argument --linger-ms: expected an"),
        (["produce", "--topic", "t", "--partition", "-1"], "argument --partition"),
        (["produce", "--topic", "t", "--key-separator", ""], "--key-separator must not be empty"),
        (
            ["produce", "--topic", "t", "--delivery-timeout-ms", "1000"],
            "--delivery-timeout-ms must be at least --linger-ms + --request-timeout-ms (10005)",
        ),
        (["consume", "--topic", "t", "--offset", "-5"], "argument --offset: expected earliest"),
        (["consume", "--topic", "t", "--from-timestamp", "soon"], "argument --from-timestamp"),
        (["consume", "--topic", "t", "--max-messages", "0"], "argument --max-messages"),
        ([*BENCH_PRODUCE, "--record-size", "0"], "argument --record-size"),
        ([*BENCH_PRODUCE, "--throughput", "0"], "argument --throughput"),
        ([*BENCH_PRODUCE, "--delivery-timeout-ms", "0"], "argument --delivery-timeout-ms"),
        (["topics", "create", "--topic", "t", "--partitions", "0"], "argument --partitions"),
        (["topics", "list", "--request-timeout-ms", "0"], "argument --request-timeout-ms"),
        (["topics", "list", "--bootstrap", "localhost"], "HOST:PORT, got 'localhost'"),
        (["topics", "alter-configs", "--topic", "t"], "needs --set KEY=VALUE or --delete KEY"),
        (["cluster", "up", "--brokers", "0"], "argument --brokers"),
        # Review 27 L1-L3, L6: tracebacks, or accepted and harmful.
        (["metadata", "--metrics-port", "99999"], "argument --metrics-port"),
        (["controller", "--controller-id", "1", "--etcd", "nohost"], "argument --etcd"),
        (["controller", "--controller-id", "1", "--etcd", ","], "argument --etcd"),
        (["controller", "--controller-id", "1", "--lease-ttl", "0"], "argument --lease-ttl"),
        (
            ["controller", "--controller-id", "1", "--broker-session-timeout-ms", "0"],
            "argument --broker-session-timeout-ms",
        ),
        (["--log-level", "bogus", "topics", "list"], "argument --log-level"),
    ],
)
def test_invalid_flag_values_are_usage_errors(args: list[str], expected: str) -> None:
    """Exit status 2, as argparse's own usage errors, found before any cluster is looked for
    (none is needed)."""
    stderr = fails(*args, status=2)
    assert expected in stderr
    assert "(see --help)" in stderr


def test_ctrl_c_stops_a_produce_waiting_on_a_terminal(error_topics: list[str]) -> None:
    """Typed lines are sent at once; Ctrl-C while the next line is awaited delivers what was
    typed and exits (130) without waiting for another line."""
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidewater", "produce", "--topic", "cli-errors", *error_topics],
        stdin=secondary,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        os.write(primary, b"typed-line\n")
        deadline = time.monotonic() + 60
        while "typed-line" not in ok("consume", "--topic", "cli-errors", "--from-beginning",
                                     "--timeout-ms", "500", *error_topics):  # fmt: skip
            assert time.monotonic() < deadline, "the typed line was not produced"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        assert b"Traceback" not in proc.stderr.read()  # type: ignore[union-attr]
    finally:
        proc.kill()
        proc.wait()
        os.close(primary)
        os.close(secondary)


def test_usage_errors_are_one_line() -> None:
    assert "the following arguments are required: --topic" in fails("produce", status=2)
    assert "invalid choice" in fails("topics", "frobnicate", status=2)


def test_no_cluster_and_unanswering_metadata_addresses_fail_within_the_deadline(
    tmp_path: Path,
) -> None:
    stderr = fails("topics", "list", "--data-dir", str(tmp_path))
    assert "no cluster to talk to: pass --bootstrap" in stderr
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    refused = fails("produce", "--topic", "t", "--bootstrap", f"127.0.0.1:{port}")
    # Refused at once: the message does not claim the deadline ran out.
    assert f"no metadata service answered: 127.0.0.1:{port}: UNAVAILABLE" in refused
    # Accepts connections and never answers: each command gives up at its request deadline.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        for command in (
            ["topics", "list"],
            ["consume", "--topic", "t"],
            ["produce", "--topic", "t"],
        ):
            stderr = fails(*command, "--bootstrap", address, "--request-timeout-ms", "1000")
            assert f"no metadata service answered within 1s: {address}: DEADLINE" in stderr


def test_a_second_supervisor_on_one_data_dir_is_refused(tmp_path: Path) -> None:
    """Review 27 M2: two `cluster up` at once on one data dir both started; the one that
    failed deleted the other's cluster.json, which then ran untracked."""
    from tidewater.local.cluster import ClusterError, _hold_data_dir

    held = _hold_data_dir(tmp_path)
    try:
        with pytest.raises(ClusterError, match="another `tidewater cluster up`"):
            _hold_data_dir(tmp_path)
    finally:
        os.close(held)


def test_ctrl_c_while_a_detached_cluster_starts_stops_it(tmp_path: Path) -> None:
    """Review 27 M1: Ctrl-C reached `cluster up --detach`, not its supervisor in a session of
    its own: the command exited 130 and the cluster came up in the background all the same."""
    data_dir = tmp_path / "c"
    command = ["cluster", "up", "--detach", "--data-dir", str(data_dir)]
    starting = subprocess.Popen(
        [sys.executable, "-m", "tidewater", *command],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not (data_dir / "cluster.json").exists():  # the supervisor is starting them
            assert time.monotonic() < deadline and starting.poll() is None
            time.sleep(0.05)
        starting.send_signal(signal.SIGINT)
        assert starting.wait(COMMAND_TIMEOUT_S) == 130
        deadline = time.monotonic() + 60
        while running_from(data_dir):
            assert time.monotonic() < deadline, f"still running: {running_from(data_dir)}"
            time.sleep(0.1)
    finally:
        starting.kill()
        kill_recorded(data_dir)
        for pid in running_from(data_dir):
            os.kill(pid, signal.SIGKILL)


def running_from(data_dir: Path) -> list[int]:
    """The processes whose command line names `data_dir` (the supervisor, etcd, brokers)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                command = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if str(data_dir).encode() in command:
                found.append(int(proc.name))
    return found


def test_a_cluster_recorded_but_not_running_is_said_so(tmp_path: Path) -> None:
    """Review 27 L8: after a reboot, client commands said no metadata service answered at
    the recorded address, and `cluster down` said it stopped 2 processes that were gone."""
    from tidewater.local.cluster import ClusterFile, Member

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(gone.stdout)  # exited: no process has it now (pids are not reused this soon)
    members = (Member("metadata", 1, "127.0.0.1:2", pid), Member("broker", 1, "127.0.0.1:3", pid))
    ClusterFile(tmp_path, pid, members).write()
    listed = tidewater("topics", "list", "--data-dir", str(tmp_path))
    assert listed.returncode == 1
    assert f"the local cluster recorded in {tmp_path} is not running" in listed.stderr
    down = tidewater("cluster", "down", "--data-dir", str(tmp_path))
    assert down.returncode == 0
    assert "was not running; its record is removed" in down.stdout
    assert not (tmp_path / "cluster.json").exists()
