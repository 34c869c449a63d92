"""A real Slurm 22.05 cluster of three nodes on this one machine, for the tests that launch onto Slurm.

Each node is a network + UTS namespace (n1..n3 at 10.200.0.11.., hostname = node name, its own /etc/hosts by
bind mount) on a bridge at 10.200.0.1 where slurmctld listens; those addresses exist only inside what this
module creates, so no traffic leaves the machine. slurmd runs under `nsenter --net … unshare --uts --mount`
(`ip netns exec` remounts /sys and slurmd then finds no cgroup filesystem), with proctrack/cgroup so scancel
reaches double-forked processes too. munged runs on a socket of its own, so a munged the machine already has
is neither used nor disturbed. Everything lives in a fresh directory per session and is stopped by the ids
this module recorded when it started it."""

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

NODES = ("n1", "n2", "n3")
BRIDGE = "loomslurm0"
SUBNET = "10.200.0"
HOST_ADDRESS = f"{SUBNET}.1"
CPUS_PER_NODE = 2
# Short enough that a node whose link is cut is marked down within a test's patience; long enough that two
# busy cores answering slowly do not mark a healthy node down.
SLURMD_TIMEOUT_S = 12
# Finished jobs stay known to squeue/scontrol this long, so an observer that looks late still sees the end.
MIN_JOB_AGE_S = 300
STARTUP_TIMEOUT_S = 60
STOP_TIMEOUT_S = 15
CGROUP_ROOT = Path("/sys/fs/cgroup")
# One cluster per machine: its addresses, namespace names and cgroups are fixed, so a second test session
# waits for the first one's cluster to stop.
LOCK_PATH = Path(tempfile.gettempdir()) / "loom-slurm-cluster.lock"
LOCK_WAIT_S = 1800
INSTALL_HINT = "install Slurm and munge as bin/test does: apt-get install -y slurm-wlm munge"


def node_address(node: str) -> str:
    return f"{SUBNET}.{10 + NODES.index(node) + 1}"


def namespace_of(node: str) -> str:
    return f"loom-{node}"


def veth_of(node: str) -> str:
    return f"loomveth-{node}"


def slurm_conf_text(directory: Path, controller: str, port: int, munge_socket: Path) -> str:
    node_lines = "\n".join(
        f"NodeName={node} NodeAddr={node_address(node)} CPUs={CPUS_PER_NODE} RealMemory=4000 State=UNKNOWN"
        for node in NODES
    )
    return f"""ClusterName=loomtest
SlurmctldHost={controller}({HOST_ADDRESS})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
SlurmctldPort={port}
SlurmdPort=6818
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool/%n
SlurmctldPidFile={directory}/run/slurmctld.pid
SlurmdPidFile={directory}/run/slurmd-%n.pid
SlurmctldLogFile={directory}/log/slurmctld.log
SlurmdLogFile={directory}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup,task/affinity
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout={SLURMD_TIMEOUT_S}
InactiveLimit=0
MinJobAge={MIN_JOB_AGE_S}
KillWait=10
Waittime=0
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
MessageTimeout=10
{node_lines}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


CGROUP_CONF = """CgroupPlugin=cgroup/v1
ConstrainCores=yes
ConstrainRAMSpace=no
"""


def run(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def namespace_inode(node: str) -> int:
    return os.stat(f"/run/netns/{namespace_of(node)}").st_ino


def pids_in_network_namespace(inode: int) -> list[int]:
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if os.stat(entry / "ns" / "net").st_ino == inode:
                pids.append(int(entry.name))
        except OSError:
            continue
    return sorted(pids)


class MachineLock:
    """An flock on LOCK_PATH for the cluster's whole life. The kernel drops it when its holder dies, so a
    session that was killed never blocks the next one (which then clears what the dead one left)."""

    def __init__(self, path: Path = LOCK_PATH):
        self.path = path
        self.handle = None

    def acquire(self, timeout: float = LOCK_WAIT_S) -> None:
        handle = open(self.path, "a+")
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    handle.seek(0)
                    holder = handle.read().strip() or "unknown"
                    handle.close()
                    raise RuntimeError(
                        f"another test session (pid {holder}) has held this machine's Slurm test cluster for "
                        f"{timeout:.0f}s ({self.path}); run the Slurm tests when it has finished"
                    ) from None
                time.sleep(1)
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self.handle = handle

    def release(self) -> None:
        if self.handle is not None:
            fcntl.flock(self.handle, fcntl.LOCK_UN)
            self.handle.close()
            self.handle = None


def remove_leftovers() -> None:
    """What a session that died without stopping its cluster left: the links, namespaces and cgroups."""
    for node in NODES:
        run("ip", "link", "del", veth_of(node), check=False)
        run("ip", "netns", "del", namespace_of(node), check=False)
        remove_cgroups(node)
    run("ip", "link", "del", BRIDGE, check=False)


@dataclass
class SlurmCluster:
    directory: Path
    conf: Path
    nodes: list[str] = field(default_factory=lambda: list(NODES))
    host_address: str = HOST_ADDRESS
    munged: subprocess.Popen | None = None
    slurmctld: subprocess.Popen | None = None
    slurmd: dict[str, subprocess.Popen] = field(default_factory=dict)
    namespaces: list[str] = field(default_factory=list)
    bridge_created: bool = False
    lock: MachineLock = field(default_factory=MachineLock)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def slurm(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(command, capture_output=True, text=True, env=self.env)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def link_down(self, node: str) -> None:
        run("ip", "link", "set", veth_of(node), "down")

    def link_up(self, node: str) -> None:
        run("ip", "link", "set", veth_of(node), "up")

    def processes_on(self, node: str) -> list[int]:
        """Every process in the node's namespace but its slurmd: what jobs left running there."""
        slurmd = self.slurmd[node].pid
        return [pid for pid in pids_in_network_namespace(namespace_inode(node)) if pid != slurmd]

    def node_states(self) -> dict[str, str]:
        lines = self.slurm("sinfo", "-h", "-N", "-o", "%N %T").stdout.split()
        return dict(zip(lines[::2], lines[1::2], strict=True))

    def wait_until_idle(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            result = self.slurm("sinfo", "-h", "-N", "-o", "%N %T", check=False)
            if result.returncode == 0:
                fields = result.stdout.split()
                states = dict(zip(fields[::2], fields[1::2], strict=True))
                if all(states.get(node) == "idle" for node in self.nodes):
                    return
            self.assert_daemons_alive()
            time.sleep(0.2)
        raise RuntimeError(f"Slurm nodes not idle after {timeout}s: {states}; logs in {self.directory / 'log'}")

    def assert_daemons_alive(self) -> None:
        for name, process in [("munged", self.munged), ("slurmctld", self.slurmctld), *self.slurmd.items()]:
            if process is not None and process.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {process.returncode} during start-up; its log is in {self.directory / 'log'}"
                )

    def start(self) -> None:
        for name in ("state", "spool", "run", "log", "munge", "hosts"):
            (self.directory / name).mkdir(parents=True, exist_ok=True)
        self._start_munged()
        self._create_network()
        controller = socket.gethostname()
        self.conf.write_text(
            slurm_conf_text(self.directory, controller, free_port(), self.directory / "munge" / "munge.socket")
        )
        (self.conf.parent / "cgroup.conf").write_text(CGROUP_CONF)
        self.slurmctld = self._daemon("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for node in self.nodes:
            self._start_slurmd(node, controller)
        self.wait_until_idle()

    def _daemon(self, name: str, command: list[str]) -> subprocess.Popen:
        output = open(self.directory / "log" / f"{name}.out", "ab")
        with output:
            return subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=self.env)

    def _start_munged(self) -> None:
        munge_dir = self.directory / "munge"
        shutil.chown(munge_dir, "munge", "munge")
        munge_dir.chmod(0o755)
        self.munged = self._daemon(
            "munged",
            [
                "setpriv", "--reuid=munge", "--regid=munge", "--clear-groups", "munged", "--foreground",
                f"--socket={munge_dir / 'munge.socket'}",
                f"--pid-file={munge_dir / 'munged.pid'}",
                f"--seed-file={munge_dir / 'munged.seed'}",
                f"--log-file={munge_dir / 'munged.log'}",
            ],
        )  # fmt: skip
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not (munge_dir / "munge.socket").exists():
            self.assert_daemons_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not open its socket; see {munge_dir / 'munged.log'}")
            time.sleep(0.05)

    def _create_network(self) -> None:
        run("ip", "link", "add", BRIDGE, "type", "bridge")
        self.bridge_created = True
        run("ip", "addr", "add", f"{HOST_ADDRESS}/24", "dev", BRIDGE)
        run("ip", "link", "set", BRIDGE, "up")
        for node in self.nodes:
            namespace = namespace_of(node)
            run("ip", "netns", "add", namespace)
            self.namespaces.append(namespace)
            run("ip", "link", "add", veth_of(node), "type", "veth", "peer", "name", "eth0", "netns", namespace)
            run("ip", "link", "set", veth_of(node), "master", BRIDGE, "up")
            run("ip", "-n", namespace, "addr", "add", f"{node_address(node)}/24", "dev", "eth0")
            run("ip", "-n", namespace, "link", "set", "eth0", "up")
            run("ip", "-n", namespace, "link", "set", "lo", "up")

    def _start_slurmd(self, node: str, controller: str) -> None:
        hosts = self.directory / "hosts" / node
        peers = "".join(f"{node_address(peer)} {peer}\n" for peer in self.nodes)
        hosts.write_text(f"127.0.0.1 localhost\n{HOST_ADDRESS} {controller}\n{peers}")
        (self.directory / "spool" / node).mkdir(exist_ok=True)
        inside = f"mount --bind {hosts} /etc/hosts && hostname {node} && exec slurmd -D -f {self.conf} -N {node}"
        self.slurmd[node] = self._daemon(
            f"slurmd-{node}",
            [
                "nsenter", f"--net=/run/netns/{namespace_of(node)}",
                "unshare", "--uts", "--mount", "--propagation", "private", "--", "sh", "-c", inside,
            ],
        )  # fmt: skip

    def stop(self) -> None:
        """Stop what start() started, jobs' leftovers in the node namespaces included, then remove the
        namespaces, the bridge and the nodes' cgroups. Safe after a start that failed half way."""
        leftovers = [pid for node in self.nodes if node in self.slurmd for pid in self._namespace_pids(node)]
        daemons = [*self.slurmd.values(), self.slurmctld, self.munged]
        for process in daemons:
            if process is not None and process.poll() is None:
                process.terminate()
        for process in daemons:
            if process is not None:
                try:
                    process.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for node in self.nodes:
            if namespace_of(node) in self.namespaces:
                # Deleting the host's end takes the pair at once; the namespace's end alone would go only when
                # the kernel gets round to freeing the namespace.
                run("ip", "link", "del", veth_of(node), check=False)
        for namespace in self.namespaces:
            run("ip", "netns", "del", namespace, check=False)
        if self.bridge_created:
            run("ip", "link", "del", BRIDGE, check=False)
        for node in self.nodes:
            remove_cgroups(node)
        shutil.rmtree(self.directory, ignore_errors=True)
        self.lock.release()

    def _namespace_pids(self, node: str) -> list[int]:
        try:
            return self.processes_on(node)
        except OSError:
            return []


def remove_cgroups(node: str) -> None:
    """The cgroup tree Slurm made for the node under every controller, deepest first (rmdir only works on
    an empty cgroup, whose pseudo-files then go with it)."""
    for controller in CGROUP_ROOT.iterdir():
        root = controller / f"slurm_{node}"
        if not root.is_dir():
            continue
        for directory in sorted((path for path in root.rglob("*") if path.is_dir()), key=lambda p: -len(p.parts)):
            try:
                directory.rmdir()
            except OSError:
                pass
        try:
            root.rmdir()
        except OSError:
            pass


def start_cluster() -> SlurmCluster:
    missing = [command for command in ("slurmctld", "slurmd", "munged", "sbatch") if shutil.which(command) is None]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not found: {INSTALL_HINT}")
    lock = MachineLock()
    lock.acquire()
    directory = Path(tempfile.mkdtemp(prefix="loom-slurm-"))
    # munged runs as the munge user and must reach its socket directory inside.
    directory.chmod(0o755)
    cluster = SlurmCluster(directory=directory, conf=directory / "etc" / "slurm.conf", lock=lock)
    cluster.conf.parent.mkdir()
    try:
        remove_leftovers()
        cluster.start()
    except BaseException as error:
        logs = {path.name: path.read_text(errors="replace")[-2000:] for path in (directory / "log").glob("*")}
        cluster.stop()
        raise RuntimeError(f"the Slurm test cluster did not start: {error}\nlast of its logs: {logs}") from error
    return cluster


@pytest.fixture(scope="session")
def slurm_cluster():
    """A fresh three-node Slurm cluster for the session (state wiped: job ids start at 1)."""
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()
