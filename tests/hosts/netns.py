"""Hosts as Linux network namespaces on one switch, all inside this machine.

A :class:`Network` creates a "switch" namespace holding a bridge, and one namespace per
:class:`Host`, joined to the bridge by a veth pair. Each host gets an address in the network's
subnet (``10.213.0.0/24`` by default, assigned in order from ``.1``) on its ``eth0`` and its
loopback up. Addresses are assigned inside these namespaces only, and the only route a host has
is its subnet's: no veth end, address or route of the root namespace touches the switch, so no
packet from a host can leave the machine, and a host cannot reach anything but the other hosts
(the tests reach the hosts only from inside, with :meth:`Host.run`, :meth:`Host.popen` and
:meth:`Host.call`; they never send to these addresses from the root namespace).

Namespace names are ``mbh<pid>n<k>-<host>`` (the pid of the test process, a per-process counter),
so concurrent runs never clash. Closing a network kills every process in each of its namespaces
and deletes them, also when the test failed; starting one first removes what crashed runs left
behind (namespaces of the same prefix whose creating process is gone).

Link delay: where the kernel has ``netem``, each host's egress is delayed by ``delay_s``; where
it has not (the CI machine's kernel has veth and bridges but no netem), the Redis topologies put
each node behind a delaying relay (:mod:`tests.hosts.relay`) instead.
:attr:`Network.delay_method` says which is in use.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "mbh"
NETNS_DIR = Path("/var/run/netns")
CLONE_NEWNET = 0x40000000
_STALE = re.compile(rf"^{PREFIX}(\d+)n\d+-")
_counter = itertools.count()
T = TypeVar("T")


class NamespacesUnavailable(RuntimeError):
    """This machine does not let us create network namespaces (not root, or no `ip`)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def check_namespaces() -> None:
    """Raise :class:`NamespacesUnavailable`, saying why, unless namespaces can be made here."""
    if shutil.which("ip") is None:
        raise NamespacesUnavailable(
            "network-namespace hosts need iproute2's `ip` on PATH (apt-get install iproute2)"
        )
    if os.geteuid() != 0:
        raise NamespacesUnavailable(
            "network-namespace hosts need root (`ip netns add`); run the slow tests as root, "
            "as .ci/run does"
        )
    probe = f"{PREFIX}{os.getpid()}n{next(_counter)}-check"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        raise NamespacesUnavailable(f"`ip netns add` is not permitted here: {made.stderr.strip()}")
    _ip("netns", "del", probe, check=False)


@functools.cache
def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (tried once, on a veth in a throwaway namespace)."""
    probe = f"{PREFIX}{os.getpid()}n{next(_counter)}-netem"
    _ip("netns", "add", probe)
    try:
        _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        tried = subprocess.run(
            ["tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "netem", "delay", "1ms"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        return tried.returncode == 0
    except FileNotFoundError:  # no tc
        return False
    finally:
        _ip("netns", "del", probe, check=False)


def namespace_pids(namespace: str) -> list[int]:
    """The processes whose network namespace is ``namespace`` (`ip netns pids`)."""
    listed = _ip("netns", "pids", namespace, check=False)
    return [int(pid) for pid in listed.stdout.split()]


def _protected() -> set[int]:
    """This process and its ancestors: never killed, whatever a namespace lists."""
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return pids


def kill_namespace(namespace: str, timeout: float = 10.0) -> list[int]:
    """SIGKILL every process in a namespace until none is left; return the pids killed."""
    protected, killed = _protected(), set()
    deadline = time.monotonic() + timeout
    while pids := [pid for pid in namespace_pids(namespace) if pid not in protected]:
        for pid in pids:  # one still listed may be dying of the last round's SIGKILL
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in {namespace} survived SIGKILL")
        time.sleep(0.02)
    return sorted(killed)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces left by crashed runs (our prefix, their creating process gone)."""
    removed = []
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ", 1)[0]
        match = _STALE.match(name)
        if match and not _alive(int(match.group(1))):
            kill_namespace(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


_libc = ctypes.CDLL(None, use_errno=True)


def _enter_namespace(namespace: str) -> None:
    """Move the calling thread (only it) into a network namespace."""
    fd = os.open(NETNS_DIR / namespace, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns({namespace}): {os.strerror(errno)}")
    finally:
        os.close(fd)


class Host:
    """One machine: a network namespace with ``eth0`` at ``addr`` on the network's switch."""

    def __init__(self, network: Network, name: str, addr: str, index: int) -> None:
        self.network, self.name, self.addr = network, name, addr
        self.namespace = f"{network.name}-{name}"
        self.switch_port = f"p{index}"  # the veth end on the bridge, in the switch namespace
        self.processes: list[subprocess.Popen[bytes]] = []
        self._executor: ThreadPoolExecutor | None = None

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.addr!r})"

    def _command(self, cmd: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *cmd]

    def run(
        self, cmd: Sequence[str], check: bool = True, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """Run a command on this host and wait for it (its output captured)."""
        return subprocess.run(
            self._command(cmd), capture_output=True, text=True, check=check, timeout=timeout
        )

    def popen(
        self, cmd: Sequence[str], env: dict[str, str | None] | None = None, log: str | None = None
    ) -> subprocess.Popen[bytes]:
        """Start a command on this host, in the tree's root with the tree on PYTHONPATH and
        this process's environment updated with ``env`` (None removes a variable); its output
        goes to ``<network workdir>/<host>-<log>.log`` (``log``: the command's name)."""
        full_env = {**os.environ, "PYTHONPATH": str(ROOT)}
        for key, value in (env or {}).items():
            if value is None:
                full_env.pop(key, None)
            else:
                full_env[key] = value
        label = log or Path(cmd[0]).name
        out = self.log_path(label).open("ab")
        try:
            process = subprocess.Popen(
                self._command(cmd), cwd=ROOT, env=full_env, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        finally:
            out.close()
        self.processes.append(process)
        return process

    def log_path(self, label: str) -> Path:
        return self.network.workdir / f"{self.name}-{label}.log"

    def python(
        self, module: str, *args: str, env: dict[str, str | None] | None = None,
        log: str | None = None,
    ) -> subprocess.Popen[bytes]:  # fmt: skip
        """``python -m module args`` on this host (the interpreter running the tests)."""
        return self.popen([sys.executable, "-m", module, *args], env=env, log=log)

    def pids(self) -> list[int]:
        """Every process on this host."""
        return namespace_pids(self.namespace)

    def kill_all(self) -> list[int]:
        """``kill -9`` every process on this host (a host crash); returns the pids killed."""
        killed = kill_namespace(self.namespace)
        for process in self.processes:
            if process.poll() is None and process.pid in killed:
                process.wait(10)
        return killed

    def link_down(self) -> None:
        """Pull this host's cable at the switch: no packet in or out until :meth:`link_up`
        (open TCP connections survive a short cut, as on a real network)."""
        _ip("-n", self.network.switch, "link", "set", self.switch_port, "down")

    def link_up(self) -> None:
        """Plug the cable back in."""
        _ip("-n", self.network.switch, "link", "set", self.switch_port, "up")

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` in this process, on a thread that lives in this host's namespace: the
        sockets it opens (a redis-py client, an HTTP client) are this host's. Create clients
        inside ``fn``: a socket belongs to the namespace of the thread that opened it."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                1, f"netns-{self.name}", initializer=_enter_namespace, initargs=(self.namespace,)
            )
        return self._executor.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        """Kill everything on this host and delete its namespace."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        kill_namespace(self.namespace)
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait(10)
        _ip("netns", "del", self.namespace, check=False)


class Network:
    """A switch and the hosts on it; a context manager that removes it all on exit.

    Nothing is created until the first :meth:`host` call (or ``__enter__``), which first checks
    that namespaces can be made here and raises :class:`NamespacesUnavailable` if not.
    """

    def __init__(self, workdir: Path, subnet: str = "10.213.0", delay_s: float = 0.00025) -> None:
        self.workdir = workdir
        self.subnet = subnet
        self.delay_s = delay_s
        self.name = f"{PREFIX}{os.getpid()}n{next(_counter)}"
        self.switch = f"{self.name}-sw"
        self.hosts: dict[str, Host] = {}
        self.delay_method = ""
        self._started = False

    def start(self) -> Network:
        if self._started:
            return self
        check_namespaces()
        remove_stale_namespaces()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.delay_method = "netem" if netem_available() else "relay"
        _ip("netns", "add", self.switch)
        self._started = True
        _ip("-n", self.switch, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        return self

    @property
    def relay_delay_s(self) -> float:
        """The delay a relay must add per direction (none where netem delays the links)."""
        return self.delay_s if self.delay_method == "relay" else 0.0

    def host(self, name: str) -> Host:
        """Create a host with the next address of the subnet."""
        self.start()
        if name in self.hosts or not re.fullmatch(r"[a-z0-9]{1,12}", name):
            raise ValueError(f"bad or duplicate host name {name!r}")
        index = len(self.hosts) + 1
        host = Host(self, name, f"{self.subnet}.{index}", index)
        _ip("netns", "add", host.namespace)
        self.hosts[name] = host
        sw, ns = self.switch, host.namespace
        _ip("-n", sw, "link", "add", host.switch_port, "type", "veth", "peer", "name", "eth0",
            "netns", ns)  # fmt: skip
        _ip("-n", sw, "link", "set", host.switch_port, "master", "br0")
        _ip("-n", sw, "link", "set", host.switch_port, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        if self.delay_method == "netem" and self.delay_s > 0:
            subprocess.run(
                ["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "netem", "delay",
                 f"{self.delay_s * 1e6:.0f}us"],
                check=True, capture_output=True, timeout=30,
            )  # fmt: skip
        return host

    def close(self) -> None:
        """Kill every process on every host and delete all namespaces (errors are collected and
        raised after everything was tried)."""
        errors = []
        for host in self.hosts.values():
            try:
                host.close()
            except Exception as exc:
                errors.append(exc)
        if self._started:
            _ip("netns", "del", self.switch, check=False)
        self.hosts.clear()
        self._started = False
        if errors:
            raise errors[0]

    def log_tails(self, chars: int = 3000) -> str:
        """The end of every log under the network's workdir (for a failing test's output)."""
        parts = []
        for path in sorted(self.workdir.glob("*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    def __enter__(self) -> Network:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
