"""A stub of tokamax, the two names tpu-inference 0.32 imports from it.

Why: tpu-inference imports tokamax's grouped matmul (`gmm_v2`, `calculate_tiling`) at module load,
but tokamax 0.0.17 requires Python >= 3.12 and these machines run 3.11. Only tpu-inference's MoE
and batched-linear paths call the two functions; the dense models served here never do.
What: the same module path, with both functions raising NotImplementedError if ever called.
"""
