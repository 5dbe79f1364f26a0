"""Container entrypoint: `python3 -m flash_vllm.launch CMD...` and `--health PORT [HOST]`.

The API key reaches vLLM through its own `VLLM_API_KEY` variable, set here from a read-only
mounted file just before exec: it is then in neither the container's Args nor its Env, so
`docker inspect` cannot show it. Standard library only (it also runs in test images).
"""

from __future__ import annotations

import os
import sys
import urllib.request


def health(port: str, host: str = "127.0.0.1") -> int:
    """GET /health where vLLM listens: HOST is the address given to `vllm serve --host` when it
    is a specific one (NETWORK=host with a non-loopback BIND listens on nothing else)."""
    target = f"[{host}]" if ":" in host else host
    try:
        with urllib.request.urlopen(f"http://{target}:{int(port)}/health", timeout=5) as resp:
            return 0 if resp.status == 200 else 1
    except Exception:  # noqa: BLE001 - any failure is "unhealthy" for Docker
        return 1


def main(argv: list[str]) -> int:
    if argv[:1] == ["--health"] and len(argv) in (2, 3):
        return health(*argv[1:])
    if not argv:
        print("usage: python3 -m flash_vllm.launch CMD [ARGS...] | --health PORT [HOST]", file=sys.stderr)
        return 2
    key_file = os.environ.pop("FLASH_API_KEY_FILE", "")
    if key_file:
        try:
            with open(key_file, encoding="utf-8") as fh:
                key = fh.read().strip()
        except OSError as exc:
            print(f"flash launch: cannot read the API key file {key_file}: {exc}", file=sys.stderr)
            return 78
        if not key:
            print(f"flash launch: the API key file {key_file} is empty", file=sys.stderr)
            return 78
        os.environ["VLLM_API_KEY"] = key
    os.execvp(argv[0], argv)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
