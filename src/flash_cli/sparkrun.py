"""PURE: a RunSpec → a sparkrun recipe (sparkrun 0.4.2's format, recipe_version 2), for Spark owners
who launch through sparkrun (issue 36).

sparkrun mounts the host's HF cache at /cache/huggingface, sets the container's command from the
recipe's `command:` template (`{port}`, `{host}`, `{served_model_name}` from `defaults:`) and owns
the port, the readiness wait and the stop. So the recipe is serve's argv with the model path moved
under that mount and the listen address, port and model name made placeholders; the environment is
serve's (HF_HOME moved too). What sparkrun does not carry: the API key file (sparkrun serves without
flash's key launcher: keep BIND on loopback or put your own auth in front), and the memory guard.
"""

from __future__ import annotations

import shlex

from .spec import HF_MOUNT, RunSpec

SPARKRUN_HF = "/cache/huggingface"  # sparkrun.orchestration.primitives.build_volumes
PINNED = "0.4.2"


# serve's flags whose values sparkrun's `-o key=value` overrides (recipe `defaults:` hold serve's values)
PLACEHOLDERS = {"--host": "host", "--port": "port", "--served-model-name": "served_model_name",
                "--max-model-len": "max_model_len", "--gpu-memory-utilization": "gpu_memory_utilization"}


def _path(arg: str) -> str:
    return SPARKRUN_HF + arg[len(HF_MOUNT):] if arg == HF_MOUNT or arg.startswith(HF_MOUNT + "/") else arg


def command_template(spec: RunSpec) -> str:
    """serve's argv with the sparkrun placeholders; every other word shell-quoted as is."""
    argv = [_path(a) for a in spec.command]
    words = []
    skip = False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a in PLACEHOLDERS and i + 1 < len(argv):
            key = PLACEHOLDERS[a]
            words += [a, "{" + key + "}"]
            skip = True
            continue
        words.append(shlex.quote(a))
    return " ".join(words)


def recipe(spec: RunSpec, settings, profile) -> dict:
    env = {k: _path(v) for k, v in spec.env.items() if k != "FLASH_API_KEY_FILE"}
    env["HF_HOME"] = SPARKRUN_HF
    return {
        "recipe_version": "2",
        "min_sparkrun_version": PINNED,
        "description": f"flash profile '{profile.name}': {profile.desc} (flash export sparkrun; settings "
                       f"{spec.labels.get('org.flash.settings', '')})",
        "model": settings["MODEL"],
        "model_revision": spec.command[2].rsplit("/", 1)[-1].split("-")[0],
        "runtime": "vllm",
        "mode": "solo",
        "container": spec.image,
        "defaults": {"host": "0.0.0.0", "port": 8000, "served_model_name": settings["SERVED_MODEL_NAME"],
                     "max_model_len": settings["CTX"], "gpu_memory_utilization": f"{settings['GPU_MEM']:.2f}"},
        "env": env,
        "command": command_template(spec),
    }


def recipe_text(spec: RunSpec, settings, profile) -> str:
    import yaml

    head = [f"sparkrun recipe of flash profile '{profile.name}' (flash export sparkrun); sparkrun >= {PINNED}",
            f"image {spec.image}: built from the flash repository (flash setup); sparkrun runs it, it does not build it",
            "the model path is the snapshot under sparkrun's HF cache mount; the fp8 hybrid / graft layouts "
            "(MODE=hybrid, hybrid-mtp) must be prepared there first (flash prepare)",
            "not carried: flash's API key file (keep the port on loopback) and the memory guard (docs/GUARD.md)"]
    body = yaml.safe_dump(recipe(spec, settings, profile), sort_keys=False, width=1_000_000, allow_unicode=True)
    return "".join(f"# {h}\n" for h in head) + body
