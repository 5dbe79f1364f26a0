"""Maintainer scripts: the generated docs (gen_*), the release check (check_vllm_release) and the
draft vocabulary build. Run with the project venv's python (`flash_*` installed):
`.venv/bin/python tools/NAME.py`; tests import them as `tools.NAME`. The device harness and
benchmarks are in lab/."""
