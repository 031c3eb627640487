"""The lab: one-off investigations, run from a checkout and never installed (setup.cfg excludes
``infra.lab``; nothing in the package imports it, tests/test_layering.py). Each module's docstring
says what question it answered and where the answer is written up:

- ``overhead`` (+ ``overhead_roles``, ``overhead_interleave``): what does sync cost a learner's
  step? ``python -m infra.lab.overhead``; docs/results-overhead.md.
- ``overhead_ablate``: which learner feature or neighbour makes the rest of that cost?
  ``python -m infra.lab.overhead_ablate``; docs/results-overhead.md "The other steps, taken apart".
- ``bench_cli`` (``bench_scaling``, ``bench_load``, ``bench_versions``): do codec and fold scale with
  threads, what does a 100M-parameter round cost, how fast are new versions found? docs/scale.md.
- ``bench_device_quant``: does quantising on the learner's device pay? docs/results-overhead.md.
- ``same_bytes``: does a refactor keep every stored object's bytes? (run it under both trees).

Each is smoke-tested by the suite (tests/test_overhead_benchmark.py, test_overhead_ablate.py,
test_bench.py, test_device_quant.py, test_learner_steptrace.py).
"""
