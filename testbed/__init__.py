"""Things that write test material, not part of the worker or the driver: random-weight models in HF layout
(`testbed.models`) and small offline lm-eval tasks (`testbed.tasks`), for tests and benchmarks. The demo's story
tasks live with `driver demo` in driver/demo.py (`testbed.stories` re-exports them for tests).
`testbed.inproc` runs a `driver` command in the test's own process (the real entry point, its output captured)
where a subprocess adds nothing."""
