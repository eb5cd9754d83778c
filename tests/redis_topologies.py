"""Redis topologies of a test's own, on loopback: a Redis Cluster and a Sentinel-managed primary.

    with redis_cluster(tmp_path, primaries=3, replicas=1) as cluster:
        cluster.url                      # redis+cluster://127.0.0.1:P1,...
        node = cluster.primary_for("gw:{default}:leases")
        cluster.kill(node)               # SIGKILL, as a crash
        cluster.wait_promoted(node)      # a replica took its slots
    with redis_sentinels(tmp_path) as s:
        s.url                            # redis+sentinel://127.0.0.1:S1,.../mymaster
        s.kill_primary(); s.wait_failover()

Every process is a `redis-server` (`--cluster-enabled yes`, or `--sentinel` with a config file
written here) started by the test and killed when the block ends; the cluster is formed with
`redis-cli --cluster create`. Timeouts are short so a failover takes seconds: a cluster node
is failed after `cluster-node-timeout` 1000 ms, a Sentinel primary after
`down-after-milliseconds` 1000 ms. Like tests/servers.py's `redis_server`, a missing
redis-server is a failure, never a skip.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.cluster import key_slot

from tests.servers import free_port

NODE_TIMEOUT_MS = 1000  # cluster-node-timeout, and the Sentinels' down-after-milliseconds
SERVICE = "mymaster"


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} is not installed (Debian: apt-get install redis-server; "
                           "`make test` installs it when run as root)")
    return found


def _wait(what: str, ready: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ready():
                return
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout} s")
        time.sleep(0.1)


@dataclass
class Node:
    """One redis-server process (a cluster node, a primary or replica, or a Sentinel)."""

    port: int
    dir: Path
    args: list[str]
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / "redis.log", "ab") as log:  # the child keeps its own copy
            self.process = subprocess.Popen([_binary("redis-server"), *self.args],
                                            cwd=self.dir, stdout=log, stderr=subprocess.STDOUT)
        _wait(f"redis-server on port {self.port} to answer", self.answers, 10)

    def client(self, **kw: object) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2,
                           socket_connect_timeout=2, decode_responses=True, **kw)  # type: ignore[arg-type]

    def answers(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"redis-server on port {self.port} exited: {self.log()[-2000:]}")
        with self.client() as c:
            return bool(c.ping())

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: gone as in a crash, not a clean shutdown."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        if self.process is not None:
            self.process.wait(5)

    def log(self) -> str:
        path = self.dir / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _cluster_port() -> int:
    """A free loopback port for a cluster node whose bus port (port + 10000) is free too:
    Redis 7.0 puts the bus there and refuses a port above 55535. Both below the kernel's
    ephemeral range: a port free when checked could otherwise be taken by any outgoing
    connection before redis-server binds it (seen once in a full suite)."""
    high = min(55535, _ephemeral_low() - 10001)
    for _ in range(500):
        port = random.randint(20000, high) if high > 20000 else random.randint(20000, 55535)
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _data_args(port: int, d: Path, *extra: str) -> list[str]:
    return ["--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
            "--dir", str(d), *extra]


# --- Redis Cluster -----------------------------------------------------------------------


@dataclass
class Cluster:
    nodes: list[Node]
    killed: list[Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.alive]

    def client(self) -> redis.RedisCluster:
        """A plain redis-py cluster client for the test's own reads."""
        return redis.RedisCluster(
            startup_nodes=[redis.cluster.ClusterNode("127.0.0.1", n.port) for n in self.live()],
            decode_responses=True, socket_timeout=2, socket_connect_timeout=2)

    def slots(self) -> dict[int, list[tuple[int, int]]]:
        """Primary port -> its slot ranges, as a live node sees them."""
        out: dict[int, list[tuple[int, int]]] = {}
        with self.live()[0].client() as c:
            for start, end, primary, *_ in c.execute_command("CLUSTER", "SLOTS"):
                out.setdefault(int(primary[1]), []).append((int(start), int(end)))
        return out

    def primary_for(self, key: str) -> Node:
        owner = self.owner(key_slot(key.encode()))
        if owner is None:
            raise LookupError(f"no primary serves {key!r}")
        return owner

    def ok(self) -> bool:
        """Every live node says cluster_state:ok and sees every slot served by a live node."""
        live = {n.port for n in self.live()}
        for node in self.live():
            with node.client() as c:
                if "cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                    return False
        owners = self.slots()
        covered = sum(b - a + 1 for ranges in owners.values() for a, b in ranges)
        return covered == 16384 and set(owners) <= live

    def kill(self, node: Node) -> list[tuple[int, int]]:
        """SIGKILL a node; the slot ranges it served (empty for a replica)."""
        ranges = self.slots().get(node.port, [])
        node.kill()
        self.killed.append(node)
        return ranges

    def wait_promoted(self, ranges: list[tuple[int, int]], timeout: float = 20) -> Node:
        """Wait until a live node serves the slots in `ranges` (a killed primary's) and every
        live node says the cluster is ok; that node, the new primary."""
        slot = ranges[0][0]

        def promoted() -> bool:
            owner = self.owner(slot)
            return owner is not None and owner.alive and self.ok()

        _wait(f"a replica promoted to serve slot {slot}", promoted, timeout)
        owner = self.owner(slot)
        assert owner is not None
        return owner

    def owner(self, slot: int) -> Node | None:
        for port, owned in self.slots().items():
            if any(a <= slot <= b for a, b in owned):
                return next(n for n in self.nodes if n.port == port)
        return None


@contextlib.contextmanager
def redis_cluster(tmp_path: Path, primaries: int = 3, replicas: int = 1) -> Iterator[Cluster]:
    """`primaries` primaries with `replicas` replicas each, formed and ok, until the block
    ends."""
    count = primaries * (1 + replicas)
    nodes = []
    for _ in range(count):
        port = _cluster_port()
        d = tmp_path / f"cluster-{port}"
        nodes.append(Node(port, d, _data_args(
            port, d, "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
            # a replica may always take over, however long since it heard from its primary
            "--cluster-replica-validity-factor", "0")))
    cluster = Cluster(nodes)
    try:
        for node in nodes:
            node.start()
        create = subprocess.run(
            [_binary("redis-cli"), "--cluster", "create",
             *(f"127.0.0.1:{n.port}" for n in nodes), "--cluster-replicas", str(replicas),
             "--cluster-yes"], capture_output=True, text=True, timeout=60)
        if create.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{create.stdout[-3000:]}"
                               f"\n{create.stderr[-3000:]}")
        _wait("the cluster ok on every node", cluster.ok, 30)
        if replicas:
            _wait("every primary's replicas in sync", lambda: _replicas_synced(cluster,
                                                                               replicas), 30)
        yield cluster
    finally:
        for node in nodes:
            node.kill()


def _replicas_synced(cluster: Cluster, replicas: int) -> bool:
    for port in cluster.slots():
        node = next(n for n in cluster.nodes if n.port == port)
        with node.client() as c:
            info = c.info("replication")
            online = [v for k, v in info.items() if k.startswith("slave")
                      and isinstance(v, dict) and v.get("state") == "online"]
            if len(online) < replicas:
                return False
    return True


# --- a primary, its replica and three Sentinels ------------------------------------------


@dataclass
class Sentinels:
    primary: Node
    replica: Node
    sentinels: list[Node]

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{n.port}" for n in self.sentinels) \
            + f"/{SERVICE}"

    def master_port(self) -> int | None:
        """The primary's port as a quorum of live Sentinels names it (None: no agreement)."""
        named: dict[int, int] = {}
        for s in self.sentinels:
            if not s.alive:
                continue
            with s.client() as c:
                _, port = c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
                named[int(port)] = named.get(int(port), 0) + 1
        best = max(named.items(), key=lambda kv: kv[1], default=None)
        return best[0] if best and best[1] >= 2 else None

    def current(self) -> Node:
        port = self.master_port()
        return next(n for n in (self.primary, self.replica) if n.port == port)

    def client(self) -> redis.Redis:
        """A plain client on the primary the Sentinels name now, for the test's own reads."""
        return self.current().client()

    def ready(self) -> bool:
        """Every Sentinel sees the primary, its replica in sync and the two other Sentinels."""
        port = self.master_port()
        if port is None:
            return False
        node = self.current()
        with node.client() as c:
            info = c.info("replication")
            if info.get("role") != "master" or info.get("connected_slaves", 0) < 1:
                return False
        for s in self.sentinels:
            with s.client() as c:
                m = c.execute_command("SENTINEL", "MASTER", SERVICE)
                state = dict(zip(m[::2], m[1::2], strict=False)) if isinstance(m, list) else m
                if int(state["num-slaves"]) < 1 or int(state["num-other-sentinels"]) < 2:
                    return False
        return True

    def kill_primary(self) -> Node:
        old = self.current()
        old.kill()
        return old

    def wait_failover(self, old: Node, timeout: float = 30) -> Node:
        """Wait until the Sentinels name another primary and it takes writes; that node."""
        def switched() -> bool:
            port = self.master_port()
            if port is None or port == old.port:
                return False
            with self.current().client() as c:
                return c.info("replication").get("role") == "master"

        _wait("the Sentinels to promote the replica", switched, timeout)
        return self.current()


def _sentinel_conf(port: int, primary_port: int, d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    conf = d / "sentinel.conf"
    conf.write_text(f"""bind 127.0.0.1
port {port}
dir {d}
sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 2
sentinel down-after-milliseconds {SERVICE} {NODE_TIMEOUT_MS}
sentinel failover-timeout {SERVICE} 10000
sentinel parallel-syncs {SERVICE} 1
""")
    return conf


@contextlib.contextmanager
def redis_sentinels(tmp_path: Path) -> Iterator[Sentinels]:
    """A primary, a replica of it and three Sentinels (quorum 2) watching it, until the block
    ends."""
    p, r = free_port(), free_port()
    primary = Node(p, tmp_path / f"primary-{p}", _data_args(p, tmp_path / f"primary-{p}"))
    replica = Node(r, tmp_path / f"replica-{r}", _data_args(
        r, tmp_path / f"replica-{r}", "--replicaof", "127.0.0.1", str(p)))
    sentinels = []
    for _ in range(3):
        port = free_port()
        d = tmp_path / f"sentinel-{port}"
        # Sentinel rewrites its config file as it learns: the file must be its own.
        sentinels.append(Node(port, d, [str(_sentinel_conf(port, p, d)), "--sentinel"]))
    group = Sentinels(primary, replica, sentinels)
    try:
        for node in (primary, replica, *sentinels):
            node.start()
        _wait("the Sentinels to see the primary, its replica and each other", group.ready, 30)
        yield group
    finally:
        for node in (*sentinels, replica, primary):
            node.kill()
