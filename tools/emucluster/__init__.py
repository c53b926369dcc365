"""An emulated multi-node cluster on one host: network namespaces, shaped links, torchrun per node.

Each "node" is a network namespace `pipette-emu-<pid>-<k>` whose interface `eth0` is one end of
a veth pair; the other end (`v<k>`) sits on a bridge in a hub namespace `pipette-emu-<pid>-hub`.
Node k has address 198.18.0.(k+1)/24 (198.18.0.0/15 is reserved for benchmarking). Each node's
access link is shaped in both directions with netem (rate + one-way delay): node k's egress on its
`eth0`, and the hub's egress towards node k on `v<k>`. The path i -> j therefore has bandwidth
min(rate_i, rate_j) and one-way delay delay_i + delay_j (see `expected_link`).

Use it as a context manager; the namespaces (and with them every veth and qdisc) are always
deleted: on exit, on exceptions, on SIGINT/SIGTERM (turned into exceptions while a cluster is up),
and `cleanup_stale()` removes leftovers of dead processes by the unique prefix.

    spec = {"nodes": 3, "rate_mbit": 200, "delay_ms": 0.5, "overrides": {"2": {"rate_mbit": 20}}}
    with EmuCluster(spec) as cl:
        results = cl.torchrun(["-m", "megatron_pipette.probe", "--out", "c.json"], nproc_per_node=1)
"""

from __future__ import annotations

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
        r = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "a0", "root", "tbf",
                            "rate", "100mbit", "burst", "32kb", "latency", "50ms"], capture_output=True, text=True)
        if r.returncode != 0:
            return f"cannot shape with tc tbf: {r.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


_NETEM: bool | None = None


def netem_available() -> bool:
    """Whether the kernel has the netem qdisc (delay emulation); tbf (rate) is all that is required."""
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


@dataclass
class Spec:
    nodes: int
    links: list[Link]

    @staticmethod
    def parse(desc: dict) -> "Spec":
        """{"nodes": K, "rate_mbit": R, "delay_ms": D, "overrides": {"k": {"rate_mbit": .., "delay_ms": ..}}}"""
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
            links.append(Link(None if rate is None else float(rate), float(o.get("delay_ms", desc.get("delay_ms", 0.0)))))
        return Spec(k, links)

    def expected_link(self, i: int, j: int) -> tuple[float | None, float]:
        """(bandwidth B/s or None when unshaped, one-way delay s) of the path node i -> node j."""
        rates = [r for r in (self.links[i].rate_mbit, self.links[j].rate_mbit) if r is not None]
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
    def __enter__(self) -> "EmuCluster":
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
            try:
                self._old_handlers[sig] = signal.signal(sig, handler)
            except ValueError:   # not the main thread
                pass

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
            for where, dev in ((ns, "eth0"), (self.hub, f"v{k}")):
                self._shape(where, dev, link)

    def _shape(self, ns: str, dev: str, link: Link) -> None:
        """Egress shaping of one end of an access link: netem delay (when asked) over tbf rate."""
        parent = ["root"]
        if link.delay_ms > 0:
            if not netem_available():
                raise RuntimeError("this kernel has no netem qdisc (sch_netem), so delays cannot be "
                                   "emulated; use delay_ms 0 (rate shaping uses tbf)")
            self._tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                     f"{link.delay_ms}ms", "limit", "100000")
            parent = ["parent", "1:1"]
        if link.rate_mbit is not None:
            rate_Bps = link.rate_mbit * 1e6 / 8
            burst = max(16 * 1024, int(rate_Bps * 0.001))   # 1 ms of traffic, at least 16 KiB
            self._tc(ns, "qdisc", "add", "dev", dev, *parent, "handle", "2:", "tbf", "rate",
                     f"{link.rate_mbit}mbit", "burst", str(burst), "latency", "50ms")

    def down(self) -> None:
        for p in self._procs:
            _kill_group(p)
        self._procs.clear()
        # Processes still inside a namespace (should be none) are killed before it is deleted.
        for ns in reversed(self._made):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
        self._restore_signals()

    # -- running ----------------------------------------------------------------------------
    def popen(self, k: int, argv: list[str], env: dict | None = None, cwd: str | None = None,
              log: Path | None = None) -> subprocess.Popen:
        """Start argv in node k's namespace, in its own session, output merged (to `log` if given)."""
        full_env = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": "eth0", "TP_SOCKET_IFNAME": "eth0"}
        out = open(log, "w") if log else subprocess.PIPE
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(k), *argv], env=full_env, cwd=cwd,
                             stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        if log:
            out.close()
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(p: subprocess.Popen) -> None:
    """Kill a started process and everything in its session, and reap it."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
