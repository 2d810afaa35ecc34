"""`kvxfer.nixl.agreement.agree` between two real JAX processes (`jax.distributed` on loopback).

The processes of a multi-host instance agree through the coordination
service's key-value store: every row arrives in every process, old keys are
dropped, and a peer that never arrives or is out of step is a `TransferError`
naming it rather than a hang or a wrong answer.
"""

import json
import os
import subprocess
import sys

from kvxfer.nixl.agent import free_port

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "procs", "agree.py")


def run_pair(case):
    port = free_port()
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, SCRIPT, str(rank), str(port), case],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank in range(2)]
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        assert lines, stderr[-3000:]
        outs.append(json.loads(lines[-1]))
    return outs


def test_every_row_reaches_every_process_and_old_keys_are_dropped():
    for out in run_pair("many"):
        assert out["bad"] == 0
        # 600 agreements in directories of 256: directory 0 is dropped at agreement 512,
        # so directories 1 and 2 remain (256 + 88 agreements, 2 rows each).
        assert out["keys"] == 2 * (256 + 88)


def test_a_peer_that_never_agrees_is_a_transfer_error_naming_it_in_time():
    _, waiting = run_pair("absent")
    assert "process 0 did not agree within 1 s" in waiting["error"]
    assert waiting["took_s"] < 10


def test_processes_out_of_step_are_a_transfer_error_not_a_wrong_answer():
    for out in run_pair("out_of_step"):
        assert "the processes are out of step" in out["error"], out
