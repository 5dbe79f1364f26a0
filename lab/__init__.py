"""The device harness: benchmarks and proofs run on a GPU machine, and the tools that carry a vLLM
release there and run one session's phases. Not part of the shipped package; run from the
repository root as `python3 -m lab.MODULE` (lab/README.md)."""
