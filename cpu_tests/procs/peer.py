"""A P or D transport in its own process, driven by JSON lines on stdin.

`python peer.py P|D CONFIG_JSON`. Each stdin line is a command
`{"op": ..., ...}`; each answer is one JSON line on stdout, `{"error": ...}`
when the command raised. Between commands the transport is polled, so P
answers handshakes, acks and reaps leases on its own; after `{"op": "busy", "on":
true}` it is not (an engine thread inside one long step: P polls only on `freed`).
`"answer_in_background": true` in the spec starts P's answering thread. Block contents are
derived from `(seed, kernel id, layer)` so the test process can compute what
D should hold without NIXL.
"""

import base64
import json
import logging
import os
import select
import sys
import time

import numpy as np

from kvxfer.device.layout import check_block_compatible
from kvxfer.device.staging import Staging, block_tags
from kvxfer.nixl.agent import TransportConfig
from kvxfer.nixl.decode import DecodeTransport
from kvxfer.nixl.prefill import PrefillTransport
from kvxfer.nixl.wire import ReadParams, StreamParams, new_secret


def block_rows(seed, kernel_ids, layer, block_shape, dtype):
    """Deterministic random blocks: what P stages for `(seed, kernel id, layer)`."""
    out = np.empty((len(kernel_ids), *block_shape), dtype)
    for i, k in enumerate(kernel_ids):
        rng = np.random.default_rng([seed, k, layer])
        out[i] = rng.integers(0, 256, out[i].nbytes, dtype=np.uint8).view(dtype).reshape(block_shape)
    return out


def main():
    # NIXL logs to stdout: keep the real stdout for answers, send fd 1 to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    role, spec = sys.argv[1], json.loads(sys.argv[2])
    logging.basicConfig(level=os.environ.get("KVXFER_TEST_LOG", "WARNING"), stream=sys.stderr)
    staging = Staging(spec["layers"], spec["slots"], spec["block_shape"], spec["dtype"])
    config = TransportConfig(**spec["config"])
    layout = spec["layout"]
    if spec.get("corrupt_layout"):
        # Test hook: this P's layout advertisement arrives cut in half.
        from kvxfer.nixl import agent as transport

        encode = transport.encode_message

        def truncating(kind, /, **fields):
            raw = encode(kind, **fields)
            return raw[: len(raw) // 2] if kind == "layout" else raw

        transport.encode_message = truncating
    if role == "P":
        t = PrefillTransport(config, staging, layout)
        if spec.get("answer_in_background"):
            t.answer_in_background()
    else:
        t = DecodeTransport(config, staging, layout, check_block_compatible)
    print(json.dumps({"port": t.port, "name": t.config.name}), file=answers, flush=True)
    finished, failed, freed, secrets = [], {}, [], {}

    busy = False

    def pump():
        if busy:
            return
        if role == "P":
            freed.extend(t.poll())
        else:
            d, f = t.poll()
            finished.extend(d)
            failed.update(f)

    for_ever = True
    while for_ever:
        ready, _, _ = select.select([sys.stdin], [], [], 0.005)
        if not ready:
            pump()
            continue
        line = sys.stdin.readline()
        if not line:
            break
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "stage":
                ids = cmd["kernel_ids"]
                rows = [block_rows(cmd["seed"], ids, layer, staging.block_shape, staging.dtype)
                        for layer in range(staging.num_layers)]
                if "reserve" in cmd:
                    staging.reserve(cmd["req_id"], cmd["reserve"])
                out = {"slots": staging.stage(cmd["req_id"], ids, rows)}
            elif op == "publish":
                # P stages `kernel_ids` of a streamed request and names them final to its D.
                ids, secret = cmd["kernel_ids"], secrets.setdefault(cmd["req_id"], new_secret())
                rows = [block_rows(cmd["seed"], ids, layer, staging.block_shape, staging.dtype)
                        for layer in range(staging.num_layers)]
                slots = staging.stage(cmd["req_id"], ids, rows)
                staging.tag(slots, block_tags(secret, 0, ids))
                if cmd["last"]:
                    t.lease(cmd["req_id"], t._next_generation, secret)
                t.publish(cmd["req_id"], cmd["stream"], secret, None, [ids], [slots],
                          last=cmd["last"])
                out = {"slots": slots}
            elif op == "stream":
                t.start_stream(cmd["req_id"], StreamParams.parse(cmd["params"]),
                               cmd["logical_ids"])
                failed.pop(cmd["req_id"], None)
                out = {}
            elif op == "hold":
                out = {"params": t.hold(cmd["req_id"])}
            elif op == "freed":
                if role == "P":  # a busy P too: the engine's poll, at the end of its step
                    freed.extend(t.poll())
                out = {"freed": freed, "held": t.held(), "free_slots": staging.num_free_slots}
            elif op == "connect":
                out = {"layout": t.handshakes.connect(cmd["peer"], cmd["host"], cmd["port"])}
            elif op == "read":
                # `logical_ids`: what D reports if the read fails; blocks land under P's keys.
                t.start_read(cmd["req_id"], ReadParams.parse(cmd["params"], len(t.stagings)),
                             cmd["logical_ids"])
                failed.pop(cmd["req_id"], None)  # an id read again: forget its last outcome
                while cmd["req_id"] in finished:
                    finished.remove(cmd["req_id"])
                out = {}
            elif op == "notify":
                # Test hook: raw bytes as a notification, as a faulty or hostile peer sends them.
                t.agent.send_notif(cmd["peer"], base64.b64decode(cmd["raw"]))
                out = {}
            elif op == "wait":
                deadline = time.monotonic() + cmd["within"]
                req = cmd["req_id"]
                while req not in finished and req not in failed and time.monotonic() < deadline:
                    pump()
                    time.sleep(0.002)
                took = cmd["within"] - (deadline - time.monotonic())
                if req in finished:
                    out = {"finished": True, "took": took}
                elif req in failed:
                    out = {"failed": failed[req], "took": took}
                else:
                    out = {"pending": True, "took": took}
            elif op == "expect":
                t.expect(ReadParams.parse(cmd["params"], len(t.stagings)))
                out = {}
            elif op == "cancel":
                t.cancel(cmd["req_id"])
                out = {}
            elif op == "rows":
                slots = staging.slots(cmd["req_id"], cmd["keys"])
                out = {"rows": [base64.b64encode(staging.rows(layer, slots).tobytes()).decode()
                                for layer in range(staging.num_layers)]}
            elif op == "free":
                staging.free(cmd["req_id"])
                out = {}
            elif op == "sleep":
                end = time.monotonic() + cmd["s"]
                while time.monotonic() < end:
                    pump()
                    time.sleep(0.005)
                out = {}
            elif op == "held":  # without polling
                out = {"held": t.held(), "free_slots": staging.num_free_slots}
            elif op == "busy":
                busy = bool(cmd["on"])
                out = {}
            elif op == "exit":
                out, for_ever = {}, False
            else:
                out = {"error": "ValueError", "msg": f"unknown op {op}"}
        except Exception as e:
            out = {"error": type(e).__name__, "msg": str(e)}
        print(json.dumps(out), file=answers, flush=True)
    t.close()


if __name__ == "__main__":
    main()
