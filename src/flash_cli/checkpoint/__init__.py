"""Checkpoint pipeline on the host: download plan, verification, fp8 hybrid, MTP graft.

Modules: `fp8` (block quantization math), `stwriter` (streaming safetensors writer),
`layout` (index helpers and tensor selection), `marker` (`.prepared`), `verify`, `hybrid`,
`graft`, `hub` (huggingface_hub download plan). numpy/ml_dtypes/huggingface_hub are imported
inside functions so the CLI stays fast to start.
"""
