"""A P and a D connector in one process (P on some devices, D on others), for tests.

P's transport is polled from a background thread once P's saves are done
(each transport is used from one thread at a time), so D's handshake and
reads get answers while the test drives D. Every wait has a deadline.
"""

import itertools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvxfer.connector.config import ConnectorConfig
from kvxfer.connector.decode import DecodeConnector
from kvxfer.connector.prefill import PrefillConnector
from kvxfer.connector.scheduler import LoadRequest
from kvxfer.nixl.agent import TransportConfig
from kvxfer.nixl.wire import hash_hex
from kvxfer.plan.save_plan import GroupSpec

SHAPE = (32, 16, 4, 2, 32)  # [blocks, tokens, heads*2/p, p, dim], bf16
HEADS = PartitionSpec(None, None, "model")
_names = itertools.count()


def caches_on(devices, seed, layers=2, shape=SHAPE, spec=HEADS, data=1):
    """Random bf16 caches (as bits, so NaN payloads are kept) sharded over `devices` by `spec`
    (axis 2 by default), on a `('data', 'model')` mesh whose `data` axis is `data` long."""
    mesh = Mesh(np.array(devices).reshape(data, len(devices) // data), ("data", "model"))
    sharding = NamedSharding(mesh, spec)
    rng = np.random.default_rng(seed)
    return [jax.device_put(jax.lax.bitcast_convert_type(
        jnp.asarray(rng.integers(0, 1 << 16, shape, dtype=np.uint16)), jnp.bfloat16), sharding)
        for _ in range(layers)]


def as_bits(cache):
    return np.asarray(cache).view(np.uint16)


def copy_block(cache, dst, src):
    """`cache` with block `src` copied over `dst`, as bits (a float op could canonicalize NaNs)."""
    bits = jax.lax.bitcast_convert_type(cache, jnp.uint16)
    return jax.lax.bitcast_convert_type(bits.at[dst].set(bits[src]), jnp.bfloat16)


def rewrite_blocks(cache, ids, seed):
    """`cache` with kernel blocks `ids` overwritten by fresh random bits (a forward pass's write)."""
    bits = jax.lax.bitcast_convert_type(cache, jnp.uint16)
    fresh = np.random.default_rng(seed).integers(0, 1 << 16, (len(ids), *cache.shape[1:]),
                                                 dtype=np.uint16)
    new = bits.at[np.asarray(ids)].set(jnp.asarray(fresh))
    return jax.device_put(jax.lax.bitcast_convert_type(new, jnp.bfloat16), cache.sharding)


class Pair:
    """A P and a D connector over NIXL; P is served from a thread after `serve()`.

    `groups` are P's `GroupSpec`s; each group gets its own caches of `shape`
    (`shape[1]` tokens per kernel block). P's caches are on `p_devices`, D's on
    `d_devices` (different TP on each side). `models` are P's and D's model descriptions;
    `specs` P's and D's partition specs (None: axis 2), over meshes whose `data` axes are
    `data` long (P's, D's); `pool_bytes` P's `host_pool_bytes`; `keys` P's and D's
    `fleet_key_file`; `seal` P's `seal_kv`.
    """

    def __init__(self, kernel_ratio=1, block_size=16, deadline=10.0, groups=None, shape=SHAPE,
                 p_devices=(0, 1, 2, 3), d_devices=(4, 5, 6, 7), layers=2, verify=True,
                 models=(None, None), handshake=10.0, lease=30.0, heartbeat=5.0, stats=True,
                 specs=(None, None), stream_wait=600.0, data=(1, 1), pool_bytes=0,
                 keys=(None, None), seal=False):
        n = next(_names)
        groups = groups or [GroupSpec(block_size)]
        cfg = dict(staging_blocks=shape[0], kernel_ratio=kernel_ratio, stats=stats)
        devices = jax.devices()
        specs = [HEADS if s is None else s for s in specs]
        self.p_caches = [caches_on([devices[i] for i in p_devices], seed=1 + 10 * g,
                                   layers=layers, shape=shape, spec=specs[0], data=data[0])
                         for g in range(len(groups))]
        self.d_caches = [caches_on([devices[i] for i in d_devices], seed=2 + 10 * g,
                                   layers=layers, shape=shape, spec=specs[1], data=data[1])
                         for g in range(len(groups))]
        self.single = len(groups) == 1
        p_transport = TransportConfig(f"P{n}", lease_s=lease, heartbeat_interval_s=heartbeat,
                                      fleet_key_file=keys[0])
        self.p = PrefillConnector(ConnectorConfig(p_transport, host_pool_bytes=pool_bytes,
                                                  seal_kv=seal, **cfg),
                                  groups, self.p_caches, model=models[0])
        self.d = DecodeConnector(ConnectorConfig(
            TransportConfig(f"D{n}", transfer_timeout_s=deadline, handshake_timeout_s=handshake,
                            heartbeat_interval_s=heartbeat, stream_wait_s=stream_wait,
                            fleet_key_file=keys[1]),
            verify_fingerprints=verify, **cfg), self.d_caches, model=models[1])
        self.freed, self._stop, self._thread = [], threading.Event(), None
        self._lock = threading.Lock()

    def caches(self, side):
        """One group's caches as a plain list (the single-group form), else per group."""
        caches = self.p_caches if side == "p" else self.d_caches
        return caches[0] if self.single else caches

    def save(self, *steps):
        meta = self.p.build_connector_meta(list(steps))
        self.p.wait_for_save(self.caches("p"), meta)
        return meta

    def serve(self):
        def loop():
            while not self._stop.is_set():
                with self._lock:
                    self.freed += self.p.get_finished()
                self._stop.wait(0.001)
        if self._thread is None:
            self._thread = threading.Thread(target=loop, daemon=True)
            self._thread.start()

    def get_finished(self):
        caches, finished, failed = self.d.get_finished(self.caches("d"))
        self.d_caches = [caches] if self.single else caches
        return finished, failed

    def load_all(self, requests, expect, timeout=20.0):
        """Start `requests` (`{req_id: (params, table[, have])}`) and poll D until `expect`
        requests are reported; `(finished, failed)`."""
        self.d.start_load_kv({r: entry if isinstance(entry, LoadRequest) else LoadRequest(*entry)
                              for r, entry in requests.items()})
        return self.wait(expect, timeout)

    def wait(self, expect, timeout=20.0):
        finished, failed = [], []
        deadline = time.monotonic() + timeout
        while len(finished) + len(failed) < expect and time.monotonic() < deadline:
            f, x = self.get_finished()
            finished, failed = finished + f, failed + x
        return finished, failed

    def wait_freed(self, count, timeout=20.0):
        """Wait until P's serving thread has freed `count` requests; the ids freed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.freed) >= count:
                    return list(self.freed)
            time.sleep(0.005)
        return list(self.freed)

    def load(self, req_id, params, d_ids, timeout=20.0, hashes=None):
        """D loads `req_id`; `hashes`: the block hashes of D's prompt per group, as P was given
        them (`block_hashes`), which pooled blocks P names are checked by."""
        return self.load_all({req_id: d_request(params, d_ids, hashes)}, 1, timeout)

    def close(self):
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        self.d.close()
        self.p.close()


def d_request(params, d_ids, hashes=None, **kw):
    """D's `LoadRequest`, with `hashes` (per group, as P's `block_hashes`) as D names them."""
    return LoadRequest(params, d_ids, hashes=None if hashes is None else [
        [hash_hex(h) for h in group] for group in hashes], **kw)
