"""The evidence configurations of a sweep: prompting baselines (`prompting`), a judge model rating every
generation on AxBench's three 0–2 scales (`rate`, `rubric`), repeated sampled generations per seed, and what the
report draws and says of them (`pareto`, `compare`)."""
