"""Child processes that answer in JSON lines: how the demos and the benches run P and D.

The parent (`Children`, one `Proc` per child) starts each side with
`python -m <module> <role> <config json>`, relays messages between them as a
router would, and waits on each with a deadline. A child runs `run_child`: it
builds its side (a `Side`: P's or D's connector and engine), says hello, does
the work that needs no command, then answers the parent's commands, one JSON
line each, stepping its engine between them, until it reads `stop`. A child's
answers go to a private copy of its stdout (NIXL and UCX log to stdout),
everything else to a log file the parent shows on failure.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from kvxfer.errors import InvalidInputError, TransferError

__all__ = ["Children", "Lines", "Load", "Proc", "Reader", "Saver", "Side", "child_output",
           "connector", "profile_dir", "profiled", "run_child", "say"]


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


def profiled(role: str, main: Callable[[], None]) -> None:
    """Run `main()`; with `KVXFER_PROFILE=dir` set, under cProfile, its stats in `dir/role.prof`
    (read them with `python -m pstats`): where a child's time goes, not a guess."""
    target = os.environ.get("KVXFER_PROFILE")
    if not target:
        return main()
    import cProfile

    profile = cProfile.Profile()
    try:
        profile.runcall(main)
    finally:
        os.makedirs(target, exist_ok=True)
        profile.dump_stats(os.path.join(target, f"{role}.prof"))


# -- the child's end -------------------------------------------------------------------


class Side:
    """P's or D's work in a child process: the hooks `run_child` calls.

    A harness subclasses it once per role (`Saver` for P, `Reader` for D); `out` is the
    answer channel (`say`), `conn` what the side closes when it stops (its connector).
    """

    wait_s = 0.001
    """How long the loop waits for a command between two steps, as an idle engine waits."""

    def __init__(self, out: TextIO, conn: Any):
        self.out, self.conn = out, conn

    def say(self, **fields: Any) -> None:
        say(self.out, **fields)

    def hello(self) -> dict[str, Any]:
        """The first line the parent reads: the side is up."""
        return {"ready": True}

    def run(self) -> None:
        """The work that needs no command, once, right after the hello (a scripted prefill)."""

    def command(self, msg: dict[str, Any]) -> None:
        """One command from the parent (never `stop`: `run_child` handles that)."""

    def step(self) -> None:
        """One step of the side's engine, after each wait for commands."""

    def close(self) -> None:
        """Called once when the side stops, whatever stopped it."""
        self.conn.close()


def run_child(make: Callable[[str, dict[str, Any], TextIO], Side]) -> None:
    """A child's main, for `python -m module role cfg_json`: the answer channel, then
    `make(role, fields, out)`'s side, its hello and `run`, then its commands and steps until
    the parent says `stop` or goes away. Under cProfile with `KVXFER_PROFILE` (`profiled`)."""
    role, fields = sys.argv[1], json.loads(sys.argv[2])
    out = child_output()

    def loop() -> None:
        side, inbox = make(role, fields, out), Lines(sys.stdin.fileno())
        try:
            say(out, **side.hello())
            side.run()
            while not inbox.closed:
                msgs = inbox.ready(side.wait_s)
                if any("stop" in m for m in msgs):
                    return
                for msg in msgs:
                    side.command(msg)
                side.step()
        finally:
            side.close()

    profiled(role, loop)


def connector(role: str, caches: Any, staging_blocks: int, block_size: int = 16, *,
              stats: bool = True, seal_kv: bool = False, **transport: Any) -> Any:
    """P's `PrefillConnector` (one group of `block_size`-token blocks) or D's `DecodeConnector`
    over `caches`; the transport is named `role` unless `transport` names it."""
    from kvxfer.connector.config import ConnectorConfig
    from kvxfer.connector.decode import DecodeConnector
    from kvxfer.connector.prefill import PrefillConnector
    from kvxfer.nixl.agent import TransportConfig
    from kvxfer.plan.save_plan import GroupSpec

    config = ConnectorConfig(TransportConfig(**{"name": role, **transport}),
                             staging_blocks=staging_blocks, stats=stats, seal_kv=seal_kv)
    if role.upper() == "P":
        return PrefillConnector(config, [GroupSpec(block_size)], caches)
    return DecodeConnector(config, caches)


@dataclass
class Load:
    """A request D is reading: its block table, what the parent said of it (`about`), when
    the read started (`perf_counter`), and the seconds D's thread spent in kvxfer for it."""

    req_id: str
    table: list[int]
    about: dict[str, Any]
    started: float
    held_s: float = 0.0


class Saver(Side):
    """P's side: its hello says where it listens; each step polls the connector, as an
    engine's step does, and keeps the requests D released in `freed`."""

    def __init__(self, out: TextIO, conn: Any):
        super().__init__(out, conn)
        self.freed: list[str] = []

    def hello(self) -> dict[str, Any]:
        a = self.conn.worker.address
        return {"peer": a.name, "host": a.host, "port": a.port}

    def step(self) -> None:
        self.freed += self.conn.get_finished()

    def wait_freed(self, count: int, timeout_s: float) -> None:
        """Step until D released `count` requests in all, or for `timeout_s` at most."""
        deadline = time.monotonic() + timeout_s
        while len(self.freed) < count and time.monotonic() < deadline:
            self.step()
            time.sleep(0.002)


class Reader(Side):
    """D's side: reads requests into its caches (`load`); each step polls the connector and
    hands every request that arrived to `loaded`, every one that failed to `lost`."""

    def __init__(self, out: TextIO, conn: Any, caches: Any):
        super().__init__(out, conn)
        self.caches = caches
        self.loads: dict[str, Load] = {}

    def load(self, req_id: str, params: dict[str, Any], table: list[int], **about: Any) -> None:
        from kvxfer.connector.scheduler import LoadRequest

        start = time.perf_counter()
        self.conn.start_load_kv({req_id: LoadRequest(params, table)})
        self.loads[req_id] = Load(req_id, table, about, start, time.perf_counter() - start)

    def step(self) -> None:
        if not self.loads:
            return
        start = time.perf_counter()
        self.caches, finished, failed = self.conn.get_finished(self.caches)
        now, spent = time.monotonic(), time.perf_counter() - start
        done = [self.loads.pop(req_id) for req_id in finished]
        lost = [self.loads.pop(req_id) for req_id in failed]
        for load in self.loads.values():  # still being read
            load.held_s += spent
        errors = sorted(self.conn.get_block_ids_with_load_errors()) if lost else []
        for load in done:
            self.loaded(load, now)
        for load in lost:
            self.lost(load, now, errors)

    def loaded(self, load: Load, now: float) -> None:
        """`load`'s KV is in `self.caches`; `now`: `time.monotonic()` when the poll returned."""

    def lost(self, load: Load, now: float, errors: list[int]) -> None:
        """`load` failed; `errors`: the logical block ids of this step's failed loads."""


# -- the parent's end ------------------------------------------------------------------


class Proc:
    """A child process `python -m module role cfg_json` that answers in JSON lines.

    On the CPU platform it gets `devices` emulated devices. `prefix` goes before the
    command (`ip netns exec <host>`: the child runs inside that host); `env` adds to ours.
    """

    def __init__(self, role: str, cfg_json: str, devices: int, timeout_s: float, module: str,
                 prefix: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 name: str | None = None):
        env = {**os.environ, **(env or {})}
        env.setdefault("JAX_PLATFORMS", "cpu")
        if env["JAX_PLATFORMS"] == "cpu":
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        self.role, self.name, self.timeout = role, name or role, timeout_s
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", module, role, cfg_json],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env)
        self.lines, self.queue = Lines(self.proc.stdout.fileno()), []

    def read(self) -> dict[str, Any]:
        """The next message; raises `TransferError` if none comes within the timeout."""
        deadline = time.monotonic() + self.timeout
        while not self.queue:
            if time.monotonic() > deadline:
                raise TransferError(f"{self.name} said nothing within {self.timeout}s\n{self.tail()}")
            self.queue = self.ready()
        return self.queue.pop(0)

    def ready(self, wait: float = 0.001) -> list[dict[str, Any]]:
        """Every message that has arrived, waiting up to `wait` seconds for one; raises
        `TransferError` if there is none and the child has exited."""
        msgs, self.queue = self.queue + self.lines.ready(wait), []
        if not msgs and self.lines.closed:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=1)  # its exit status, once its stdout closed
            raise TransferError(f"{self.name} exited with {self.proc.poll()}\n{self.tail()}")
        return msgs

    def send(self, **fields: Any) -> None:
        try:
            self.proc.stdin.write((json.dumps(fields) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # ValueError: our end already closed
            raise TransferError(f"{self.name} is gone (exit {self.proc.poll()})\n{self.tail()}") from None

    def tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-3000:]

    def stopping(self) -> None:
        with contextlib.suppress(TransferError):
            self.send(stop=True)

    def reap(self) -> None:
        """Wait up to 10 s for the child to exit, kill it past that; close our ends."""
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        finally:
            with contextlib.suppress(BrokenPipeError):  # a child that died leaves a full pipe
                self.proc.stdin.close()
            self.proc.stdout.close()
            self.log.close()


class Children:
    """The child processes of one run, each a `Proc` of `module` with reads bounded by
    `timeout_s`. Leaving the `with` block stops them, the last started first; the processes
    of one role (an instance over several processes) are asked to stop together, then
    waited for, as they may wait for each other on the way out."""

    def __init__(self, module: str, timeout_s: float):
        self.module, self.timeout_s = module, timeout_s
        self.procs: list[Proc] = []

    def start(self, role: str, cfg_json: str, devices: int, **kw: Any) -> Proc:
        """A new child (`Proc`'s arguments); read its hello before relying on it."""
        proc = Proc(role, cfg_json, devices, self.timeout_s, self.module, **kw)
        self.procs.append(proc)
        return proc

    def pair(self, cfg_json: str, devices_p: int, devices_d: int) -> tuple[Proc, Proc, dict]:
        """P, then D once P listens; both, and P's hello (where it listens)."""
        p = self.start("P", cfg_json, devices_p)
        hello = p.read()
        d = self.start("D", cfg_json, devices_d)
        d.read()
        return p, d, hello

    def relay(self, handle: Callable[[Proc, dict[str, Any]], None], done: Callable[[], bool],
              what: str) -> None:
        """Hand every message from any child to `handle(child, msg)` until `done()`; raises
        `TransferError` naming `what` if that takes over `timeout_s`, or if a child exits."""
        deadline = time.monotonic() + self.timeout_s
        while not done():
            if time.monotonic() > deadline:
                tails = "\n".join(f"{p.name}: {p.tail()}" for p in self.procs)
                raise TransferError(f"{what} did not finish within {self.timeout_s}s\n{tails}")
            select.select([p.lines.fd for p in self.procs if not p.lines.closed], [], [], 0.001)
            for proc in self.procs:
                for msg in proc.ready(0):
                    handle(proc, msg)

    def stop(self) -> None:
        for _, group in itertools.groupby(reversed(self.procs), key=lambda p: p.role):
            group = list(group)
            for proc in group:
                proc.stopping()
            for proc in group:
                proc.reap()
        self.procs = []

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
