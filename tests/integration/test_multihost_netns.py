"""A node deployment on separate machines: network namespaces, the systemd units' own commands.

The test builds a small network as root (``ip netns``, one veth pair per machine onto a bridge
in this namespace, which plays the operator's and the Jupyter user's machine), then starts what
an operator installs: the global scheduler and the arbiter on ``sched``, the gateway on ``gw``,
a local scheduler on each of ``h1``..``h3``, each with the ``ExecStart``, ``Environment`` and
``WorkingDirectory`` of its unit in configs/systemd/ and configs/node.toml as ``/etc/tandem/
node.toml``. Only the install prefix differs: ``/opt/tandem`` is this checkout, ``/etc/tandem``
and ``/var/lib/tandem`` a directory per machine, and each machine gets the key files README
"Security" says to copy to it. ``scheduler.internal`` and ``arbiter.internal`` resolve through
``/etc/netns/NAME/hosts`` (``ip netns exec`` mounts it over /etc/hosts), as DNS would.

A kernel started through the ``tandem`` provisioner gets its three replicas on three machines;
cells run; the executor moves to another machine; then the link of the machine that ran the last
cell goes down, and the next cell runs on a replica that is still reachable, with the namespace
the cut machine left.

Skipped with the reason when not root or when network namespaces cannot be made. Everything made
is removed afterwards, namespaces and processes included, whatever happened.
"""

from __future__ import annotations

import configparser
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from _cluster import ROOT, ClusterHandle, eventually
from _kernels import run, tandem_kernel
from datastore_fixtures import REDIS_INSTALL

from shared import messages
from shared.private_files import write_private

pytestmark = pytest.mark.integration

UNITS = ROOT / "configs" / "systemd"
NODE_TOML = ROOT / "configs" / "node.toml"
HOSTS = ("h1", "h2", "h3")
READY_S = 40.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


def _netns_refusal() -> str | None:
    """Why this test cannot make namespaces here, or None."""
    if os.geteuid() != 0:
        return "needs root: it creates network namespaces (ip netns) and veth links"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (Debian: apt-get install -y iproute2; `make test-deps` does it)"
    probe = f"tdmprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def unit_command(unit: str, replace: dict[str, str], host_id: str) -> tuple[list[str], dict[str, str], str]:
    """A unit's ExecStart (argv), Environment and WorkingDirectory, with the install prefix
    replaced and ``%H`` as systemd expands it (the host name, here the machine's id)."""
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(UNITS / unit)
    service = parser["Service"]

    def local(text: str) -> str:
        for old, new in replace.items():
            text = text.replace(old, new)
        return text.replace("%H", host_id)

    env = dict(item.split("=", 1) for item in shlex.split(local(service.get("Environment", ""))))
    return shlex.split(local(service["ExecStart"])), env, local(service.get("WorkingDirectory", str(ROOT)))


@dataclass
class Machine:
    """One namespace: its address, install root (/etc/tandem, /var/lib/tandem) and services."""

    name: str
    ns: str
    ip: str
    root: Path
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def replace(self) -> dict[str, str]:
        """The install prefix: the units' paths on this machine."""
        return {
            "/opt/tandem/.venv/bin/python": sys.executable,
            "/opt/tandem": str(ROOT),
            "/etc/tandem": str(self.root / "etc" / "tandem"),
            "/var/lib/tandem": str(self.root / "var" / "lib" / "tandem"),
        }

    def path(self, unit_path: str) -> Path:
        for old, new in self.replace.items():
            unit_path = unit_path.replace(old, new)
        return Path(unit_path)

    def install(self, keys_from: Path, keys: list[str]) -> None:
        """configs/node.toml as this machine's /etc/tandem/node.toml, and its key files."""
        (self.root / "etc" / "tandem" / "keys").mkdir(parents=True, mode=0o700)
        self.path("/var/lib/tandem").mkdir(parents=True, mode=0o700)
        text = NODE_TOML.read_text()
        for old, new in self.replace.items():
            text = text.replace(old, new)
        self.path("/etc/tandem/node.toml").write_text(text)
        for name in keys:
            shutil.copy2(keys_from / name, self.path("/etc/tandem/keys") / name)

    def start(self, unit: str) -> None:
        argv, env, cwd = unit_command(unit, self.replace, self.name)
        self.start_command(unit, argv, env, cwd)

    def start_command(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, cwd: str = "/"
    ) -> None:
        """``argv`` in this machine's namespace, its output in ``<name>.log``."""
        with open(self.root / f"{name}.log", "ab") as out:
            self.processes[name] = subprocess.Popen(
                ["ip", "netns", "exec", self.ns, *argv],
                env={**os.environ, **(env or {})}, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def logs(self) -> str:
        return "\n".join(
            f"--- {self.name} {unit}\n" + (self.root / f"{unit}.log").read_text(errors="replace")[-2500:]
            for unit in self.processes
        )


class Network:
    """A bridge in this namespace (the operator's and the notebook user's machine) and one
    namespace per machine behind a veth pair; names carry this process's id."""

    def __init__(self, tmp: Path) -> None:
        pid = os.getpid()
        self.tag = str(pid % 100000)
        self.subnet = f"198.18.{pid % 250}"  # RFC 2544 benchmarking range: no real network uses it
        self.bridge = f"tdmbr{self.tag}"
        self.tmp = tmp
        self.machines: dict[str, Machine] = {}
        self.made_ns: list[str] = []

    def veth(self, name: str) -> str:
        return f"tv{self.tag}{name}"[:15]

    def build(self, addresses: dict[str, int], names: dict[str, str]) -> None:
        """``addresses``: machine -> last octet; ``names``: DNS name -> machine."""
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{self.subnet}.{addresses[machine]} {name}\n" for name, machine in names.items()
        )
        # a run killed before its teardown, under the same process id, left these behind
        _ip("link", "del", self.bridge, check=False)
        for name in addresses:
            _ip("netns", "del", f"tdm{self.tag}{name}", check=False)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for name, last in addresses.items():
            ns = f"tdm{self.tag}{name}"
            _ip("netns", "add", ns)
            self.made_ns.append(ns)
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)  # what `ip netns exec` shows as /etc/hosts
            outer, inner = self.veth(name), f"tp{self.tag}{name}"[:15]
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            ip = f"{self.subnet}.{last}"
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.machines[name] = Machine(name, ns, ip, self.tmp / name)

    def cut(self, name: str) -> None:
        """The machine's cable pulled: its veth end on the bridge goes down."""
        _ip("link", "set", self.veth(name), "down")

    def logs(self) -> str:
        return "\n".join(m.logs() for m in self.machines.values())

    def wait(self, ready: Callable[[], bool], what: str) -> None:
        """Until ``ready()``; fails at once, with the logs, if a service exits meanwhile."""

        def ready_or_dead() -> bool:
            return ready() or any(
                p.poll() is not None for m in self.machines.values() for p in m.processes.values()
            )

        if not eventually(ready_or_dead, timeout=READY_S) or not ready():
            pytest.fail(f"{what}:\n{self.logs()}")

    def teardown(self) -> None:
        """SIGTERM every service, then SIGKILL whatever is left in each namespace (replicas of a
        cut machine included); remove the namespaces, their /etc/netns files and the bridge."""
        started = [p for m in self.machines.values() for p in m.processes.values()]
        for process in started:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
        for ns in self.made_ns:
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        for process in started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
        for ns in self.made_ns:
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        _ip("link", "del", self.bridge, check=False)


def keys_for(machine: str, every: list[str]) -> list[str]:
    """The key files README "Security" says each machine gets (public keys beside secrets)."""
    if machine == "sched":
        return every  # the scheduler node keeps everything
    if machine == "gw":
        return ["gateway.key", "gateway.key_secret", "scheduler.key", "operator.key"]
    return [f"host.{machine}.key", f"host.{machine}.key_secret", "scheduler.key", "arbiter.key"]


def _redis_argv(machine: Machine) -> list[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(f"redis-server is not installed; CI installs it with: {REDIS_INSTALL}")
    data = machine.path("/var/lib/redis")
    data.mkdir(parents=True, exist_ok=True)
    return [
        *(binary, "--port", "6379", "--bind", machine.ip, "--save", "", "--appendonly", "no"),
        *("--dir", str(data), "--protected-mode", "no", "--loglevel", "warning"),
    ]


def _cli(*args: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr


def _deploy(net: Network) -> ClusterHandle:
    """Keys made as README "Security" says, copied out, the services started as their units say;
    returns the operator's handle once every host has registered."""
    master = net.tmp / "keys"
    _cli("keys", "init", "--keys-dir", str(master))
    _cli("keys", "host", "--keys-dir", str(master), *HOSTS)
    every = sorted(p.name for p in master.iterdir())
    for name, machine in net.machines.items():
        machine.install(master, keys_for(name, every))
    sched, gw = net.machines["sched"], net.machines["gw"]
    sched.start_command("redis-server", _redis_argv(sched))  # node.toml's datastore.internal
    sched.start("tandem-global-scheduler.service")
    sched.start("tandem-arbiter.service")
    gw.start("tandem-gateway.service")
    for host in HOSTS:
        net.machines[host].start("tandem-local-scheduler.service")

    # the operator's (and the Jupyter server's) machine: its keys and cluster.json
    client = net.tmp / "client"
    (client / "keys").mkdir(parents=True, mode=0o700)
    for name in ("operator.key", "operator.key_secret", "scheduler.key", "gateway.key"):
        shutil.copy2(master / name, client / "keys" / name)
    address_file = gw.path("/var/lib/tandem/gateway.address")
    net.wait(address_file.exists, "the gateway did not come up")
    info = {
        "gateway": f"tcp://{gw.ip}:7100",
        "scheduler": f"tcp://{sched.ip}:7200",
        "pid": gw.processes["tandem-gateway.service"].pid,
        "keys_dir": str(client / "keys"),
    }
    (client / "cluster.json").write_text(json.dumps(info))
    # beside the gateway, the Kernel Gateway API finds it through a cluster.json of its own and
    # the operator's key (tandem-gateway.service's comment says how an operator writes them)
    shutil.copy2(master / "operator.key_secret", gw.path("/etc/tandem/keys") / "operator.key_secret")
    shutil.copy2(master / "gateway.key", gw.path("/etc/tandem/keys") / "gateway.key")
    gw_info = {**info, "keys_dir": str(gw.path("/etc/tandem/keys"))}
    write_private(gw.path("/var/lib/tandem/cluster.json"), json.dumps(gw_info))
    gw.start("tandem-http.service")
    handle = ClusterHandle(client, net.tmp, gw.processes["tandem-gateway.service"], info)

    def all_registered() -> bool:
        try:
            hosts = handle.ask_scheduler(messages.CLUSTER_STATUS, {}, timeout=2)["hosts"]
        except Exception:
            return False
        return sorted(h["id"] for h in hosts) == list(HOSTS)

    net.wait(all_registered, "the local schedulers did not all register")
    return handle


@pytest.fixture(scope="module")
def netns_cluster(
    tmp_path_factory: pytest.TempPathFactory, tandem_kernelspec: Path
) -> Iterator[tuple[ClusterHandle, Network]]:
    refusal = _netns_refusal()
    if refusal:
        pytest.skip(refusal)
    net = Network(tmp_path_factory.mktemp("netns"))
    try:
        net.build(
            {"sched": 3, "gw": 2, **{h: 11 + i for i, h in enumerate(HOSTS)}},
            {"scheduler.internal": "sched", "arbiter.internal": "sched", "datastore.internal": "sched"},
        )
        handle = _deploy(net)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("TANDEM_STATE_DIR", str(handle.state_dir))  # the provisioner's cluster
            yield handle, net
    finally:
        net.teardown()


def _http(url: str, method: str = "GET", token: str | None = None, body: object = None) -> tuple[int, object]:
    request = urllib.request.Request(
        url, method=method, data=None if body is None else json.dumps(body).encode()
    )
    if token is not None:
        request.add_header("Authorization", f"token {token}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, None


def test_a_remote_client_starts_a_kernel_through_the_http_api_of_the_gateway_machine(
    netns_cluster: tuple[ClusterHandle, Network],
) -> None:
    """tandem-http.service with node.toml's [http]: reached from another machine with its token."""
    cluster, net = netns_cluster
    gw = net.machines["gw"]
    base = f"http://{gw.ip}:8888/api"
    token_file = gw.path("/etc/tandem/keys/http.token")
    net.wait(
        lambda: token_file.exists() and _reachable(f"{base}/kernelspecs"), "the HTTP API did not come up"
    )
    token = token_file.read_text().strip()
    assert _http(f"{base}/kernels")[0] in (401, 403)
    status, started = _http(f"{base}/kernels", "POST", token, {"name": "tandem"})
    assert status == 201 and isinstance(started, dict), (status, started, net.logs())
    try:
        hosts = cluster.ask_scheduler(messages.KERNEL_STATUS, {"kernel_id": started["id"]})["replicas"]
        assert sorted(r["host"] for r in hosts) == list(HOSTS), hosts
    finally:
        assert _http(f"{base}/kernels/{started['id']}", "DELETE", token)[0] == 204


def _reachable(url: str) -> bool:
    try:
        return _http(url)[0] in (200, 401, 403)
    except OSError:
        return False


def test_kernel_spans_machines_moves_its_executor_and_outlives_a_cut_link(
    netns_cluster: tuple[ClusterHandle, Network],
) -> None:
    cluster, net = netns_cluster
    with tandem_kernel() as (km, kc):
        first = run(kc, "x = 1\nprint(x)", timeout=60)
        assert first.status == "ok" and first.stdout.strip() == "1", (first.reply, net.logs())
        status = cluster.ask_scheduler(messages.KERNEL_STATUS, {"kernel_id": km.kernel_id})
        assert sorted(r["host"] for r in status["replicas"] if r["alive"]) == list(HOSTS), status
        raft_hosts = {r["raft_address"].rsplit(":", 1)[0] for r in status["replicas"]}
        assert raft_hosts == {f"tcp://{net.machines[h].ip}" for h in HOSTS}, raft_hosts

        other = next(h for h in HOSTS if h != first.tandem["host_id"])
        with cluster.only_host_open(other):
            # 2 MiB, over datastore.large_object_bytes: the others get it through Redis
            moved = run(kc, "x += 1\nblob = bytes(range(256)) * 8192\nprint(x)", timeout=60)
            settled = run(kc, "pass", timeout=60)  # waits for the previous cell's state
        assert moved.tandem["host_id"] == other and moved.stdout.strip() == "2", moved.reply
        assert settled.status == "ok", settled.reply

        net.cut(other)
        after = run(kc, "x += 1\nprint(x, len(blob), blob[-1])", timeout=60)
        assert after.status == "ok", (after.reply, net.logs())
        assert after.stdout.strip() == "3 2097152 255" and after.tandem["host_id"] != other, after.reply
