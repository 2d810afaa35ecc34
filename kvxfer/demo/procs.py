"""Child processes that answer in JSON lines: how the demo and the benches run P and D.

The parent starts each side with `python -m <module> <role> <config json>`,
relays messages between them as a router would, and waits on each with a
deadline. A child's answers go to a private copy of its stdout (NIXL and UCX
log to stdout), everything else to a log file the parent shows on failure.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, TextIO

from kvxfer.errors import InvalidInputError, TransferError

__all__ = ["Lines", "Proc", "child_output", "profile_dir", "profiled", "say"]


class Lines:
    """JSON lines from a pipe, without blocking and without stdio's read-ahead buffer
    (which would hide lines from `select`)."""

    def __init__(self, fd: int):
        self.fd, self.buf, self.closed = fd, b"", False

    def ready(self, wait: float = 0.001) -> list[dict[str, Any]]:
        """Every complete line so far, waiting up to `wait` seconds for the first."""
        while not self.closed and select.select([self.fd], [], [], wait)[0]:
            chunk = os.read(self.fd, 1 << 16)
            self.closed = not chunk
            self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]


def say(out: TextIO, **fields: Any) -> None:
    """Send one JSON line."""
    out.write(json.dumps(fields) + "\n")
    out.flush()


def child_output() -> TextIO:
    """In a child: the answer channel (a private copy of stdout); stdout itself goes to stderr."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    logging.basicConfig(level=os.environ.get("KVXFER_LOG", "WARNING"), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")
    return out


def profile_dir() -> str | None:
    """`KVXFER_PROFILE`, made and checked writable (None when unset): the parent calls this
    before any child starts, so a bad directory is an error, not a run without profiles."""
    target = os.environ.get("KVXFER_PROFILE")
    if not target:
        return None
    try:
        os.makedirs(target, exist_ok=True)
        with tempfile.TemporaryFile(dir=target):
            pass
    except OSError as e:
        raise InvalidInputError(f"KVXFER_PROFILE={target!r} is not a writable directory: "
                                f"{e.strerror or e}") from None
    return target


def profiled(role: str, serve: Callable[[], None]) -> None:
    """Run `serve()`; with `KVXFER_PROFILE=dir` set, under cProfile, its stats in `dir/role.prof`
    (read them with `python -m pstats`): where a child's time goes, not a guess."""
    target = os.environ.get("KVXFER_PROFILE")
    if not target:
        return serve()
    import cProfile

    profile = cProfile.Profile()
    try:
        profile.runcall(serve)
    finally:
        os.makedirs(target, exist_ok=True)
        profile.dump_stats(os.path.join(target, f"{role}.prof"))


class Proc:
    """A child process `python -m module role cfg_json` that answers in JSON lines.

    On the CPU platform it gets `devices` emulated devices.
    """

    def __init__(self, role: str, cfg_json: str, devices: int, timeout_s: float, module: str):
        env = dict(os.environ)
        env.setdefault("JAX_PLATFORMS", "cpu")
        if env["JAX_PLATFORMS"] == "cpu":
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        self.role, self.timeout = role, timeout_s
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, role, cfg_json],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env)
        self.lines, self.queue = Lines(self.proc.stdout.fileno()), []

    def read(self) -> dict[str, Any]:
        """The next message; raises `TransferError` if none comes within the timeout."""
        deadline = time.monotonic() + self.timeout
        while not self.queue:
            if time.monotonic() > deadline:
                raise TransferError(f"{self.role} said nothing within {self.timeout}s\n{self.tail()}")
            if self.lines.closed:
                raise TransferError(f"{self.role} exited with {self.proc.poll()}\n{self.tail()}")
            self.queue.extend(self.lines.ready())
        return self.queue.pop(0)

    def ready(self, wait: float = 0.001) -> list[dict[str, Any]]:
        """Every message that has arrived, waiting up to `wait` seconds for one."""
        msgs, self.queue = self.queue + self.lines.ready(wait), []
        return msgs

    def send(self, **fields: Any) -> None:
        try:
            self.proc.stdin.write((json.dumps(fields) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # ValueError: our end already closed
            raise TransferError(f"{self.role} is gone (exit {self.proc.poll()})\n{self.tail()}") from None

    def tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-3000:]

    def stop(self) -> None:
        try:
            self.send(stop=True)
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()
            self.proc.wait(timeout=10)
        finally:
            with contextlib.suppress(BrokenPipeError):  # a child that died leaves a full pipe
                self.proc.stdin.close()
            self.proc.stdout.close()
            self.log.close()
