"""Real vLLM servers for the real-engine tests, started through scripts/real-engines.

The script owns how an engine is installed and started (one place for the command line); this
module runs it as a child process in its own process group, so a test can kill an engine the
way a machine dies (SIGKILL to the API server and its engine core together) and start it again
on the same port.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "real-engines"
MODEL = "tiny-llama"  # scripts/real-engines serves the tiny model under this name
START_TIMEOUT = 300.0  # two engines start in 80-90 s on two idle cores; CI's may be busy
ENGINE_NICENESS = 10


class NotInstalled(RuntimeError):
    pass


def check_installed() -> None:
    """Raises NotInstalled with the script's own reason when `scripts/real-engines install` has not run."""
    done = subprocess.run([SCRIPT, "python"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NotInstalled(done.stderr.strip() or f"{SCRIPT} python exited {done.returncode}")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_for(
    condition: Callable[[], bool], timeout: float, what: str | Callable[[], str], interval: float = 0.2
) -> None:
    """Until `condition()` holds; AssertionError naming `what` (or what it returns then) after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what if isinstance(what, str) else what()}")
        time.sleep(interval)


class Engine:
    def __init__(
        self,
        kind: Literal["spec", "standard"],
        *,
        core: int,
        log_dir: Path,
        scheduling: Literal["fcfs", "priority"] = "fcfs",
    ) -> None:
        self.kind = kind
        self.core = core
        self.scheduling = scheduling  # vLLM's --scheduling-policy
        self.port = free_port()
        self.log_path = log_dir / f"vllm-{kind}.log"
        self._log: IO[bytes] | None = None
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            # Each engine keeps a core busy (its threads spin), and the router shares those
            # cores; what is tested is what the router does with the engines, not how fast they
            # are. Where Linux groups processes by session (autogroups, on by default), each
            # engine and the router (conftest.py) have a session of their own, and each session
            # gets a fair share of the CPU, whatever else runs: the router's turn comes within
            # milliseconds, and two other busy processes on the machine cannot starve an engine.
            # Where it does not, the engines' lower priority gives the router its turn.
            [
                *("nice", "-n", str(ENGINE_NICENESS), SCRIPT, "engine", self.kind),
                *(str(self.port), str(self.core), self.scheduling),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # and so its own process group: the API server and its engine core
            env={**os.environ, "PYTHONUNBUFFERED": "1"},  # a start that hangs shows its last line
        )

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"the {self.kind} engine exited with {self.process.returncode}: {self.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {self.kind} engine did not answer within {timeout:g} s: {self.tail()}")
            time.sleep(0.5)

    def restart(self, first_try: float = 150.0) -> None:
        """Start again after a kill, until it answers. Twice on this machine, after the burst tests,
        a restarted vLLM 0.32 logged not a line in 150-300 s and outlived a SIGKILL by 60 s (it
        restarts in 25-35 s otherwise): such a start is killed, not waited for, and made once
        more, saying so in the test's log."""
        self.start()
        try:
            self.wait_healthy(first_try)
        except RuntimeError as exc:
            logging.getLogger(__name__).warning("the %s engine restarts again: %s", self.kind, exc)
            hung = self.process
            assert hung is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(hung.pid, signal.SIGKILL)
            # Such a start once outlived a SIGKILL by 60 s: it dies when it leaves the kernel,
            # reaped meanwhile by a thread (its port was never bound, so the next start takes it).
            threading.Thread(target=hung.wait, daemon=True).start()
            if self._log is not None:
                self._log.close()
            self.start()
            self.wait_healthy()

    def kill(self) -> None:
        """SIGKILL to the whole group, as when the machine goes away: nothing gets to clean up."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        self._signal(signal.SIGTERM)

    def _signal(self, signum: int) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signum)
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        except ProcessLookupError:
            pass
        if self._log is not None:
            self._log.close()

    def metric(self, name: str, **labels: str) -> float:
        """The engine's own `/metrics`: the sum of the samples named `name` that carry `labels`."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )

    def memory_mib(self) -> float:
        """Resident memory of the engine's processes (its process group: API server, engine core)."""
        assert self.process is not None
        total_kib = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                # The process group is the fifth field, after the name in parentheses.
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) != self.process.pid:
                    continue
                status = (stat.parent / "status").read_text()
            except (OSError, IndexError, ValueError):
                continue  # it ended meanwhile
            total_kib += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        return total_kib / 1024

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
