"""Gates and measurements against a running server's HTTP API: `flash test` (checks.py),
`flash probe` (probe.py), `flash bench` (bench.py). Host side only; imports stay light
(requests and prometheus_client are imported by the modules that use them)."""
