"""A throwaway etcd server for tests: its own data directory and free ports (loopback by default).

`etcd` comes from Debian's `etcd-server` (installed by `scripts/test-deps`, which
`.ci/run` and the README's test command run first). A missing binary is an
error, not a skip: the tests it serves must run in CI.
"""

import json
import shutil
import subprocess
import tempfile
import time
import urllib.request

from kvxfer.transport import free_port


class EtcdServer:
    """`etcd` on `host` (loopback by default); `endpoint` is its client URL. Always `stop()` it."""

    def __init__(self, start_timeout=20.0, host="127.0.0.1"):
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not installed: run `bash scripts/test-deps` "
                               "(Debian's etcd-server)")
        self.dir = tempfile.mkdtemp(prefix="kvxfer-etcd-")
        client, peer = free_port(host), free_port(host)
        self.endpoint = f"http://{host}:{client}"
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [binary, "--name", "kvxfer-test", "--data-dir", self.dir,
             "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
             "--listen-peer-urls", f"http://{host}:{peer}",
             "--initial-advertise-peer-urls", f"http://{host}:{peer}",
             "--initial-cluster", f"kvxfer-test=http://{host}:{peer}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_timeout
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                self.log.seek(0)
                raise RuntimeError(f"etcd did not start:\n{self.log.read().decode()[-3000:]}")
            time.sleep(0.05)

    def healthy(self):
        try:
            with urllib.request.urlopen(f"{self.endpoint}/health", timeout=1) as r:
                return json.loads(r.read()).get("health") == "true"
        except OSError:
            return False

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)
