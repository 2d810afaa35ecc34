"""What `kvxfer demo` runs: a small Flax decoder across P and D, against colocated decode.

- `kvxfer.demo.model`: the decoder, its paged attention and tpu-inference's cache layout;
- `kvxfer.demo.engine`: chunked prefill and greedy decode around it;
- `kvxfer.demo.disagg`: P and D as two processes, and the comparisons (`kvxfer demo`);
- `kvxfer.demo.kvbytes`: random KV bytes in any layout, P to D (`kvxfer kvbytes`);
- `kvxfer.demo.procs`: the child-process plumbing the demos and benches share.

None of it is part of kvxfer's transfer API.
"""

from kvxfer.demo.disagg import DemoConfig, report, run_demo

__all__ = ["DemoConfig", "report", "run_demo"]
