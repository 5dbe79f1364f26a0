"""flash host side: settings, profiles, run specs, the Docker engine layer and the checkpoint tools.

Never imports vLLM. Heavy libraries (docker, huggingface_hub, numpy) are imported inside the
functions that need them so `flash --help` and `flash serve --dry-run` start fast.
"""

__version__ = "0.1.0"
