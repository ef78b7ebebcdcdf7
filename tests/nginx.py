"""A real nginx load balancer for the tests: Debian's `nginx`, round robin over upstreams on
loopback, on a free port, with its configuration and files in a temporary directory."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import pytest

from tests.servers import free_port

_CONFIG = """
daemon off;
master_process on;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream routers {{
{servers}
        keepalive 32;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://routers;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header X-Forwarded-For $remote_addr;
            proxy_buffering off;
            proxy_read_timeout 120s;
            proxy_next_upstream off;
        }}
    }}
}}
"""


class Nginx:
    """`with Nginx(["127.0.0.1:8001", ...]) as lb:` nginx at `lb.url`, round robin over them."""

    def __init__(self, upstreams: list[str]) -> None:
        binary = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
        if binary is None:
            why = "nginx is not installed (apt-get install nginx)"
            if os.environ.get("CI"):
                pytest.fail(f"{why}: .ci/run installs it, CI must not skip these tests")
            pytest.skip(why)
        self.binary = binary
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="specroute-nginx-"))
        servers = "\n".join(f"        server {upstream};" for upstream in upstreams)
        (self.dir / "nginx.conf").write_text(_CONFIG.format(dir=self.dir, servers=servers, port=self.port))
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Nginx:
        self._process = subprocess.Popen(
            [self.binary, "-p", str(self.dir), "-c", str(self.dir / "nginx.conf"), "-e", str(self.dir / "error.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            if self._process.poll() is not None:
                log = (self.dir / "error.log").read_text(errors="replace") if (self.dir / "error.log").exists() else ""
                self.stop()
                raise AssertionError(f"nginx did not start:\n{log}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                assert time.monotonic() < deadline, "nginx not listening within 30 s"
                time.sleep(0.02)

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGQUIT)  # graceful: its workers finish first
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()
