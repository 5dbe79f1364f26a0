"""What both wings need without vLLM: the release catalogue (`releases`), the safetensors
header/index reader (`stheader`), the reasoning-effort map (`effort`) and the commit a result
names (`provenance`). Imports nothing of
flash_cli or flash_vllm, and nothing outside the standard library."""
