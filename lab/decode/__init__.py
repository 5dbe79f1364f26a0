"""The decode bench's parts, one module a job (lab/bench_decode.py is their command line):

- model: the real model's shape as a config, tokenizer and PLE table (`prepare`)
- servers: the compared servers as env + argv; waiting for /health, stopping
- client: streamed completions timed per stream, counters read around each measurement
- schedule: which server is measured when (`matrix`, `serve-run`, `run`)
- greedy: fixed prompts, greedy token ids, and their diff
- stats: medians, ratios, paired verdicts with bootstrap intervals, the 48-layer estimate
- extrapolate: ms per token against the layer count, and the GB10 estimate
- plot: the report as JSON and a chart
"""
