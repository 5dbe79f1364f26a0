"""The reasoning-effort aliases, as data: read by patch 12 inside the image (releases without
vLLM's `--reasoning-effort-map`) and by the host's run spec (releases with it: the catalogue's
`reasoning_effort_map` capability). Imports nothing, so both wings can use it."""

# The model's template accepts xhigh (default), medium and low; clients also send these.
EFFORT_MAP = {"high": "xhigh", "max": "xhigh", "minimal": "low"}
