"""What both wings need without vLLM: the release catalogue (`releases`), the safetensors
header/index reader (`stheader`) and the reasoning-effort map (`effort`). Imports nothing of
flash_cli or flash_vllm, and nothing outside the standard library."""
