"""`tidewater cluster up | down | status`: a whole cluster on 127.0.0.1 as child processes.

One etcd, one metadata service, two controllers and N brokers, with their data, logs and the
cluster file (`cluster.json`: role, id, address and pid of every process) under one data dir.
The `up` process supervises them; `--detach` runs that supervisor in its own session and
returns once the cluster is healthy. A later `up` on the same data dir brings the same cluster
(same etcd state, same broker logs) back, on the ports recorded in `ports.json` when they are
still free.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import platformdirs
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tidewater.broker.controller_client import ControllerClient
from tidewater.errors import ControllerUnavailable
from tidewater.local.etcd import HOST, EtcdFailed, EtcdProcess
from tidewater.local.process import (
    TIDEWATER,
    ListenRefused,
    ManagedProcess,
    ProcessFailed,
    broker_args,
    controller_args,
    metadata_args,
)
from tidewater.rpc.address import bind_error
from tidewater.v1 import controller_pb2 as cpb

CLUSTER_NAME = "tidewater"
CLUSTER_FILE = "cluster.json"
# The ports each process last had: kept by `cluster down` (cluster.json, which names only what
# runs, goes), so that the next `up` asks for them again.
PORTS_FILE = "ports.json"
CONTROLLER_IDS = (1, 2)
METADATA_ID = 1
ETCD_ID = 1
START_TIMEOUT_S = 120.0
PROCESS_START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
# The brokers' default min.insync.replicas and the controllers' (their ELR rules must take
# the brokers' value), from one place. Kafka's default: acks=all needs the leader only.
MIN_INSYNC_REPLICAS = 1
PROBE_TIMEOUT_S = 2.0
# Clean shutdown order: brokers first (controlled shutdown needs the controllers), etcd last.
STOP_ORDER = ("broker", "metadata", "controller", "etcd")
SERVING, NOT_SERVING, DOWN = "SERVING", "NOT_SERVING", "DOWN"


class ClusterError(RuntimeError):
    """A local-cluster command cannot do what was asked (the CLI prints it as one line)."""


# What a failed start raises: reported as a ClusterError, the process's log tail included.
START_FAILURES = (EtcdFailed, ProcessFailed)


def default_data_dir() -> Path:
    """The platform's per-user data directory (e.g. ~/.local/share/tidewater/cluster)."""
    return Path(platformdirs.user_data_dir("tidewater")) / "cluster"


@dataclass(frozen=True)
class Member:
    """One process of the cluster, as cluster.json records it."""

    role: str
    id: int
    address: str
    pid: int
    # Prometheus metrics at http://127.0.0.1:<metrics_port>/metrics (etcd's: its client port).
    metrics_port: int = 0

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    @property
    def metrics_address(self) -> str:
        return f"{HOST}:{self.metrics_port}" if self.metrics_port else "-"


@dataclass(frozen=True)
class ClusterFile:
    data_dir: Path
    supervisor_pid: int
    members: tuple[Member, ...]

    @property
    def path(self) -> Path:
        return self.data_dir / CLUSTER_FILE

    def find(self, role: str) -> list[Member]:
        return [m for m in self.members if m.role == role]

    def write(self) -> None:
        document = {
            "cluster": CLUSTER_NAME,
            "supervisor_pid": self.supervisor_pid,
            "processes": [asdict(m) for m in self.members],
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(document, indent=2) + "\n")
        tmp.rename(self.path)  # a reader never sees half a file

    @classmethod
    def read(cls, data_dir: Path) -> ClusterFile | None:
        try:
            document = json.loads((data_dir / CLUSTER_FILE).read_text())
            members = tuple(Member(**m) for m in document["processes"])
            return cls(data_dir, int(document["supervisor_pid"]), members)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ClusterError(f"{data_dir / CLUSTER_FILE} is not a cluster file: {e}") from None


def _port_if_free(port: int) -> int:
    """`port` when nothing listens on it any more, else 0 (any free port)."""
    return port if port and bind_error(HOST, port) is None else 0


def _say_moved(role: str, member_id: int, what: str) -> None:
    """A scrape configuration or a client that had its ports must learn the new ones."""
    print(f"tidewater: {role} {member_id}: {what}", file=sys.stderr, flush=True)


class PortsFile:
    """`ports.json`: per process ("broker-1", ...), the ports it last had ("listen",
    "metrics"; etcd's "peer" too). Written whenever cluster.json is, never deleted."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / PORTS_FILE
        try:
            self.ports: dict[str, dict[str, int]] = json.loads(self.path.read_text())
        except FileNotFoundError:
            self.ports = {}
        except (OSError, ValueError) as e:
            raise ClusterError(f"{self.path} is not a port record: {e}") from None

    def if_free(self, role: str, member_id: int, kind: str) -> int:
        """The recorded port where still free, else 0 (any free port), saying so when taken."""
        port = int(self.ports.get(f"{role}-{member_id}", {}).get(kind, 0))
        free = _port_if_free(port)
        if port and not free:
            _say_moved(role, member_id, f"recorded {kind} port {port} taken, a fresh one instead")
        return free

    def write(self, members: Iterable[Member], etcd_peer_port: int) -> None:
        """Record the members' ports over what was recorded (a process not started yet keeps
        its ports for the next `up`)."""
        for m in members:
            self.ports[f"{m.role}-{m.id}"] = {"listen": m.port, "metrics": m.metrics_port}
            if m.role == "etcd":
                self.ports[f"{m.role}-{m.id}"]["peer"] = etcd_peer_port
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.ports, indent=2, sort_keys=True) + "\n")
        tmp.rename(self.path)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- starting and stopping -----------------------------------------------------------------


class LocalCluster:
    """Starts the processes in dependency order and stops them in reverse; records each one in
    cluster.json as soon as it runs, so `cluster down` finds even a half-started cluster."""

    def __init__(
        self,
        data_dir: Path,
        brokers: int,
        trace: bool = False,
        broker_entry: Sequence[str] = TIDEWATER,
    ) -> None:
        """`broker_entry`: what Python runs for a broker (ManagedProcess's `entry`)."""
        self.data_dir = data_dir
        self.broker_entry = broker_entry
        # Each process writes its own spans here (`cluster up --trace`).
        self.trace_dir = data_dir / "traces" if trace else None
        self.broker_ids = tuple(range(1, brokers + 1))
        self.log_dir = data_dir / "logs"
        # The recorded ports again when still free, so a scrape configuration keeps working
        # across restarts; else port 0, which the process reports once bound.
        self.ports = PortsFile(data_dir)
        self.etcd = EtcdProcess(data_dir / "etcd", self.log_dir / "etcd.log")
        self.processes: dict[tuple[str, int], ManagedProcess] = {}

    def members(self) -> tuple[Member, ...]:
        found = []
        if self.etcd.running:
            found.append(
                Member("etcd", ETCD_ID, self.etcd.endpoint, self.etcd.pid, self.etcd.client_port)
            )
        for (role, member_id), proc in self.processes.items():
            if proc.running and proc.address:
                found.append(Member(role, member_id, proc.address, proc.pid, proc.metrics_port))
        return tuple(found)

    def record(self) -> ClusterFile:
        state = ClusterFile(self.data_dir, os.getpid(), self.members())
        state.write()
        self.ports.write(state.members, self.etcd.peer_port)
        return state

    def start(self) -> ClusterFile:
        """Start everything and return once every process is healthy."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(exist_ok=True)
        self._start_etcd()
        self.record()
        metadata = self._start("metadata", METADATA_ID, metadata_args)
        controllers = [
            self._start(
                "controller",
                controller_id,
                lambda listen, metrics_port, controller_id=controller_id: controller_args(
                    controller_id,
                    self.etcd.endpoint,
                    CLUSTER_NAME,
                    listen,
                    metadata_addresses=(metadata,),
                    metrics_port=metrics_port,
                    min_insync_replicas=MIN_INSYNC_REPLICAS,
                ),
            )
            for controller_id in CONTROLLER_IDS
        ]
        for broker_id in self.broker_ids:
            self._start(
                "broker",
                broker_id,
                lambda listen, metrics_port, broker_id=broker_id: broker_args(
                    broker_id,
                    self.data_dir / f"broker-{broker_id}",
                    listen,
                    # When the whole cluster stops, the last broker has nobody to hand its
                    # leaderships to: do not wait Kafka's long default for it.
                    {
                        "controllers": ",".join(controllers),
                        "controlled.shutdown.timeout.ms": "3000",
                        "min.insync.replicas": str(MIN_INSYNC_REPLICAS),
                    },
                    metrics_port,
                ),
            )
        asyncio.run(wait_healthy(self.members(), controllers, self.broker_ids, START_TIMEOUT_S))
        return self.record()

    def _start_etcd(self) -> None:
        client_port = self.ports.if_free("etcd", ETCD_ID, "listen")
        peer_port = self.ports.if_free("etcd", ETCD_ID, "peer")
        if client_port and peer_port:
            # etcd keeps its peer URL in its data: the same ports bring the same member back.
            self.etcd.client_port, self.etcd.peer_port = client_port, peer_port
            try:
                self.etcd.start(PROCESS_START_TIMEOUT_S)
            except EtcdFailed:
                # Taken since the check (by another process): fresh ones, as when taken before.
                _say_moved("etcd", ETCD_ID, "recorded ports taken, fresh ones instead")
                self.etcd.client_port = self.etcd.peer_port = 0
        if not self.etcd.running:
            self.etcd.start(PROCESS_START_TIMEOUT_S)

    def _start(
        self, role: str, member_id: int, make_args: Callable[[str, int], Sequence[str]]
    ) -> str:
        """Start on the ports it had (`make_args(listen address, metrics port)`), or on any
        when they are taken, even by a process that took one after the check here."""
        listen_port = self.ports.if_free(role, member_id, "listen")
        metrics_port = self.ports.if_free(role, member_id, "metrics")
        try:
            address = self._start_on(
                role, member_id, make_args(f"{HOST}:{listen_port}", metrics_port)
            )
        except ListenRefused:
            if not (listen_port or metrics_port):
                raise
            _say_moved(role, member_id, "recorded ports taken, fresh ones instead")
            address = self._start_on(role, member_id, make_args(f"{HOST}:0", 0))
        self.record()
        return address

    def _start_on(self, role: str, member_id: int, args: Sequence[str]) -> str:
        if self.trace_dir is not None:
            args = [*args, "--trace-file", str(self.trace_dir / f"{role}-{member_id}.jsonl")]
        entry = self.broker_entry if role == "broker" else TIDEWATER
        proc = ManagedProcess(f"{role}-{member_id}", args, self.log_dir, entry=entry)
        self.processes[(role, member_id)] = proc
        return proc.start(PROCESS_START_TIMEOUT_S)

    def dead(self) -> list[str]:
        """Processes that were started and have exited since."""
        gone = [f"etcd (exit {self.etcd.proc.returncode})"] if self._etcd_died() else []
        return gone + [
            f"{name[0]} {name[1]} (exit {proc.proc.returncode})"
            for name, proc in self.processes.items()
            if proc.proc is not None and not proc.running
        ]

    def _etcd_died(self) -> bool:
        return self.etcd.proc is not None and not self.etcd.running

    def stop(self) -> None:
        """SIGTERM each process in STOP_ORDER and wait (SIGKILL after a deadline); then the
        cluster file goes: nothing is left to connect to (the port record stays)."""
        for role in STOP_ORDER[:-1]:
            for (proc_role, _), proc in self.processes.items():
                if proc_role == role:
                    proc.stop(STOP_TIMEOUT_S)
        self.etcd.stop(STOP_TIMEOUT_S)
        state = ClusterFile.read(self.data_dir)
        if state is not None and state.supervisor_pid == os.getpid():
            state.path.unlink(missing_ok=True)


# -- health --------------------------------------------------------------------------------


async def grpc_health(address: str) -> str:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            response = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=PROBE_TIMEOUT_S
            )
        except grpc.aio.AioRpcError:
            return DOWN
    return SERVING if response.status == health_pb2.HealthCheckResponse.SERVING else NOT_SERVING


def _etcd_health(endpoint: str) -> str:
    try:
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=PROBE_TIMEOUT_S) as r:
            return SERVING if json.load(r).get("health") == "true" else NOT_SERVING
    except (OSError, ValueError, urllib.error.URLError):
        return DOWN


async def health(member: Member) -> str:
    if not pid_alive(member.pid):
        return DOWN
    if member.role == "etcd":
        return await asyncio.to_thread(_etcd_health, member.address)
    return await grpc_health(member.address)


async def alive_brokers(controllers: Sequence[str]) -> set[int]:
    """Broker ids the active controller counts alive (registered and unfenced)."""
    client = ControllerClient(controllers)
    try:
        response = await client.call(
            "DescribeCluster", cpb.DescribeClusterRequest(), timeout_s=PROBE_TIMEOUT_S
        )
    except ControllerUnavailable:
        return set()
    finally:
        await client.close()
    return {b.broker.broker_id for b in response.brokers if b.status == cpb.BROKER_STATUS_ALIVE}


async def wait_healthy(
    members: Iterable[Member],
    controllers: Sequence[str],
    broker_ids: Iterable[int],
    timeout_s: float,
) -> None:
    """Until every process answers SERVING and the controller has every broker alive."""
    members, expected = list(members), set(broker_ids)
    deadline = time.monotonic() + timeout_s
    while True:
        healths = await asyncio.gather(*(health(m) for m in members))
        unhealthy = [
            f"{m.role} {m.id}: {h}" for m, h in zip(members, healths, strict=True) if h != SERVING
        ]
        missing = expected - await alive_brokers(controllers) if not unhealthy else expected
        if not unhealthy and not missing:
            return
        if time.monotonic() > deadline:
            detail = ", ".join(unhealthy) or f"brokers not alive: {sorted(missing)}"
            raise ClusterError(f"cluster not healthy after {timeout_s:.0f} s ({detail})")
        await asyncio.sleep(0.2)


# -- the commands --------------------------------------------------------------------------


def _running_cluster(data_dir: Path) -> ClusterFile | None:
    state = ClusterFile.read(data_dir)
    return state if state is not None and is_running(state) else None


def is_running(state: ClusterFile) -> bool:
    """Whether any process the cluster file names still runs."""
    pids = [state.supervisor_pid, *(m.pid for m in state.members)]
    return any(pid_alive(p) and _is_ours(p) for p in pids)


def _is_ours(pid: int) -> bool:
    """Guard against a recorded pid reused by an unrelated process since (where /proc says)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return not Path("/proc/self").exists() and pid_alive(pid)
    except OSError:
        return False
    return b"tidewater" in command or b"etcd" in command


def describe(state: ClusterFile, hints: bool = True) -> str:
    """The processes and the bootstrap address; `hints`: how to connect, watch and stop it
    (not for a cluster about to be stopped, as `tidewater demo`'s)."""
    metadata = ",".join(m.address for m in state.find("metadata"))
    lines = [_table(state.members, None), ""]
    lines.append(f"Bootstrap (metadata service): {metadata}")
    if not hints:
        return "\n".join(lines)
    addresses = ", ".join(repr(m.address) for m in state.find("metadata"))
    lines.append(f"Env:      export TIDEWATER_BOOTSTRAP={metadata}")
    lines.append("Connect:  from tidewater.client import Consumer, Producer")
    lines.append(f"          Producer([{addresses}]) / Consumer([{addresses}])")
    lines.append(f"          grpcurl -plaintext {metadata} list")
    lines.append("Metrics:  curl http://<METRICS>/metrics (Prometheus text, every process)")
    lines.append(f"Status:   tidewater cluster status --data-dir {state.data_dir}")
    lines.append(f"Stop:     tidewater cluster down --data-dir {state.data_dir}")
    return "\n".join(lines)


def _table(members: Sequence[Member], healths: Sequence[str] | None) -> str:
    with_health = healths is not None
    header = ["ROLE", "ID", "ADDRESS", "METRICS", "PID"] + (["HEALTH"] if with_health else [])
    rows = [
        [m.role, str(m.id), m.address, m.metrics_address, str(m.pid)]
        + ([healths[i]] if healths else [])
        for i, m in enumerate(members)
    ]
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    )


def cluster_up(
    data_dir: Path, brokers: int, detach: bool, ready_file: Path | None, trace: bool = False
) -> int:
    if brokers < 1:
        raise ClusterError(f"--brokers must be at least 1, got {brokers}")
    running = _running_cluster(data_dir)
    if running is not None:
        raise ClusterError(
            f"a cluster is already running from {data_dir} (supervisor pid "
            f"{running.supervisor_pid}); `tidewater cluster down --data-dir {data_dir}` first"
        )
    if detach:
        return _up_detached(data_dir, brokers, trace)
    return _up_foreground(data_dir, brokers, ready_file, trace)


def _hold_data_dir(data_dir: Path) -> int:
    """An exclusive lock on the data dir for this supervisor's life (its descriptor, kept
    open): review 27 M2, two `cluster up` at once on one dir both started, and the one that
    failed deleted the other's cluster.json on its way out, leaving it running untracked."""
    data_dir.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(data_dir / "cluster.lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise ClusterError(
            f"another `tidewater cluster up` is starting or running a cluster from {data_dir}"
        ) from None
    return descriptor


def _up_foreground(data_dir: Path, brokers: int, ready_file: Path | None, trace: bool) -> int:
    _hold_data_dir(data_dir)
    cluster = LocalCluster(data_dir, brokers, trace)
    _stop_on(KeyboardInterrupt)
    try:
        try:
            state = cluster.start()
        except START_FAILURES as e:
            raise ClusterError(str(e)) from None
        print(describe(state), flush=True)
        if ready_file is not None:
            ready_file.write_text("ready\n")
        else:
            print("Ctrl-C stops the cluster.", flush=True)
        reported: set[str] = set()
        while True:
            time.sleep(1.0)
            # Supervision: a process that dies is reported (its log says why), not hidden.
            for dead in sorted(set(cluster.dead()) - reported):
                print(f"tidewater: {dead} exited; see {cluster.log_dir}", file=sys.stderr)
                reported.add(dead)
    except KeyboardInterrupt:
        pass  # Ctrl-C or SIGTERM, while starting or running: stop what runs
    finally:
        # A second Ctrl-C while stopping must not abandon the children half-stopped.
        _stop_on(None)
        print("stopping the cluster...", file=sys.stderr, flush=True)
        cluster.stop()
        print("cluster stopped", file=sys.stderr, flush=True)
    return 0


def _stop_on(exception: type[BaseException] | None) -> None:
    """SIGTERM, SIGINT and SIGHUP (its terminal closed: review 27 M3, the processes ran on
    untracked) raise `exception` (None: ignore them)."""

    def handle(signum: int, frame: object) -> None:
        assert exception is not None
        raise exception

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, handle if exception is not None else signal.SIG_IGN)


def _up_detached(data_dir: Path, brokers: int, trace: bool) -> int:
    """Run the supervisor in its own session, logging to a file; return once it is ready."""
    data_dir.mkdir(parents=True, exist_ok=True)
    ready_file = data_dir / "cluster.ready"
    ready_file.unlink(missing_ok=True)
    log_file = data_dir / "cluster.log"
    log_start = log_file.stat().st_size if log_file.exists() else 0
    args = [sys.executable, "-m", "tidewater", "cluster", "up", "--data-dir", str(data_dir)]
    args += ["--brokers", str(brokers), "--ready-file", str(ready_file)]
    if trace:
        args.append("--trace")
    with log_file.open("ab") as log:
        supervisor = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        started = _wait_for(
            lambda: ready_file.exists() or supervisor.poll() is not None, START_TIMEOUT_S + 30
        )
    except KeyboardInterrupt:
        # Ctrl-C reaches this process, not the supervisor in its session: it stops what it
        # started (review 27 M1: the cluster came up in the background all the same).
        supervisor.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            supervisor.wait(STOP_TIMEOUT_S * 4)
        raise
    if not started:
        supervisor.terminate()
    if not ready_file.exists():
        with contextlib.suppress(subprocess.TimeoutExpired):
            supervisor.wait(STOP_TIMEOUT_S * 2)
        with log_file.open("rb") as log:
            log.seek(log_start)
            tail = "\n".join(log.read().decode(errors="replace").splitlines()[-20:])
        raise ClusterError(f"the cluster did not start; {log_file} says:\n{tail}")
    ready_file.unlink()
    state = ClusterFile.read(data_dir)
    assert state is not None, "the supervisor writes the cluster file before the ready file"
    print(describe(state))
    print(f"Running in the background (supervisor pid {supervisor.pid}, log {log_file}).")
    return 0


def _wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def cluster_down(data_dir: Path) -> int:
    state = ClusterFile.read(data_dir)
    if state is None:
        print(f"no cluster recorded in {data_dir}")
        return 0
    if not is_running(state):
        state.path.unlink(missing_ok=True)
        print(f"the cluster recorded in {data_dir} was not running; its record is removed")
        return 0
    # The supervisor stops its children in order; whatever outlives it is stopped here.
    if pid_alive(state.supervisor_pid) and _is_ours(state.supervisor_pid):
        _terminate(state.supervisor_pid, timeout_s=STOP_TIMEOUT_S * 4)
    for role in STOP_ORDER:
        for member in state.find(role):
            if pid_alive(member.pid) and _is_ours(member.pid):
                _terminate(member.pid, STOP_TIMEOUT_S)
    state.path.unlink(missing_ok=True)
    print(f"cluster in {data_dir} stopped ({len(state.members)} processes)")
    return 0


def _terminate(pid: int, timeout_s: float) -> None:
    """SIGTERM, wait, SIGKILL after the deadline."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)  # a paused process cannot handle SIGTERM
        os.kill(pid, signal.SIGTERM)
    if not _wait_for(lambda: not pid_alive(pid), timeout_s):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _wait_for(lambda: not pid_alive(pid), 5.0)


def cluster_status(data_dir: Path, as_json: bool) -> int:
    """Exit status 0 when every process is SERVING, 1 otherwise."""
    state = ClusterFile.read(data_dir)
    if state is None:
        raise ClusterError(f"no cluster recorded in {data_dir} (start one with `cluster up`)")

    async def probe() -> list[str]:
        return list(await asyncio.gather(*(health(m) for m in state.members)))

    healths = asyncio.run(probe())
    if as_json:
        processes = [asdict(m) | {"health": h} for m, h in zip(state.members, healths, strict=True)]
        document = {"data_dir": str(data_dir), "processes": processes}
        print(json.dumps(document, indent=2))
    else:
        print(_table(state.members, healths))
    return 0 if all(h == SERVING for h in healths) else 1
