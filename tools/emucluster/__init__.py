"""An emulated multi-node cluster on one host: network namespaces, shaped links, torchrun per node.

Each "node" is a network namespace `pipette-emu-<pid>-<k>` whose interface `eth0` is one end of
a veth pair; the other end (`v<k>`) sits on a bridge in a hub namespace `pipette-emu-<pid>-hub`.
Node k has address 198.18.0.(k+1)/24 (198.18.0.0/15 is reserved for benchmarking). Each node's
access link is shaped in both directions, on node k's egress on its `eth0` and on the hub's
egress towards node k on `v<k>`: an htb class at the node's rate (netem above it adds a one-way
delay, where the kernel has netem). A pair override caps the path between two nodes further,
both directions, while each keeps its own rate to the others: a leaf under the node's class,
selected by the peer's address (u32 on the destination on `eth0`, on the source on `v<k>`).
The path i -> j therefore has bandwidth min(rate_i, rate_j, pair rate) and one-way delay
delay_i + delay_j (see `expected_link`).

Use it as a context manager; the namespaces (and with them every veth and qdisc) are always
deleted: on exit, on exceptions, on SIGINT/SIGTERM (turned into exceptions while a cluster is up),
and `cleanup_stale()` removes leftovers of dead processes by the unique prefix.

    spec = {"nodes": 8, "rate_mbit": 200, "overrides": {"3": {"rate_mbit": 50}},
            "pair_overrides": {"1-6": {"rate_mbit": 20}}}
    with EmuCluster(spec) as cl:
        results = cl.torchrun(["-m", "megatron_pipette.probe", "--out", "c.json"], nproc_per_node=1)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "pipette-emu-"
SUBNET = "198.18.0"


def unavailable_reason() -> str | None:
    """Why namespaces cannot be created here (None when they can)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    name = f"{PREFIX}{os.getpid()}-check"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    try:
        r = subprocess.run(["ip", "-n", name, "link", "add", "a0", "type", "veth", "peer", "name", "b0"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            return f"cannot create a veth pair: {r.stderr.strip()}"
        for what, args in (("htb", ["qdisc", "add", "dev", "a0", "root", "handle", "2:", "htb"]),
                           ("a u32 filter", ["filter", "add", "dev", "a0", "parent", "2:", "protocol", "ip",
                                             "u32", "match", "ip", "dst", f"{SUBNET}.1/32", "flowid", "2:1"])):
            r = subprocess.run(["ip", "netns", "exec", name, "tc", *args], capture_output=True, text=True)
            if r.returncode != 0:
                return f"cannot shape with tc {what}: {r.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


_NETEM: bool | None = None


def netem_available() -> bool:
    """Whether the kernel has the netem qdisc (delay emulation); htb (rate) is all that is required."""
    global _NETEM
    if _NETEM is None:
        name = f"{PREFIX}{os.getpid()}-netem"
        subprocess.run(["ip", "netns", "add", name], capture_output=True)
        try:
            r = subprocess.run(["ip", "-n", name, "link", "add", "a0", "type", "veth", "peer", "name", "b0"],
                               capture_output=True)
            r = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "a0", "root", "netem",
                                "delay", "1ms"], capture_output=True)
            _NETEM = r.returncode == 0
        finally:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return _NETEM


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(all_of_them: bool = False) -> list[str]:
    """Delete this tool's namespaces left by dead processes (or every one of them); returns names."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    removed = []
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-")[0]
        if all_of_them or not pid.isdigit() or not _pid_alive(int(pid)):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    return removed


@dataclass
class Link:
    rate_mbit: float | None   # None: unshaped
    delay_ms: float


def _pair_key(key: str, k: int) -> tuple[int, int]:
    """"a-b" -> (min, max), two different nodes of 0..k-1, else a ValueError saying why."""
    parts = key.split("-")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"pair_overrides key {key!r}: expected \"a-b\" with two node numbers")
    a, b = sorted(int(p) for p in parts)
    if a == b or b >= k:
        raise ValueError(f"pair_overrides key {key!r}: need two different nodes of 0..{k - 1}")
    return a, b


@dataclass
class Spec:
    nodes: int
    links: list[Link]
    pairs: dict[tuple[int, int], float] = field(default_factory=dict)
    """(low node, high node) -> rate in Mbit/s of the path between them, both directions."""

    @staticmethod
    def parse(desc: dict) -> Spec:
        """{"nodes": K, "rate_mbit": R, "delay_ms": D, "overrides": {"k": {"rate_mbit": .., "delay_ms": ..}},
        "pair_overrides": {"a-b": {"rate_mbit": ..}}}"""
        k = int(desc["nodes"])
        if not 1 <= k <= 200:
            raise ValueError(f"nodes must be 1..200, got {k}")
        over = {int(n): v for n, v in (desc.get("overrides") or {}).items()}
        bad = [n for n in over if not 0 <= n < k]
        if bad:
            raise ValueError(f"overrides for nodes outside 0..{k - 1}: {bad}")
        links = []
        for n in range(k):
            o = over.get(n, {})
            rate = o.get("rate_mbit", desc.get("rate_mbit"))
            delay = float(o.get("delay_ms", desc.get("delay_ms", 0.0)))
            links.append(Link(None if rate is None else float(rate), delay))
        pairs: dict[tuple[int, int], float] = {}
        for key, value in (desc.get("pair_overrides") or {}).items():
            pair = _pair_key(str(key), k)
            if pair in pairs:
                raise ValueError(f"pair_overrides key {key!r}: nodes {pair} are given twice")
            if set(value) != {"rate_mbit"} or not float(value["rate_mbit"]) > 0:
                raise ValueError(f"pair_overrides[{key!r}]: expected {{\"rate_mbit\": a positive number}}, "
                                 f"got {value!r}")
            pairs[pair] = float(value["rate_mbit"])
        return Spec(k, links, pairs)

    def peer_rates(self, k: int) -> dict[int, float]:
        """Node k's pair overrides: peer -> Mbit/s."""
        return {b if a == k else a: rate for (a, b), rate in self.pairs.items() if k in (a, b)}

    def expected_link(self, i: int, j: int) -> tuple[float | None, float]:
        """(bandwidth B/s or None when unshaped, one-way delay s) of the path node i -> node j."""
        rates = [r for r in (self.links[i].rate_mbit, self.links[j].rate_mbit, self.peer_rates(i).get(j))
                 if r is not None]
        bw = min(rates) * 1e6 / 8 if rates else None
        return bw, (self.links[i].delay_ms + self.links[j].delay_ms) / 1e3


@dataclass
class NodeResult:
    node: int
    returncode: int | None
    output: str


@dataclass
class EmuCluster:
    desc: dict
    tag: str = ""
    spec: Spec = field(init=False)
    _made: list[str] = field(default_factory=list, init=False)
    _procs: list[subprocess.Popen] = field(default_factory=list, init=False)
    _old_handlers: dict = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.spec = Spec.parse(self.desc)
        self.base = f"{PREFIX}{os.getpid()}-{self.tag}" if self.tag else f"{PREFIX}{os.getpid()}"

    # -- names ------------------------------------------------------------------------------
    @property
    def hub(self) -> str:
        return f"{self.base}-hub"

    def ns(self, k: int) -> str:
        return f"{self.base}-{k}"

    def addr(self, k: int) -> str:
        return f"{SUBNET}.{k + 1}"

    # -- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> EmuCluster:
        self._install_signals()
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def _install_signals(self) -> None:
        def handler(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            with contextlib.suppress(ValueError):   # not the main thread
                self._old_handlers[sig] = signal.signal(sig, handler)

    def _restore_signals(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    @staticmethod
    def _ip(*args: str) -> None:
        r = subprocess.run(["ip", *args], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")

    @staticmethod
    def _tc(ns: str, *args: str) -> None:
        r = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"tc {' '.join(args)} in {ns}: {r.stderr.strip()}")

    def up(self) -> None:
        cleanup_stale()
        self._ip("netns", "add", self.hub)
        self._made.append(self.hub)
        self._ip("-n", self.hub, "link", "set", "lo", "up")
        self._ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self.hub, "link", "set", "br0", "up")
        for k, link in enumerate(self.spec.links):
            ns = self.ns(k)
            self._ip("netns", "add", ns)
            self._made.append(ns)
            self._ip("-n", self.hub, "link", "add", f"v{k}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._ip("-n", self.hub, "link", "set", f"v{k}", "master", "br0")
            self._ip("-n", self.hub, "link", "set", f"v{k}", "up")
            self._ip("-n", ns, "link", "set", "lo", "up")
            self._ip("-n", ns, "addr", "add", f"{self.addr(k)}/24", "dev", "eth0")
            self._ip("-n", ns, "link", "set", "eth0", "up")
            for where, dev, match in ((ns, "eth0", "dst"), (self.hub, f"v{k}", "src")):
                self._shape(where, dev, link, self.spec.peer_rates(k), match)

    def _shape(self, ns: str, dev: str, link: Link, peers: dict[int, float], match: str) -> None:
        """Egress shaping of one end of node k's access link: netem delay (when asked) over htb.

        htb rather than tbf because a pair override needs classification. Class 2:1 is the
        access link (the node's rate); under it a default leaf and one leaf per overridden peer,
        capped at the pair rate and picked by the peer's address (`match`: "dst" on the node's
        eth0, "src" on the hub's port towards it). The leaves borrow from 2:1 (their guaranteed
        rates sum to at most its rate), so all of the node's traffic together still gets at
        most the node's rate. An unshaped node (rate None) has only the pair leaves; htb sends
        what no filter picks unshaped (its default class does not exist)."""
        parent = ["root"]
        if link.delay_ms > 0:
            if not netem_available():
                raise RuntimeError("this kernel has no netem qdisc (sch_netem), so delays cannot be "
                                   "emulated; use delay_ms 0 (rate shaping uses htb)")
            self._tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                     f"{link.delay_ms}ms", "limit", "100000")
            parent = ["parent", "1:1"]
        if link.rate_mbit is None and not peers:
            return
        self._tc(ns, "qdisc", "add", "dev", dev, *parent, "handle", "2:", "htb", "default", "10")
        node = link.rate_mbit
        if node is not None:
            self._htb_class(ns, dev, "2:", "2:1", node, node)
        leaves = [] if node is None else [(10, node, None)]
        leaves += [(11 + n, min(rate, node or rate), peer) for n, (peer, rate) in enumerate(peers.items())]
        for minor, ceil, peer in leaves:
            guaranteed = ceil if node is None else min(ceil, node / len(leaves))
            self._htb_class(ns, dev, "2:" if node is None else "2:1", f"2:{minor}", guaranteed, ceil)
            # the queue tbf had before: 50 ms at the rate plus the burst, in bytes
            self._tc(ns, "qdisc", "add", "dev", dev, "parent", f"2:{minor}", "bfifo", "limit",
                     str(int(ceil * 1e6 / 8 * 0.05) + _burst(ceil)))
            if peer is not None:
                self._tc(ns, "filter", "add", "dev", dev, "parent", "2:", "protocol", "ip", "prio", "1", "u32",
                         "match", "ip", match, f"{self.addr(peer)}/32", "flowid", f"2:{minor}")

    def _htb_class(self, ns: str, dev: str, parent: str, classid: str, rate_mbit: float, ceil_mbit: float) -> None:
        """One htb class, its buckets sized for its ceiling; a 64 KiB quantum lets a borrowing leaf
        send a whole GSO packet per turn (htb's default, rate / 10, is clamped with a warning)."""
        burst = str(_burst(ceil_mbit))
        self._tc(ns, "class", "add", "dev", dev, "parent", parent, "classid", classid, "htb",
                 "rate", f"{rate_mbit}mbit", "ceil", f"{ceil_mbit}mbit", "burst", burst, "cburst", burst,
                 "quantum", "65536")

    def down(self) -> None:
        for p in self._procs:
            _kill_group(p)
        self._procs.clear()
        # Processes still inside a namespace (should be none) are killed before it is deleted.
        for ns in reversed(self._made):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
        self._restore_signals()

    # -- running ----------------------------------------------------------------------------
    def popen(self, k: int, argv: list[str], env: dict | None = None, cwd: str | None = None,
              log: Path | None = None) -> subprocess.Popen:
        """Start argv in node k's namespace, in its own session, output merged (to `log` if given)."""
        full_env = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": "eth0", "TP_SOCKET_IFNAME": "eth0"}
        with open(log, "w") if log else contextlib.nullcontext(subprocess.PIPE) as out:
            p = subprocess.Popen(["ip", "netns", "exec", self.ns(k), *argv], env=full_env, cwd=cwd,
                                 stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self._procs.append(p)
        return p

    def run_all(self, argvs: list[list[str]], timeout: float, env: dict | None = None,
                cwd: str | None = None, logdir: Path | None = None) -> list[NodeResult]:
        """Run argvs[k] in node k, wait (bounded by timeout), return outputs; kill leftovers."""
        if logdir:
            logdir.mkdir(parents=True, exist_ok=True)
        logs = [(logdir / f"node{k}.log") if logdir else None for k in range(len(argvs))]
        procs = [self.popen(k, a, env=env, cwd=cwd, log=logs[k]) for k, a in enumerate(argvs)]
        deadline = time.monotonic() + timeout
        outs: list[str] = [""] * len(procs)
        try:
            if logdir:
                for p in procs:
                    try:
                        p.wait(timeout=max(0.1, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        break
                outs = [lg.read_text(errors="replace") for lg in logs]
            else:
                for k, p in enumerate(procs):
                    try:
                        outs[k] = p.communicate(timeout=max(0.1, deadline - time.monotonic()))[0]
                    except subprocess.TimeoutExpired:
                        break
        finally:
            for p in procs:
                _kill_group(p)
            if logdir:
                outs = [lg.read_text(errors="replace") for lg in logs]
        return [NodeResult(k, p.returncode, outs[k]) for k, p in enumerate(procs)]

    def torchrun(self, script_args: list[str], nproc_per_node: int = 1, timeout: float = 120,
                 env: dict | None = None, cwd: str | None = None, logdir: Path | None = None,
                 python: str = sys.executable, port: int = 29400) -> list[NodeResult]:
        """torchrun in every node (c10d rendezvous at node 0), running `script_args`."""
        k_nodes = self.spec.nodes
        argvs = [[python, "-m", "torch.distributed.run", "--nnodes", str(k_nodes), "--node-rank", str(k),
                  "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"{self.addr(0)}:{port}", "--rdzv-id", self.base,
                  "--local-addr", self.addr(k), "--rdzv-conf", f"is_host={'true' if k == 0 else 'false'}",
                  *script_args] for k in range(k_nodes)]
        base_env = {"OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", **(env or {})}
        return self.run_all(argvs, timeout, env=base_env, cwd=cwd, logdir=logdir)

    def ping(self, i: int, j: int, count: int = 3) -> str:
        return subprocess.run(["ip", "netns", "exec", self.ns(i), "ping", "-c", str(count), "-i", "0.2",
                               self.addr(j)], capture_output=True, text=True, timeout=30).stdout


def _burst(rate_mbit: float) -> int:
    """Bucket size in bytes: 1 ms of traffic at the rate, at least 16 KiB."""
    return max(16 * 1024, int(rate_mbit * 1e6 / 8 * 0.001))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(p: subprocess.Popen) -> None:
    """Kill a started process and everything in its session, and reap it."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
