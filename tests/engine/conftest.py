"""Engine tier: real Docker Engine (tests/run starts one), images built locally, no registry."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE = "flash-test-base:bookworm"
STANDIN = "flash-standin:test"
IMAGE = "flash-vllm:enginetest"
SNAP = "5f0c6c1f4b7e2a9d8c3b1a0f9e8d7c6b5a4f3e2d"
MODEL = "nvidia/Qwen3.8-Flash-Next-NVFP4"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def docker_client():
    import docker

    client = docker.from_env()
    client.ping()  # fail (never skip) when the engine is missing: tests/run starts one
    return client


def tiny_safetensors(path: Path) -> None:
    header = json.dumps({"model.norm.weight": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)


@pytest.fixture(scope="session")
def hf_cache(tmp_path_factory) -> Path:
    """A complete (tiny) snapshot in the real HF cache layout: refs/main → snapshots/<sha>."""
    cache = tmp_path_factory.mktemp("hf")
    repo = cache / "hub" / f"models--{MODEL.replace('/', '--')}"
    snap = repo / "snapshots" / SNAP
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAP)
    (snap / "config.json").write_text(json.dumps({"architectures": ["Qwen4ExpForConditionalGeneration"],
                                                  "quantization_config": {"quant_method": "modelopt"}}))
    for name in ("generation_config.json", "tokenizer_config.json", "preprocessor_config.json"):
        (snap / name).write_text("{}")
    (snap / "tokenizer.json").write_text('{"model": {}}')
    (snap / "chat_template.jinja").write_text("{{ messages }}")
    tiny_safetensors(snap / "model-00001-of-00001.safetensors")
    (snap / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.norm.weight": "model-00001-of-00001.safetensors"}}))
    return cache


def copy_dists(names: list[str], dest: Path) -> None:
    """The installed files of these distributions and of everything they require (markers
    evaluated here, extras not followed), copied under dest as a site-packages tree."""
    from importlib import metadata

    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        dist = metadata.distribution(name)
        for req in map(Requirement, dist.requires or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
        for f in dist.files or []:
            if f.parts[0] in ("..", "__pycache__") or "__pycache__" in f.parts or f.parts[0].endswith(".data"):
                continue
            target = dest / f
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(dist.locate_file(f), target)


@pytest.fixture(scope="session")
def standin_image(docker_client, tmp_path_factory):
    subprocess.run([str(ROOT / "tests" / "support" / "standin_base.sh"), BASE], check=True)
    ctx = tmp_path_factory.mktemp("standin-ctx")
    shutil.copy(ROOT / "tests" / "standin" / "server.py", ctx / "server.py")
    # Every vLLM image has the router's stack (prometheus_client, uvicorn, httptools, uvloop, starlette,
    # aiohttp: vLLM dependencies): the stand-in base gets the files of our own pins (the `router`
    # extra) and what they need, as installed here (CPython 3.11 like bookworm's python3).
    copy_dists(["prometheus_client", "uvicorn", "httptools", "uvloop", "starlette", "aiohttp"], ctx / "site")
    shutil.copy(ROOT / "tests" / "engine" / "standin.Dockerfile", ctx / "Dockerfile")
    docker_client.images.build(path=str(ctx), tag=STANDIN, buildargs={"BASE": BASE}, rm=True)
    return STANDIN


class Flash:
    """Runs ./flash's CLI as a user would, with a per-test container name, port and state dir."""

    def __init__(self, home: Path, hf: Path, port: int, name: str):
        self.home, self.hf, self.port, self.name = home, hf, port, name
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("STANDIN_",))},
            "HOME": str(home), "HF_CACHE": str(hf), "NAME": name, "PORT": str(port), "NETWORK": "host",
            "GPUS": "none", "IMAGE": IMAGE, "COMPILE_CACHE": "", "SHM_SIZE": "64m", "RESTART": "no",
            "MODE": "nvfp4", "BASE": "v0.33",
        }

    def __call__(self, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "flash_cli", *args], capture_output=True, text=True,
                              env={**self.env, **(env or {})}, cwd=ROOT, timeout=timeout)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="session")
def setup_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("setup-home")


@pytest.fixture(scope="session")
def built_image(docker_client, standin_image, hf_cache, setup_home):
    """Our real Dockerfile, built by `flash setup` FROM the stand-in base."""
    home = setup_home
    f = Flash(home, hf_cache, free_port(), "flash-setup")
    if docker_client.images.list(name=IMAGE):
        docker_client.images.remove(IMAGE, force=True)
    res = f("setup", "published", f"BASE_IMAGE={standin_image}", "SELFCHECK=0", timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    yield IMAGE
    # Rebuilds leave untagged copies behind (vfs stores each in full): drop ours only.
    for label in ("org.flash.base", "org.flash.test"):
        docker_client.images.prune(filters={"dangling": True, "label": label})


@pytest.fixture
def flash(built_image, hf_cache, tmp_path, docker_client):
    name = f"flash-test-{uuid.uuid4().hex[:8]}"
    f = Flash(tmp_path, hf_cache, free_port(), name)
    yield f
    for c in docker_client.containers.list(all=True, filters={"label": f"org.flash.name={name}"}):
        c.remove(force=True)
