"""Stub of tokamax (see tokamax/_src/ops/experimental/gmm_v2/gmm_v2.py)."""
