"""`flash patches [--image IMAGE] [--json] [--expected]`: the patch matrix of an image.

Runs `python3 -m flash_vllm.selfcheck --json` inside the image (no GPU needed; the same check
the Dockerfile's last step ran) and prints, per patch, its status on that image's vLLM:
applies / upstream / not-needed / not-ported / broken, and the env variables each one hands the
compile-cache key (`traces`). `--expected` prints what the registry declares for a base instead,
without Docker. Each patch's code is its folder `src/flash_vllm/patches/pNN_name/`. Exit 1 when a
patch is broken.
"""

from __future__ import annotations

import argparse
import json
import os

from ..errors import FlashError, UsageError
from ..output import print_json, say
from . import summary


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("patches", help=summary("patches"))
    p.add_argument("--image", help="image to inspect (default: IMAGE, else flash-vllm:<BASE>)")
    p.add_argument("--base", help="base for --expected / the default image name (default: BASE or current)")
    p.add_argument("--expected", action="store_true", help="the registry's declared matrix; no Docker")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(func=run)


def _base(args: argparse.Namespace) -> str:
    from flash_common import releases

    base = args.base or os.environ.get("BASE") or releases.CURRENT
    if base not in releases.ORDER:
        raise UsageError(f"--base {base!r} is not a supported base", hint=f"one of: {', '.join(releases.newest_first())}")
    return base


def expected(base: str) -> dict:
    from flash_vllm.registry import catalogue, patchset_hash

    return {"release": None, "base": base, "patchset": patchset_hash(), "source": "registry",
            "patches": [{"number": p.number, "name": p.name, "status": p.expected_status(base),
                         "detail": p.not_ported.get(base, ""), "folder": p.folder, "traced": list(p.traced)}
                        for p in catalogue()]}


def from_image(image: str) -> dict:
    from .. import engine

    client = engine.connect()
    labels = engine.require_image(client, image)
    # Detached so a non-zero exit (a broken patch) still yields the matrix on stdout.
    container = client.containers.run(image, ["-m", "flash_vllm.selfcheck", "--json"], entrypoint=["python3"],
                                      detach=True, network_mode="none")
    try:
        status = container.wait().get("StatusCode")
        out = container.logs(stdout=True, stderr=False).decode(errors="replace")
        err = container.logs(stdout=False, stderr=True).decode(errors="replace")
    finally:
        container.remove(force=True)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if not lines:
        hint = ("is it a vLLM image with flash_vllm installed? (flash setup builds one)" if status == 2
                else "rebuild the image with flash setup; docs/PATCHES.md lists what each base needs")
        tail = " | ".join(err.strip().splitlines()[-3:]) or "no output"
        raise FlashError(f"selfcheck failed inside {image} (exit {status}): {tail}", hint=hint)
    result = json.loads(lines[-1])
    result.update(image=image, source="image", label_patchset=labels.get("org.flash.patchset"))
    return result


def run(args: argparse.Namespace) -> int:
    base = _base(args)
    if args.expected:
        result = expected(base)
    else:
        from ..spec import default_image

        image = args.image or os.environ.get("IMAGE") or default_image(base)
        say(f"running the flash_vllm selfcheck inside {image} …")
        result = from_image(image)
    broken = [p for p in result["patches"] if p["status"] == "broken"]
    if args.json:
        print_json(result)
        return 1 if broken else 0
    where = result.get("image") or "registry"
    release = f"vLLM {result['release']}, " if result.get("release") else ""
    print(f"{where}: {release}base {result['base']}, patch set {result['patchset']}")
    for p in result["patches"]:
        traces = f"traces {', '.join(p['traced'])}" if p.get("traced") and p["status"] == "applies" else ""
        print(f"  {p['number']:>2}  {p['name']:<20} {p['status']:<11} {p.get('detail', '') or traces}".rstrip())
    if any(p.get("folder") for p in result["patches"]):  # an image built before the folders has none
        print("  code: src/flash_vllm/patches/pNN_name/; traces: env the compile-cache key hashes")
    if result.get("label_patchset") and result["label_patchset"] != result["patchset"]:
        print(f"  note: image label org.flash.patchset={result['label_patchset']} differs from the code inside")
    return 1 if broken else 0
