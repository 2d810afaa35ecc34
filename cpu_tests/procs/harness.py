"""Test-side handle on a `peer.py` child process: JSON commands with hard timeouts."""

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class PeerError(Exception):
    def __init__(self, kind, msg):
        super().__init__(f"{kind}: {msg}")
        self.kind, self.msg = kind, msg


class Peer:
    """A P or D transport in a child process; `call` never waits past its timeout."""

    def __init__(self, role, spec, start_timeout=60.0):
        self.role = role
        self.start_timeout = start_timeout
        self._port = self._name = None
        self.log = tempfile.TemporaryFile()
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, PEER, role, json.dumps(spec)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.log, env=env, cwd=REPO,
        )

    @property
    def port(self):
        """The NIXL listener port; waits for the child to be ready (spawn is async)."""
        if self._port is None:
            ready = self._answer(self.start_timeout)
            self._port, self._name = ready["port"], ready.get("name")
        return self._port

    @property
    def name(self):
        """The NIXL agent name (drawn by the child when its spec leaves it None)."""
        self.port  # noqa: B018 - the first answer names it
        return self._name

    def _answer(self, timeout):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"{self.role} gave no answer within {timeout}s\n{self.stderr()}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.role} exited ({self.proc.poll()})\n{self.stderr()}")
        return json.loads(line)

    def call(self, op, timeout=20.0, **fields):
        self.port  # noqa: B018 - the first answer is the port
        self.proc.stdin.write((json.dumps({"op": op, **fields}) + "\n").encode())
        self.proc.stdin.flush()
        out = self._answer(timeout)
        if "error" in out:
            raise PeerError(out["error"], out["msg"])
        return out

    def stderr(self):
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=5)
                self.proc.wait(timeout=5)
            except Exception:
                pass
        if self.proc.poll() is None:
            self.kill()


def wait_until(predicate, timeout, step=0.01):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(step)
    return False
