"""Benchmarks behind `kvxfer bench ...`: each module's `run()` returns a JSON-able dict
of figures, with a reference measured in the same run."""
