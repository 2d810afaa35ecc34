"""Save plans: which blocks to copy when, per KV cache group; no JAX, no NIXL (see README.md here)."""
