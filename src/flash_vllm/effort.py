"""The reasoning-effort aliases, as data: read by patch 12 (v0.29-v0.32) inside the image and by
the host's run spec (v0.33's `--reasoning-effort-map`). Imports nothing, so the host can use it
without loading the patch registry."""

# The model's template accepts xhigh (default), medium and low; clients also send these.
EFFORT_MAP = {"high": "xhigh", "max": "xhigh", "minimal": "low"}
