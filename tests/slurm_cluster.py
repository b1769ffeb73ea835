"""A real one-node Slurm cluster for the tests: Debian's munge, MariaDB, slurmdbd, slurmctld and slurmd
on 127.0.0.1, every file in one temp folder, started once per session and stopped after.

Accounting (slurmdbd over MariaDB) is there because `sacct` needs it: submitit, and so tpbench, learns
how a job ended (CANCELLED, TIMEOUT, ...) from `sacct`. Checked facts behind each setting:
shared/notes/slurm-on-one-machine.md. Slurm's ports (6817-6819) are fixed: one cluster per machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "mariadbd", "mariadb-install-db", "slurmdbd", "slurmctld", "slurmd", "sbatch", "sacct")
PORTS = (6817, 6818, 6819)  # slurmctld, slurmd, slurmdbd
SLURM_PASSWORD = "slurm-db-pw"


def why_not() -> str | None:
    """Why this machine cannot run the test cluster, or None."""
    missing = [d for d in DAEMONS if not (shutil.which(d) or Path("/usr/sbin", d).exists())]
    if missing:
        return f"Slurm cannot run here: {', '.join(missing)} not installed (`bash scripts/setup.sh --tests`)"
    if os.geteuid() != 0:
        return "Slurm cannot run here: slurmd and munged of the test cluster need root"
    for port in PORTS:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return f"Slurm cannot run here: port {port} is taken (another Slurm on this machine?)"
    return None


class OneNodeCluster:
    def __init__(self, folder: Path):
        self.dir = folder
        self.host = socket.gethostname().split(".")[0]  # slurmd names its node so
        self.conf = folder / "slurm.conf"
        self.munge_socket = folder / "munge" / "munge.socket"
        self.db_port = _free_port()
        self.pids: list[Path] = []  # the daemons' pid files; stopped in reverse

    @property
    def env(self) -> dict[str, str]:
        """What a client (sbatch, squeue, tpbench) needs to reach this cluster."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def start(self) -> None:
        self.dir.chmod(0o755)  # munge's socket must be reachable through every folder above it
        for sub in ("munge", "state", "spool", "log", "mysql"):
            (self.dir / sub).mkdir(exist_ok=True)
        self._munge()
        self._mariadb()
        self._write_conf()
        self._daemon(["slurmdbd"], "slurmdbd.pid")  # slurmdbd.conf: beside SLURM_CONF
        self._wait_port(6819)
        self.run("sacctmgr", "-i", "add", "cluster", "tpbench")  # its jobs are then accounted
        self._daemon(["slurmctld", "-f", str(self.conf), "-i"], "slurmctld.pid")
        self._daemon(["slurmd", "-f", str(self.conf)], "slurmd.pid")
        deadline = time.monotonic() + 60
        while "idle" not in self.run("sinfo", "-h", "-o", "%t").stdout:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node never came up: {self.run('sinfo').stdout}{self.logs()}")
            time.sleep(0.3)

    def stop(self) -> None:
        """Cancel what still runs (a slurmstepd outlives its slurmd), then stop every daemon."""
        if self.run("scancel", "--user", "root").returncode == 0:
            deadline = time.monotonic() + 30
            while self.run("squeue", "-h").stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        for pid_file in reversed(self.pids):
            try:
                pid = int(pid_file.read_text())
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError):
                continue
            deadline = time.monotonic() + 15
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)

    def run(self, *command: str) -> subprocess.CompletedProcess:
        return subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)

    def logs(self) -> str:
        return "".join(
            f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((self.dir / "log").iterdir())
        )

    # -- the daemons --------------------------------------------------------------------------------

    def _munge(self) -> None:
        key = self.dir / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        (self.dir / "munge").chmod(0o755)  # clients reach the socket through it
        log = self.dir / "log" / "munged.log"
        subprocess.run(
            ["munged", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
             f"--pid-file={self.dir / 'munge' / 'munged.pid'}", f"--log-file={log}",
             f"--seed-file={self.dir / 'munge' / 'seed'}"],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        self.pids.append(self.dir / "munge" / "munged.pid")

    def _mariadb(self) -> None:
        data, sock = self.dir / "mysql", self.dir / "mysql.sock"
        subprocess.run(
            ["mariadb-install-db", f"--datadir={data}", "--user=root", "--skip-test-db",
             "--auth-root-authentication-method=socket"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        pid_file = self.dir / "mariadbd.pid"
        subprocess.Popen(
            ["mariadbd", "--no-defaults", f"--datadir={data}", f"--socket={sock}", f"--pid-file={pid_file}",
             "--user=root", "--bind-address=127.0.0.1", f"--port={self.db_port}",
             f"--log-error={self.dir / 'log' / 'mariadbd.log'}", "--innodb-buffer-pool-size=32M"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self.pids.append(pid_file)
        grant = (
            f"CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{SLURM_PASSWORD}'; "
            "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
        )
        deadline = time.monotonic() + 60
        while subprocess.run(["mariadb", f"--socket={sock}", "-e", grant], capture_output=True).returncode:
            if time.monotonic() > deadline:
                raise RuntimeError(f"MariaDB did not start{self.logs()}")
            time.sleep(0.3)

    def _daemon(self, command: list[str], pid_name: str) -> None:
        subprocess.run(command, env=self.env, check=True, capture_output=True, timeout=60)  # they fork
        self.pids.append(self.dir / pid_name)

    def _wait_port(self, port: int) -> None:
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on port {port}{self.logs()}")
            time.sleep(0.2)

    def _write_conf(self) -> None:
        d, memory = self.dir, _memory_mb() * 3 // 4
        auth = f"AuthType=auth/munge\nAuthInfo=socket={self.munge_socket}\n"
        dbd = self.dir / "slurmdbd.conf"
        dbd.write_text(
            f"{auth}DbdHost=localhost\nDbdPort=6819\nSlurmUser=root\n"
            f"StorageType=accounting_storage/mysql\nStorageHost=127.0.0.1\nStoragePort={self.db_port}\n"
            f"StorageUser=slurm\nStoragePass={SLURM_PASSWORD}\nStorageLoc=slurm_acct_db\n"
            f"PidFile={d / 'slurmdbd.pid'}\nLogFile={d / 'log' / 'slurmdbd.log'}\n"
        )
        dbd.chmod(0o600)
        self.conf.write_text(
            f"ClusterName=tpbench\nSlurmctldHost={self.host}(127.0.0.1)\n{auth}CredType=cred/munge\n"
            "SlurmUser=root\nSlurmdUser=root\n"
            f"StateSaveLocation={d / 'state'}\nSlurmdSpoolDir={d / 'spool'}\n"
            f"SlurmctldPidFile={d / 'slurmctld.pid'}\nSlurmdPidFile={d / 'slurmd.pid'}\n"
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}\nSlurmdLogFile={d / 'log' / 'slurmd.log'}\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n"
            "AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=localhost\n"
            f"AccountingStoragePort=6819\nAccountingStoragePass={self.munge_socket}\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n"
            "SchedulerParameters=batch_sched_delay=0\nKillWait=5\nMinJobAge=3600\nReturnToService=2\n"
            "SlurmdParameters=config_overrides\nMpiDefault=none\n"
            # 8 CPUs declared on 2 cores: two jobs of two ranks each can run at once.
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs=8 RealMemory={memory} State=UNKNOWN\n"
            f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP\n"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 4096


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
