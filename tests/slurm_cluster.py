"""A real one-node SLURM cluster for the tests: munged, slurmctld and slurmd as root, with a
generated slurm.conf in a temporary folder (nothing under /etc is touched).

Used by tests/test_slurm.py as a session fixture; it raises (the tests fail) when SLURM or munge
is missing or does not come up, as the brief requires: a broken hard dependency never skips.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_line() -> str:
    """The first line of `slurmd -C` (NodeName=... CPUs=... RealMemory=...), as SLURM sees this machine."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    line = out.splitlines()[0]
    # leave a little memory headroom so a memory check never makes the node drain
    mem = int(re.search(r"RealMemory=(\d+)", line).group(1))
    return re.sub(r"RealMemory=\d+", f"RealMemory={max(1, mem - 512)}", line)


class SlurmCluster:
    """Start with :meth:`start`, stop with :meth:`stop`; ``env`` has SLURM_CONF for clients."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.procs: list[subprocess.Popen] = []
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.cpus = 0

    def start(self, timeout: float = 90.0) -> SlurmCluster:
        missing = [d for d in DAEMONS if shutil.which(d) is None]
        if missing:
            raise RuntimeError(f"SLURM/munge programs missing: {', '.join(missing)} "
                               "(apt-get install -y slurm-wlm munge)")
        if os.geteuid() != 0:
            raise RuntimeError("the SLURM test cluster runs its daemons as root")
        self._start_munge()
        self._write_conf()
        log = self.root / "log"
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)], log / "slurmctld.out")
        self._spawn(["slurmd", "-D", "-f", str(self.conf)], log / "slurmd.out")
        deadline = time.monotonic() + timeout
        while True:
            state = self.sinfo_state()
            if state.startswith("idle"):
                return self
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited ({p.returncode}); see {log}: {self.logs()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the SLURM node never became idle (state {state!r}); logs:\n{self.logs()[-3000:]}")
            time.sleep(0.5)

    def sinfo_state(self) -> str:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=self.env)
        return out.stdout.strip()

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')}" for p in sorted((self.root / "log").glob("*"))
                         if p.is_file())

    def _spawn(self, cmd: list[str], out: Path) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "ab") as f:
            self.procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env,
                                               stdin=subprocess.DEVNULL, start_new_session=True))

    def _start_munge(self) -> None:
        d = self.munge_socket.parent
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o755)
        key = self.root / "munge" / "munge.key"
        subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True, capture_output=True)
        key.chmod(0o600)
        self._spawn(["munged", "-F", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
                     f"--pid-file={d / 'munged.pid'}", f"--log-file={self.root / 'log' / 'munged.log'}",
                     f"--seed-file={d / 'munged.seed'}"], self.root / "log" / "munged.out")
        deadline = time.monotonic() + 30
        while not self.munge_socket.exists():
            if time.monotonic() > deadline or self.procs[-1].poll() is not None:
                raise RuntimeError(f"munged did not start: {self.logs()[-2000:]}")
            time.sleep(0.1)

    def _write_conf(self) -> None:
        node = _node_line()
        self.cpus = int(re.search(r"CPUs=(\d+)", node).group(1))
        node = re.sub(r"NodeName=\S+", f"NodeName={self.host}", node)
        state = self.root / "state"
        spool = self.root / "spool"
        for p in (state, spool, self.root / "log"):
            p.mkdir(parents=True, exist_ok=True)
        self.conf.write_text("\n".join([
            "ClusterName=shardscope-test",
            f"SlurmctldHost={self.host}",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={state}",
            f"SlurmdSpoolDir={spool}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "KillWait=10",
            "MinJobAge=600",
            "SchedulerParameters=sched_interval=2",
            node,
            f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))

    def jobs(self) -> list[str]:
        out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=self.env)
        return out.stdout.split()

    def stop(self) -> None:
        """Cancel every job and wait for them to end, then stop the daemons (slurmd, slurmctld, munged)."""
        if self.procs:
            subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True)
            deadline = time.monotonic() + 60
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.5)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self._reap_step_daemons()

    def _reap_step_daemons(self) -> None:
        """A slurmstepd of ours that outlived slurmd (it waits to report to it) is ended too."""
        import psutil

        for p in psutil.process_iter(["name"]):
            try:
                if p.info["name"] == "slurmstepd" and p.environ().get("SLURM_CONF") == str(self.conf):
                    p.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
