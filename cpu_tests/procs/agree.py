"""One of two JAX processes on loopback, for `test_agreement.py`: `python agree.py RANK PORT CASE`.

Prints one JSON line with what it saw. Cases:
- "many": 600 agreements with rank-dependent rows; checks every row and reports the
  keys the store still holds (old directories are dropped as it goes).
- "absent": rank 1 waits for rank 0, which never agrees: a `TransferError` in time.
- "out_of_step": the ranks agree on different numbers of flags.
"""

import json
import sys
import time

rank, port, case = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
from kvxfer.bench.hosts import start_jax  # noqa: E402

start_jax(1, f"127.0.0.1:{port}", 2, rank, "127.0.0.1")

import jax  # noqa: E402
from jax._src import distributed  # noqa: E402

from kvxfer.errors import TransferError  # noqa: E402
from kvxfer.nixl import agreement  # noqa: E402

jax.devices()  # the backend (its topology exchange) is up in both, as in an engine
out = {}
if case == "many":
    bad = 0
    for i in range(600):
        got = agreement.agree([rank, i, rank * i])
        bad += int(got.tolist() != [[0, i, 0], [1, i, i]])
    keys = distributed.global_state.client.key_value_dir_get_bytes("kvxfer/agree")
    out = {"bad": bad, "keys": len(keys)}
elif case == "absent":
    if rank == 1:
        agreement._AGREE_TIMEOUT_S = 1.0
        start = time.monotonic()
        try:
            agreement.agree([1])
        except TransferError as e:
            out = {"error": str(e), "took_s": time.monotonic() - start}
    else:
        time.sleep(4)  # never agrees
elif case == "out_of_step":
    try:
        agreement.agree([1] * (2 + rank))
    except TransferError as e:
        out = {"error": str(e)}
print(json.dumps(out), flush=True)
