"""Real Redis topologies on loopback free ports, for tests: a Redis Cluster (3 masters, 3 replicas,
made by `redis-cli --cluster create`) and a Sentinel setup (one master, one replica, one sentinel).
Both fail over fast (node timeout / down-after 1 s), so a test can kill a master and watch."""

from __future__ import annotations

import random
import shutil
import signal
import socket
from pathlib import Path

from extproc.localstack import Proc, free_port, port_free, wait_until


def command(port: int, *args: str) -> str:
    """One command over a raw socket (inline RESP), the reply as text; "" when the node is down."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            s.sendall(("*%d\r\n" % len(args) + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)).encode())
            data = b""
            while True:
                chunk = s.recv(65536)
                data += chunk
                if not chunk or _complete(data):
                    return data.decode(errors="replace")
    except OSError:
        return ""


def _complete(data: bytes) -> bool:
    if data[:1] in (b"+", b"-", b":"):
        return data.endswith(b"\r\n")
    if data[:1] == b"$":
        head, _, rest = data.partition(b"\r\n")
        n = int(head[1:])
        return n < 0 or len(rest) >= n + 2
    if data[:1] == b"*":  # arrays of bulk strings (sentinel's address reply)
        parts = data.split(b"\r\n")
        n = int(parts[0][1:])
        return n < 0 or len(parts) >= 2 * n + 2
    return False


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too: both must be <= 65535."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 55000)
        if port_free(port) and port_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")



def _server(name: str, port: int, log_dir: Path, *extra: str) -> Proc:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (make test installs it through apt)")
    data = log_dir / name  # a replica writes the master's snapshot to its directory: never the checkout
    data.mkdir(parents=True, exist_ok=True)
    proc = Proc(name, [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                       "--appendonly", "no", "--dir", str(data), *extra], log_dir)
    proc.wait_ready(lambda: command(port, "PING").startswith(("+PONG", "-")), timeout=15)
    return proc


class LocalCluster:
    """3 masters + 3 replicas; `nodes` are the "host:port" seeds a client is given."""

    def __init__(self, log_dir: Path, replicas: bool = True) -> None:
        self.ports: list[int] = []
        while len(self.ports) < (6 if replicas else 3):
            port = _cluster_port()
            if port not in self.ports and port + 10000 not in self.ports:
                self.ports.append(port)
        self.procs: dict[int, Proc] = {}
        for port in self.ports:
            data = log_dir / f"cluster-{port}"
            data.mkdir(parents=True, exist_ok=True)
            self.procs[port] = _server(f"redis-cluster-{port}", port, log_dir, "--cluster-enabled", "yes",
                                       "--cluster-config-file", str(data / "nodes.conf"), "--dir", str(data),
                                       "--cluster-node-timeout", "1000",
                                       # a replica promotes however long since it last heard its master
                                       "--cluster-replica-validity-factor", "0")
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed (it comes with redis-server's package)")
        create = Proc("redis-cluster-create", [cli, "--cluster", "create",
                                               *(f"127.0.0.1:{p}" for p in self.ports),
                                               "--cluster-replicas", "1" if replicas else "0",
                                               "--cluster-yes"], log_dir)
        wait_until(lambda: create.popen.poll() is not None, 30, "redis-cli --cluster create")
        if create.popen.returncode:
            raise RuntimeError(f"cluster create failed:\n{create.log()}")
        wait_until(self.healthy, 30, "cluster_state:ok on every node")
        wait_until(self.replicas_synced, 30, "every replica in sync")

    def replicas_synced(self) -> bool:
        roles = [command(p, "INFO", "replication") for p in self.ports]
        return all("master_link_status:up" in r for r in roles if "role:slave" in r)

    @property
    def nodes(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    def healthy(self) -> bool:
        live = [p for p in self.ports if p in self.procs]
        return all("cluster_state:ok" in command(p, "CLUSTER", "INFO") for p in live)

    def master_of(self, key: str) -> int | None:
        """The port of the master serving `key`'s slot, as a live node sees it; None: none yet."""
        live = next(p for p in self.ports if p in self.procs)
        slot = int(command(live, "CLUSTER", "KEYSLOT", key).strip()[1:])
        for line in command(live, "CLUSTER", "NODES").splitlines():
            fields = line.split()
            if len(fields) < 9 or "master" not in fields[2] or "fail" in fields[2]:
                continue
            for span in fields[8:]:
                lo, _, hi = span.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                    return int(fields[1].split("@")[0].rsplit(":", 1)[1])
        return None

    def kill(self, port: int) -> None:
        self.procs.pop(port).stop(signal.SIGKILL)

    def stop(self) -> None:
        for port in list(self.procs):
            self.procs.pop(port).stop()


class LocalSentinel:
    """A master, its replica and one sentinel watching them as `master_name`."""

    def __init__(self, log_dir: Path, master_name: str = "mymaster") -> None:
        self.master_name = master_name
        self.master_port, self.replica_port, self.sentinel_port = free_port(), free_port(), free_port()
        self.procs: dict[int, Proc] = {}
        self.procs[self.master_port] = _server(f"redis-master-{self.master_port}", self.master_port, log_dir)
        self.procs[self.replica_port] = _server(f"redis-replica-{self.replica_port}", self.replica_port,
                                                log_dir, "--replicaof", "127.0.0.1", str(self.master_port))
        conf = log_dir / f"sentinel-{self.sentinel_port}.conf"
        conf.write_text(f"port {self.sentinel_port}\nbind 127.0.0.1\n"
                        f"sentinel monitor {master_name} 127.0.0.1 {self.master_port} 1\n"
                        f"sentinel down-after-milliseconds {master_name} 1000\n"
                        f"sentinel failover-timeout {master_name} 5000\n")
        binary = shutil.which("redis-server")
        assert binary is not None
        self.procs[self.sentinel_port] = Proc(f"redis-sentinel-{self.sentinel_port}",
                                              [binary, str(conf), "--sentinel"], log_dir)
        self.procs[self.sentinel_port].wait_ready(lambda: self.master() == self.master_port, timeout=15)
        wait_until(lambda: "master_link_status:up" in command(self.replica_port, "INFO", "replication"),
                   15, "replica in sync")

    @property
    def nodes(self) -> list[str]:
        return [f"127.0.0.1:{self.sentinel_port}"]

    def master(self) -> int | None:
        """The master's port as the sentinel names it."""
        reply = command(self.sentinel_port, "SENTINEL", "get-master-addr-by-name", self.master_name)
        parts = reply.split("\r\n")
        return int(parts[4]) if len(parts) > 4 and parts[4].isdigit() else None

    def kill(self, port: int) -> None:
        self.procs.pop(port).stop(signal.SIGKILL)

    def stop(self) -> None:
        for port in list(self.procs):
            self.procs.pop(port).stop()


def main(argv: list[str]) -> int:
    """`python -m tests.support.redis_topologies CMD ...`: CMD run against a Redis Cluster of 3 masters
    (no replicas) on loopback, `{nodes}` in its arguments replaced by the seed nodes; the cluster is
    stopped after. For benchmarks, e.g. `extproc bench sync --redis-cluster {nodes}`."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="redis-cluster-") as tmp:
        cluster = LocalCluster(Path(tmp), replicas=False)
        try:
            nodes = ",".join(cluster.nodes)
            return subprocess.run([arg.replace("{nodes}", nodes) for arg in argv]).returncode
        finally:
            cluster.stop()


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
