"""A Tidewater service as a supervised child process (used by the demo and the tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tidewater.rpc.address import LISTEN_FAILED_EXIT


class ProcessFailed(RuntimeError):
    pass


class ListenRefused(ProcessFailed):
    """It exited because it could not bind its address: another process has it."""


# Between the starts of a process whose address another process holds for a while.
START_AGAIN_AFTER_S = 0.2


# Runs the rest of its command line under a file size limit (argv[1], bytes): a write past it
# fails with EFBIG, as a write to a full disk fails with ENOSPC (SIGXFSZ, which would kill the
# process instead, stays ignored through the exec).
_UNDER_FILE_SIZE_LIMIT = (
    "import os, resource, signal, sys; "
    "limit = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)); "
    "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)


# How Python is told to run a service: the package's command line. A benchmark may give a
# script of its own that wraps it (tests/benchmarks/switched_broker.py).
TIDEWATER = ("-m", "tidewater")


class ManagedProcess:
    """Starts a `python -m tidewater ...` child that writes its address to a ready file.
    With `file_size_limit`, no file it writes can grow past that many bytes (a disk that
    fails, for fault tests); `entry`: what Python runs in place of `-m tidewater`."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        work_dir: Path,
        file_size_limit: int | None = None,
        entry: Sequence[str] = TIDEWATER,
    ) -> None:
        self.name = name
        self.args = list(args)
        self.entry = tuple(entry)
        self.file_size_limit = file_size_limit
        self.work_dir = work_dir
        self.ready_file = work_dir / f"{name}.ready"
        self.log_file = work_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""
        # Where it serves metrics (started with a metrics port, 0 included), else "".
        self.metrics_address = ""

    def start(self, timeout_s: float = 30.0) -> str:
        """Start and wait until it serves; returns its address (host:port)."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.ready_file.unlink(missing_ok=True)
        with self.log_file.open("ab") as log:
            limited = (
                []
                if self.file_size_limit is None
                else ["-c", _UNDER_FILE_SIZE_LIMIT, str(self.file_size_limit)]
            )
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    *limited,
                    *self.entry,
                    *self.args,
                    "--ready-file",
                    str(self.ready_file),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                failed = (
                    ListenRefused if self.proc.returncode == LISTEN_FAILED_EXIT else ProcessFailed
                )
                raise failed(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise ProcessFailed(
                    f"{self.name} not ready after {timeout_s} s:\n{self.log_tail()}"
                )
            time.sleep(0.02)
        self.address, _, self.metrics_address = self.ready_file.read_text().partition("\n")
        return self.address

    def start_when_free(self, timeout_s: float = 30.0) -> str:
        """start() on a fixed address (a restart at its old one, once the old process has
        exited) that another process may have taken meanwhile, for a while (most likely as
        the local port of a connection of its own): started again until it binds, within
        `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.start(max(deadline - time.monotonic(), START_AGAIN_AFTER_S))
            except ListenRefused:
                if time.monotonic() + START_AGAIN_AFTER_S > deadline:
                    raise
                time.sleep(START_AGAIN_AFTER_S)

    @property
    def metrics_port(self) -> int:
        """The metrics port it bound (0: none)."""
        return int(self.metrics_address.rpartition(":")[2] or 0)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.running:
            os.kill(self.pid, sig)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM (clean shutdown), then SIGKILL if it does not exit in time."""
        if self.proc is None:
            return None
        if self.running:
            self.signal(signal.SIGCONT)  # a paused process cannot handle SIGTERM
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        """kill -9, as a crash."""
        if self.running:
            self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def broker_args(
    broker_id: int,
    log_dir: Path,
    listen: str,
    settings: dict[str, str],
    metrics_port: int | None = None,
    config: Path | None = None,
    advertised: str = "",
) -> list[str]:
    """`config`: a broker TOML file under the flags and settings."""
    args = ["broker", "--broker-id", str(broker_id), "--listen", listen, "--log-dirs", str(log_dir)]
    args += advertised_args(advertised)
    if config is not None:
        args += ["--config", str(config)]
    for key, value in settings.items():
        args += ["--set", f"{key}={value}"]
    return args + metrics_args(metrics_port)


def broker_process(
    broker_id: int,
    work_dir: Path,
    settings: dict[str, str],
    *,
    listen: str = "127.0.0.1:0",
    metrics_port: int | None = None,
    config: Path | None = None,
    advertised: str = "",
    file_size_limit: int | None = None,
) -> ManagedProcess:
    """Broker `broker_id` as a child process (not started) named broker-N: its log dir, log
    and ready files under `work_dir`, the same place on a restart."""
    name = f"broker-{broker_id}"
    args = broker_args(
        broker_id, work_dir / name, listen, settings, metrics_port, config, advertised
    )
    return ManagedProcess(name, args, work_dir, file_size_limit)


def controller_args(
    controller_id: int,
    etcd_endpoint: str,
    cluster: str,
    listen: str,
    lease_ttl_s: int = 5,
    broker_session_timeout_ms: int = 6000,
    metadata_addresses: tuple[str, ...] = (),
    leader_imbalance_check_interval_s: float = 300,
    metrics_port: int | None = None,
    advertised: str = "",
    min_insync_replicas: int | None = None,
) -> list[str]:
    """`min_insync_replicas`: the controller's default for topics (None: its own, 1)."""
    return [
        "controller",
        "--controller-id",
        str(controller_id),
        "--listen",
        listen,
        "--etcd",
        etcd_endpoint,
        "--cluster",
        cluster,
        "--lease-ttl",
        str(lease_ttl_s),
        "--broker-session-timeout-ms",
        str(broker_session_timeout_ms),
        "--metadata",
        ",".join(metadata_addresses),
        "--leader-imbalance-check-interval-s",
        str(leader_imbalance_check_interval_s),
        *metrics_args(metrics_port),
        *advertised_args(advertised),
        *(
            []
            if min_insync_replicas is None
            else ["--min-insync-replicas", str(min_insync_replicas)]
        ),
    ]


def metadata_args(listen: str, metrics_port: int | None = None) -> list[str]:
    return ["metadata", "--listen", listen, *metrics_args(metrics_port)]


def advertised_args(advertised: str) -> list[str]:
    """The address to publish, when not the bound one."""
    return ["--advertised-address", advertised] if advertised else []


def metrics_args(metrics_port: int | None) -> list[str]:
    return [] if metrics_port is None else ["--metrics-port", str(metrics_port)]
