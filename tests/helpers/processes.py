"""Ports and process trees for tests that launch torchrun agents themselves."""

import contextlib
import socket

import psutil


def free_port() -> int:
    """A loopback port free at the time of asking."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants at once, as a lost node loses them. Killing a torchrun
    agent's process group is not enough: the agent starts each worker in a session of its own, and
    workers spawn helpers (a checkpoint writer's manager). Every process found is stopped first, so none
    can fork or restart workers while the tree is collected."""
    found: dict[int, psutil.Process] = {}
    with contextlib.suppress(psutil.NoSuchProcess):
        found[pid] = psutil.Process(pid)
    while True:
        new = {}
        for proc in list(found.values()):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.suspend()
                new.update({child.pid: child for child in proc.children(recursive=True) if child.pid not in found})
        if not new:
            break
        found.update(new)
    for proc in found.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(list(found.values()), timeout=10)
