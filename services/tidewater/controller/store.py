"""The controller's only door to etcd: election, fenced writes, loads. Nothing else imports aetcd.

Layout under `/tidewater/<cluster>/`, values JSON (readable with etcdctl):

    controller            {"id", "endpoint"}, put with the active controller's lease
    controller_epoch      an int, incremented by the txn that wins the election
    brokers/<id>          registration; the key's mod_revision is the broker epoch
    topics/<name>         configs and replica assignment
    deletions/<name>      a deleted topic's partition count and the brokers yet to delete its logs
    partitions/<t>/<p>    LeaderAndIsr; the key's mod_revision is the partition epoch
    producer_ids          an int, the start of the next producer-id block

Every write is one txn comparing controller_epoch to the writer's epoch, so a deposed
controller's writes fail (NotController) and change nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import aetcd
from aetcd.rtypes import Get
from aetcd.utils import prefix_range_end

from tidewater.errors import NotController, PolicyViolation, StoreUnavailable

log = logging.getLogger(__name__)

Json = dict[str, Any]
# (topic, partition, expected mod_revision or None for "must not exist yet", LeaderAndIsr)
PartitionUpdate = tuple[str, int, int | None, Json]

# etcd's --max-txn-ops default. It bounds compares, success ops and failure ops each.
MAX_TXN_OPS = 128
# One compare of a partition txn is the controller epoch.
PARTITIONS_PER_TXN = MAX_TXN_OPS - 1
# The largest topic record written, well under etcd's --max-request-bytes default (1.5 MiB,
# the whole txn): etcd refusing a larger one would read as etcd failing, and the controller
# would resign (review 29 #3). ~50,000 partitions of three replicas.
MAX_TOPIC_RECORD_BYTES = 1 << 20
REQUEST_TIMEOUT_S = 5.0
# Pause before retrying a campaign or a keepalive after etcd did not answer.
RETRY_DELAY_S = 0.2
# A standby re-reads the controller key this often even if its watch reported nothing.
VACANCY_RECHECK_S = 5.0


@dataclass(frozen=True)
class WriteResult:
    """One partition's outcome. When not ok, new_mod_revision and current_value are what etcd
    holds (0 and None: no such key), so the caller can reload that partition."""

    ok: bool
    new_mod_revision: int
    current_value: Json | None


def _encode(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _first(range_response: list[tuple[bytes, Get]]) -> Get | None:
    """aetcd turns a txn's range response into a list of (value, KeyValue with the header)."""
    return range_response[0][1] if range_response else None


def _revision(response: Any) -> int:
    """The store revision a txn's write op was applied at (one per txn)."""
    return int(getattr(response, response.WhichOneof("response")).header.revision)


@contextlib.contextmanager
def _etcd_call(what: str) -> Iterator[None]:
    try:
        yield
    except aetcd.ClientError as e:
        raise StoreUnavailable(f"etcd {what}: {e}") from e


def _stop_if_cancelled() -> None:
    """aetcd's waits (asyncio.wait_for, under Python 3.11) can swallow the cancellation of the
    task awaiting them: a campaign told to stop must stop, not wait on or win."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _held_by(holder: Get, controller_id: int, endpoint: str) -> bool:
    """Whether the controller key names this controller (its id at its address)."""
    try:
        value = json.loads(holder.value)
    except ValueError:
        return False
    return bool(value.get("id") == controller_id and value.get("endpoint") == endpoint)


async def _grpc_target(endpoints: Sequence[str]) -> str:
    """One endpoint as given; several as gRPC's static IPv4 list, which fails over between
    members. A member whose name does not resolve is left out, with a warning, while another
    does (review 37 #2: one member's DNS record gone stopped every controller from starting);
    StoreUnavailable naming each when none does."""
    if len(endpoints) == 1:
        return endpoints[0]
    loop = asyncio.get_running_loop()
    addresses: dict[str, None] = {}
    unresolved = []
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        try:
            found = await loop.getaddrinfo(
                host, int(port), family=socket.AF_INET, type=socket.SOCK_STREAM
            )
        except OSError as e:
            unresolved.append(f"{endpoint}: {e.strerror or e}")
            continue
        for *_, sockaddr in found:
            addresses[f"{sockaddr[0]}:{sockaddr[1]}"] = None
    if not addresses:
        raise StoreUnavailable(f"no etcd endpoint resolves: {'; '.join(unresolved)}")
    for failure in unresolved:
        log.warning("etcd endpoint %s does not resolve; left out until a restart", failure)
    return "ipv4:" + ",".join(addresses)


class ControllerStore:
    """Cluster state in etcd for one controller. `txns` and `txn_ops` count write txns and
    their write ops (for metrics)."""

    def __init__(self, client: aetcd.Client, cluster: str) -> None:
        self._client = client
        self._ops = client.transactions
        self._prefix = f"/tidewater/{cluster}/"
        self._controller_key = self._key("controller")
        self._epoch_key = self._key("controller_epoch")
        self._producer_ids_key = self._key("producer_ids")
        self.lost = asyncio.Event()
        self.txns = 0
        self.txn_ops = 0
        self._lease_id: int | None = None
        self._keepalive: asyncio.Task[None] | None = None

    @classmethod
    async def connect(
        cls,
        endpoints: Sequence[str],
        cluster: str = "default",
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> ControllerStore:
        if not endpoints:
            raise ValueError("no etcd endpoints")
        # aetcd dials f"{host}:{port}"; splitting at the last colon passes any target through.
        host, _, port = (await _grpc_target(endpoints)).rpartition(":")
        # Answers as large as etcd sends (review 34 #1: gRPC's default 4 MiB made the load of
        # ~28,000 partitions fail, and every controller resigned and campaigned in a loop);
        # etcd's own Go client takes up to 2 GiB.
        client = aetcd.Client(
            host,
            int(port),
            timeout=request_timeout_s,
            options={"grpc.max_receive_message_length": -1},
        )
        with _etcd_call("connect"):
            await client.connect()
        return cls(client, cluster)

    async def close(self) -> None:
        """Resign if active, then close the connection."""
        await self.resign()
        await self._client.close()

    def _key(self, path: str) -> bytes:
        return f"{self._prefix}{path}".encode()

    def _partition_key(self, topic: str, partition: int) -> bytes:
        return self._key(f"partitions/{topic}/{partition}")

    # -- election ------------------------------------------------------------------------------

    async def campaign(self, controller_id: int, endpoint: str, lease_ttl_s: int) -> int:
        """Block until this controller is the active one; returns the new controller epoch.
        From then on the lease is kept alive and `lost` is set once it may have expired."""
        if self._keepalive is not None:
            raise RuntimeError("campaign while already the active controller")
        failing = False
        while True:
            _stop_if_cancelled()
            try:
                holder, epoch_kv = await self._read(self._controller_key, self._epoch_key)
                if failing:
                    log.info("controller %d campaign: etcd answers again", controller_id)
                    failing = False
                if holder is None:
                    epoch = await self._try_to_win(controller_id, endpoint, lease_ttl_s, epoch_kv)
                    if epoch is not None:
                        _stop_if_cancelled()
                        return epoch
                elif _held_by(holder, controller_id, endpoint) and holder.lease:
                    # Ours, under a lease nobody keeps alive: an election txn whose answer was
                    # lost, or this process's previous life. Revoked rather than waited out
                    # for a TTL while everyone names this controller (review 34 #6).
                    log.info("controller %d campaign: revoking its own stale lease", controller_id)
                    with _etcd_call("lease revoke"):
                        await self._client.revoke_lease(holder.lease)
                else:
                    # From the read on, not from the holder's election: etcd compacts its
                    # history, and a watch from a compacted revision fails at once.
                    await self._wait_for_vacancy(holder.header.revision + 1)
            except StoreUnavailable as e:
                # Once per outage: a standby retries five times a second while etcd is away.
                log.log(
                    logging.DEBUG if failing else logging.WARNING,
                    "controller %d campaign: %s; retrying until etcd answers",
                    controller_id,
                    e,
                )
                failing = True
                await asyncio.sleep(RETRY_DELAY_S)

    async def _try_to_win(
        self,
        controller_id: int,
        endpoint: str,
        lease_ttl_s: int,
        epoch_kv: aetcd.KeyValue | None,
    ) -> int | None:
        """One election txn: create the controller key with our lease and bump the epoch, both
        only if nobody holds the key and nobody bumped the epoch since we read it."""
        epoch = (json.loads(epoch_kv.value) if epoch_kv else 0) + 1
        # Seen from here, the lease's TTL runs from before the grant request.
        granted_at = asyncio.get_running_loop().time()
        with _etcd_call("lease grant"):
            lease = await self._client.lease(lease_ttl_s)
        won, _ = await self._write(
            [
                self._ops.create(self._controller_key) == 0,
                self._ops.mod(self._epoch_key) == (epoch_kv.mod_revision if epoch_kv else 0),
            ],
            [
                self._ops.put(
                    self._controller_key,
                    _encode({"id": controller_id, "endpoint": endpoint}),
                    lease=lease.id,
                ),
                self._ops.put(self._epoch_key, _encode(epoch)),
            ],
            [],
        )
        if not won:
            with contextlib.suppress(aetcd.ClientError):
                await self._client.revoke_lease(lease.id)
            return None
        self.lost.clear()
        self._lease_id = lease.id
        self._keepalive = asyncio.create_task(
            self._keep_alive(lease.id, lease.ttl, granted_at), name=f"etcd-lease-{lease.id:x}"
        )
        return epoch

    async def _wait_for_vacancy(self, from_revision: int) -> None:
        """Return when the controller key may have been deleted (or after a while, so the
        caller re-reads it anyway)."""
        with _etcd_call("watch"), contextlib.suppress(aetcd.WatchTimeoutError):
            event = await self._client.watch_once(
                self._controller_key,
                timeout=VACANCY_RECHECK_S,
                start_revision=from_revision,
                kind=aetcd.EventKind.DELETE,
            )
            if not isinstance(event, aetcd.Event):
                # aetcd hands over a broken watch stream's error as the event
                raise StoreUnavailable(f"etcd watch: {event!r}")

    async def _keep_alive(self, lease_id: int, ttl: int, granted_at: float) -> None:
        """Refresh every ttl/3. The lease counts as lost once etcd says it is gone, or once no
        refresh sent within the last ttl was answered: etcd may have expired it by then."""
        loop = asyncio.get_running_loop()
        expires = granted_at + ttl
        delay = ttl / 3
        while True:
            await asyncio.sleep(max(0.0, min(delay, expires - loop.time())))
            sent = loop.time()
            if sent >= expires:
                reason = "no keepalive answered within the lease TTL"
                break
            try:
                async with asyncio.timeout(expires - sent):  # not wait_for: see fetcher.py
                    reply = await self._client.refresh_lease(lease_id)
            except TimeoutError:
                reason = "no keepalive answered within the lease TTL"
                break
            except aetcd.ClientError as e:
                log.warning("lease %x keepalive failed: %s; retrying", lease_id, e)
                delay = min(ttl / 3, RETRY_DELAY_S)
                continue
            if reply.TTL <= 0:
                reason = "etcd expired the lease"
                break
            expires = sent + reply.TTL
            delay = ttl / 3
        log.warning("controller lease %x lost: %s", lease_id, reason)
        self._keepalive = None
        self._lease_id = None
        self.lost.set()
        # The lease may still be alive in etcd: revoking it lets a standby take over now.
        with contextlib.suppress(aetcd.ClientError, TimeoutError):
            async with asyncio.timeout(ttl / 3):
                await self._client.revoke_lease(lease_id)

    async def resign(self) -> None:
        """Stop being the active controller: `lost` is set, then the lease (and with it the
        controller key) is revoked so a standby wins at once."""
        task, lease_id = self._keepalive, self._lease_id
        if task is None or lease_id is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        self._keepalive = None
        self._lease_id = None
        self.lost.set()
        try:
            with _etcd_call("lease revoke"):
                await self._client.revoke_lease(lease_id)
        except StoreUnavailable as e:
            log.warning("resign: %s; the lease will expire on its own", e)

    async def active_controller(self) -> tuple[int, str, int] | None:
        """(controller id, endpoint, controller epoch) of the active controller, if any."""
        holder, epoch_kv = await self._read(self._controller_key, self._epoch_key)
        if holder is None or epoch_kv is None:
            return None
        value = json.loads(holder.value)
        return int(value["id"]), str(value["endpoint"]), int(json.loads(epoch_kv.value))

    # -- partitions ----------------------------------------------------------------------------

    async def write_partitions(
        self,
        epoch: int,
        updates: Sequence[PartitionUpdate],
        topic: tuple[str, Json] | None = None,
    ) -> list[WriteResult]:
        """Write LeaderAndIsr values, each only if its key's mod_revision (partition epoch) is
        still the expected one, in as few txns as etcd allows. A key already holding exactly the
        value counts as written (a retried write). Results are in the order of `updates`.

        `topic` (name, value): a topic's configs and assignment, put in the txn of the first
        updates (of all of them, up to PARTITIONS_PER_TXN; on its own when there are none):
        past one txn, a failover may leave it written with some of the updates, never updates
        without it (review 34 #3: written last, a lower min.insync.replicas could stay unwritten
        with ELRs cleared for it; the other way round, leaders hold the HW for the ELRs left,
        and the next controller clears them as it loads). If one of those updates' compare
        fails, the topic is not written and StoreUnavailable is raised: etcd holds a state
        this controller does not know, and the controller resigns, so that whoever wins loads
        it (review 17 M1)."""
        starts = range(0, len(updates), PARTITIONS_PER_TXN)
        chunks = [range(s, min(s + PARTITIONS_PER_TXN, len(updates))) for s in starts]
        results: dict[int, WriteResult] = {}
        for i, chunk in enumerate(chunks or [range(0)]):
            also = [] if topic is None or i > 0 else [self._topic_put(*topic)]
            results.update(await self._write_partition_chunk(epoch, updates, list(chunk), also))
        return [results[i] for i in range(len(updates))]

    async def _write_partition_chunk(
        self, epoch: int, updates: Sequence[PartitionUpdate], pending: list[int], also: list[Any]
    ) -> dict[int, WriteResult]:
        """`also`: ops to apply in the txn that writes the partitions (on their own if there
        are none)."""
        results = {}
        keys = {i: self._partition_key(updates[i][0], updates[i][1]) for i in pending}
        # Every round settles at least one key (the one whose compare failed), so this ends.
        while pending:
            ok, responses = await self._fenced(
                epoch,
                [self._ops.mod(keys[i]) == (updates[i][2] or 0) for i in pending],
                [*(self._ops.put(keys[i], _encode(updates[i][3])) for i in pending), *also],
                [self._ops.get(keys[i]) for i in pending],
            )
            if ok:
                revision = _revision(responses[0])
                for i in pending:
                    results[i] = WriteResult(True, revision, updates[i][3])
                return results
            if also:
                raise StoreUnavailable(
                    "etcd holds another state of "
                    + ", ".join(f"{updates[i][0]}-{updates[i][1]}" for i in pending)
                    + " than this controller's: the topic's value is not written"
                )
            retry = []
            for i, response in zip(pending, responses, strict=True):
                kv = _first(response)
                mod_revision = kv.mod_revision if kv else 0
                current = json.loads(kv.value) if kv else None
                if mod_revision == (updates[i][2] or 0):
                    retry.append(i)  # its compare held; another key failed the txn
                else:
                    results[i] = WriteResult(current == updates[i][3], mod_revision, current)
            pending = retry
        if also:
            await self._fenced(epoch, [], also)
        return results

    async def load_partitions(self) -> dict[tuple[str, int], tuple[Json, int]]:
        """Every partition's LeaderAndIsr and partition epoch (mod_revision)."""
        partitions = {}
        for path, kv in await self._load("partitions/"):
            topic, _, partition = path.rpartition("/")
            partitions[topic, int(partition)] = (json.loads(kv.value), kv.mod_revision)
        return partitions

    # -- topics --------------------------------------------------------------------------------

    async def put_topic(self, epoch: int, name: str, config: Json) -> int:
        """Create or replace a topic's configs and assignment; returns the revision written."""
        _, responses = await self._fenced(epoch, [], [self._topic_put(name, config)])
        return _revision(responses[0])

    def _topic_put(self, name: str, config: Json) -> Any:
        value = _encode(config)
        if len(value) > MAX_TOPIC_RECORD_BYTES:
            raise PolicyViolation(
                f"topic {name!r}: its assignment takes {len(value)} bytes, more than the "
                f"{MAX_TOPIC_RECORD_BYTES} bytes the controller writes to etcd in one topic record"
            )
        return self._ops.put(self._key(f"topics/{name}"), value)

    async def delete_topic(self, epoch: int, name: str, deletion: Json) -> bool:
        """Delete a topic and all its partitions, and record its pending deletion, in one txn;
        False if there was no such topic."""
        partitions = self._key(f"partitions/{name}/")
        _, responses = await self._fenced(
            epoch,
            [],
            [
                self._ops.delete(self._key(f"topics/{name}")),
                self._ops.delete(partitions, prefix_range_end(partitions)),
                self._ops.put(self._key(f"deletions/{name}"), _encode(deletion)),
            ],
        )
        return bool(responses[0].response_delete_range.deleted)

    async def put_deletion(self, epoch: int, name: str, deletion: Json | None) -> None:
        """Update a pending topic deletion; None: it is complete, forget it."""
        key = self._key(f"deletions/{name}")
        op = self._ops.delete(key) if deletion is None else self._ops.put(key, _encode(deletion))
        await self._fenced(epoch, [], [op])

    async def load_deletions(self) -> dict[str, Json]:
        return {name: json.loads(kv.value) for name, kv in await self._load("deletions/")}

    async def load_topics(self) -> dict[str, Json]:
        return {name: json.loads(kv.value) for name, kv in await self._load("topics/")}

    # -- brokers -------------------------------------------------------------------------------

    async def put_broker(self, epoch: int, broker_id: int, registration: Json) -> int:
        """Store a registration; returns the broker epoch (the revision of this write), larger
        than any epoch this broker id had before."""
        _, responses = await self._fenced(
            epoch, [], [self._ops.put(self._key(f"brokers/{broker_id}"), _encode(registration))]
        )
        return _revision(responses[0])

    async def delete_broker(self, epoch: int, broker_id: int) -> bool:
        _, responses = await self._fenced(
            epoch, [], [self._ops.delete(self._key(f"brokers/{broker_id}"))]
        )
        return bool(responses[0].response_delete_range.deleted)

    async def load_brokers(self) -> dict[int, Json]:
        """Registrations by broker id, each with "epoch" set to its broker epoch."""
        return {
            int(broker_id): {**json.loads(kv.value), "epoch": kv.mod_revision}
            for broker_id, kv in await self._load("brokers/")
        }

    # -- producer ids --------------------------------------------------------------------------

    async def allocate_producer_ids(self, epoch: int, block_size: int) -> int:
        """Reserve [first, first + block_size) and return first. Compare-and-swap on the key's
        mod_revision, so no two blocks overlap, whoever allocates."""
        if block_size <= 0:
            raise ValueError(f"producer id block size must be positive, not {block_size}")
        (kv,) = await self._read(self._producer_ids_key)
        while True:
            first = json.loads(kv.value) if kv else 0
            ok, responses = await self._fenced(
                epoch,
                [self._ops.mod(self._producer_ids_key) == (kv.mod_revision if kv else 0)],
                [self._ops.put(self._producer_ids_key, _encode(first + block_size))],
                [self._ops.get(self._producer_ids_key)],
            )
            if ok:
                return int(first)
            kv = _first(responses[0])

    # -- txns ----------------------------------------------------------------------------------

    async def _fenced(
        self, epoch: int, compare: list[Any], success: list[Any], failure: Sequence[Any] = ()
    ) -> tuple[bool, list[Any]]:
        """A write txn that also requires controller_epoch == epoch. Raises NotController if
        that compare failed; otherwise returns (succeeded, responses of the branch taken, the
        failure branch's without its controller_epoch read)."""
        ok, responses = await self._write(
            [self._ops.value(self._epoch_key) == _encode(epoch), *compare],
            success,
            [self._ops.get(self._epoch_key), *failure],
        )
        if ok:
            return True, responses
        epoch_kv = _first(responses[0])
        current = json.loads(epoch_kv.value) if epoch_kv else None
        if current != epoch:
            raise NotController(
                f"controller epoch {epoch} is not current (etcd holds {current}): "
                "another controller was elected"
            )
        return False, responses[1:]

    async def _write(
        self, compare: list[Any], success: list[Any], failure: Sequence[Any]
    ) -> tuple[bool, list[Any]]:
        self.txns += 1
        self.txn_ops += len(success)
        with _etcd_call("txn"):
            ok, responses = await self._client.transaction(
                compare=compare, success=success, failure=list(failure)
            )
        return bool(ok), responses

    async def _read(self, *keys: bytes) -> list[Get | None]:
        """Several keys at one revision (each found key's `header.revision`)."""
        with _etcd_call("read"):
            _, responses = await self._client.transaction(
                compare=[], success=[self._ops.get(key) for key in keys], failure=[]
            )
        return [_first(response) for response in responses]

    async def _load(self, path: str) -> list[tuple[str, aetcd.KeyValue]]:
        """(path below `path`, KeyValue) for every key under `path`."""
        prefix = self._key(path)
        with _etcd_call(f"range {path}"):
            found = await self._client.get_prefix(prefix)
        return [(kv.key[len(prefix) :].decode(), kv) for kv in found]
