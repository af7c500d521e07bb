"""Things that write test material, not part of the worker or the driver: random-weight models in HF layout
(`testbed.models`) and small offline lm-eval tasks (`testbed.tasks`). Tests, benchmarks and `driver demo` use them.
`testbed.inproc` runs a `driver` command in the test's own process (the real entry point, its output captured)
where a subprocess adds nothing."""
