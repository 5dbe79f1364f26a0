"""`flash prepare graft`: RadixArk hybrid + Inferact's NVFP4 MTP experts → `<snap>-fp8hybrid-mtpnvfp4/`.

RadixArk ships the MTP layer's routed experts as two fused BF16 tensors (5 GB, drafted in
BF16 because `mtp.*` is ignored). The graft (from the two repositories' safetensors indexes):
1. rewrite the shard holding `mtp.layers.0.mlp.experts.{gate_up_proj,down_proj}` without them
   (vLLM walks whole files, dropping index keys is not enough);
2. link Inferact's `nvfp4_experts_mtp.safetensors` (pinned revision + sha256) and map its
   6,144 per-expert keys to it;
3. in both `config.json` quantization_config.ignore and `hf_quant_config.json`
   quantization.exclude_modules replace `mtp.*` and `model.mtp.*` with the 29 explicit
   non-expert MTP module names (identical lists; 13 → 40 on the published configs, 10 → 37 on
   the hybrid's, which dropped the three side-layer globs);
   under MIXED_PRECISION (the hybrid's configs, docs/decisions/hybrid-convention.md) the donor
   experts are also listed in `quantized_layers` as NVFP4: there an unlisted layer is unquantized;
4. a static gate before `.prepared`. Built by the variant transaction (variant.py), like the hybrid.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import hfcache
from ..errors import ConfigError, WeightsMissing
from . import layout, stwriter, variant
from .layout import CheckpointError


@dataclass(frozen=True)
class Donor:
    repo: str = "Inferact/Qwen3.8-Flash-Next-NVFP4"
    revision: str = "103a7608316173ca6edd49929544244de7ffda70"
    filename: str = "nvfp4_experts_mtp.safetensors"
    sha256: str = "0d44e6d705d2313c713e60114e56874adf358ed5f646dc8704bb5be15f5ddbf7"


DONOR = Donor()
FUSED = ("mtp.layers.0.mlp.experts.gate_up_proj", "mtp.layers.0.mlp.experts.down_proj")
BLANKET = ("mtp.*", "model.mtp.*")
DONOR_EXPERTS = 6144  # 512 experts × {gate,up,down} × {weight, weight_scale, weight_scale_2, input_scale}
DONOR_SHARED = 29
_EXPERT = re.compile(r"mtp\.layers\.0\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\."
                     r"(weight|weight_scale|weight_scale_2|input_scale)")
PARTIAL = variant.PARTIAL
CONFIGS = ("config.json", "hf_quant_config.json")
NOT_LINKED = {layout.INDEX, *CONFIGS, hfcache.MARKER, "fp8_convert.log"}


def sha256_file(path: Path, desc: str = "sha256") -> str:
    h = hashlib.sha256()
    bar = None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=path.stat().st_size, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr)
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
            if bar is not None:
                bar.update(len(chunk))
    if bar is not None:
        bar.close()
    return h.hexdigest()


def fetch_donor(hf_cache, donor: Donor = DONOR, env=None, progress=None) -> Path:
    """The donor file in the HF cache (downloaded once at the pinned revision), sha256-checked."""
    snap = hfcache.repo_dir(hf_cache, donor.repo) / "snapshots" / donor.revision
    path = snap / donor.filename
    if not path.is_file():
        from . import download

        download._online()
        from huggingface_hub import hf_hub_download

        env = os.environ if env is None else env
        if progress is not None:
            progress(f"  fetching the MTP donor {donor.repo}@{donor.revision[:12]}/{donor.filename} (~1.5 GiB, once)")
        try:
            path = Path(hf_hub_download(donor.repo, donor.filename, revision=donor.revision,
                                        cache_dir=str(hfcache.cache_root(hf_cache) / "hub"),
                                        endpoint=env.get("HF_ENDPOINT") or None,
                                        token=download.token_for(hf_cache, env) or False))
        except Exception as exc:  # noqa: BLE001
            raise WeightsMissing(f"cannot fetch the MTP donor {donor.repo}@{donor.revision[:12]}: "
                                 f"{type(exc).__name__}: {exc}".splitlines()[0],
                                 hint="check the network / HF_TOKEN; the graft needs this one 1.5 GiB file") from None
    got = sha256_file(path, "donor sha256")
    if got != donor.sha256:
        blob = Path(os.path.realpath(path))
        raise CheckpointError(f"the MTP donor {path} has sha256 {got}, not the pinned {donor.sha256}",
                              hint=f"delete {blob} and run again (it is downloaded fresh)")
    return path


def check_donor(path: Path, expected: int = DONOR_EXPERTS) -> tuple[list[str], list[str]]:
    """→ (6,144 expert keys, 29 shared module names) or a CheckpointError naming the mismatch."""
    from flash_common.stheader import HeaderError, read_header

    try:
        h = read_header(path)
    except HeaderError as exc:
        raise CheckpointError(f"MTP donor: {exc}") from None
    experts, shared = [], []
    for name, t in h.tensors.items():
        if not name.startswith("mtp."):
            raise CheckpointError(f"MTP donor holds {name}, not an mtp.* tensor: wrong file")
        if name in FUSED:
            raise CheckpointError(f"MTP donor holds the fused {name}: wrong file")
        if _EXPERT.fullmatch(name):
            experts.append(name)
        elif t.dtype in ("BF16", "F16", "F32"):
            shared.append(name)
        else:
            raise CheckpointError(f"MTP donor: unexpected {t.dtype} tensor {name}")
    nvfp4 = [k for k in experts if k.endswith(".weight") and h.tensors[k].dtype == "U8"
             and k + "_scale" in h.tensors]
    if len(experts) != expected or len(nvfp4) != expected // 4 or len(shared) != DONOR_SHARED:
        raise CheckpointError(f"MTP donor has {len(experts)} expert tensors ({len(nvfp4)} NVFP4 weights) and "
                              f"{len(shared)} shared ones; expected {expected} ({expected // 4}) and {DONOR_SHARED}")
    for need in ("mtp.fc_embedding.weight", "mtp.fc_hidden.weight"):
        if need not in shared:
            raise CheckpointError(f"MTP donor lacks {need}")
    return sorted(experts), sorted(n[: -len(".weight")] if n.endswith(".weight") else n for n in shared)


def rewrite_excludes(lst: list, names: list[str], where: str) -> list[str]:
    blanket = [x for x in lst if x in BLANKET]
    explicit = [x for x in lst if isinstance(x, str) and x.startswith(("mtp.", "model.mtp.")) and x not in BLANKET]
    if sorted(blanket) != sorted(BLANKET) or explicit:
        raise CheckpointError(f"{where}: expected exactly the blanket {list(BLANKET)} and no explicit mtp entries, "
                              f"found {blanket + explicit}", hint="is this the RadixArk export, unmodified?")
    return [x for x in lst if x not in BLANKET] + names


MTP_EXPERTS = "mtp.layers.0.mlp.experts"


def _list_mtp_experts(q: dict) -> None:
    """MIXED_PRECISION: the donor's NVFP4 experts need their own quantized_layers entry."""
    if str(q.get("quant_algo", "")).upper() != "MIXED_PRECISION":
        return
    layers = q.setdefault("quantized_layers", {})
    nvfp4 = [v for v in layers.values() if str(v.get("quant_algo", "")).upper() == "NVFP4"]
    layers[MTP_EXPERTS] = {"quant_algo": "NVFP4", "group_size": int(nvfp4[0].get("group_size", 16)) if nvfp4 else 16}


def edit_configs(hybrid_dir: Path, names: list[str]) -> tuple[dict, dict, list[str]]:
    cfg = json.loads((hybrid_dir / "config.json").read_text())
    hq = json.loads((hybrid_dir / "hf_quant_config.json").read_text())
    qc = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
    if not isinstance(qc, dict):
        raise CheckpointError("config.json has no quantization_config")
    key = "ignore" if qc.get("ignore") else "exclude_modules"
    new = rewrite_excludes(list(qc.get(key) or []), names, f"config.json quantization_config.{key}")
    qc[key] = new
    hq_new = rewrite_excludes(list(hq["quantization"].get("exclude_modules") or []), names,
                              "hf_quant_config.json quantization.exclude_modules")
    hq["quantization"]["exclude_modules"] = hq_new
    for q in (qc, hq["quantization"]):
        _list_mtp_experts(q)
    if new != hq_new:
        raise CheckpointError("config.json and hf_quant_config.json exclude lists differ; they must be identical",
                              hint=f"config.json: {len(new)} entries, hf_quant_config.json: {len(hq_new)}")
    return cfg, hq, new


def gate(directory: Path, donor_keys: list[str], donor_file: str, excludes_expected: int) -> list[str]:
    from . import verify

    res = verify.structure(directory)
    problems = list(res.problems)
    for p in directory.iterdir():
        if p.is_symlink() and not p.exists():
            problems.append(f"dangling link {p.name}")
    for fname, h in res.headers.items():
        for f in FUSED:
            if f in h.tensors:
                problems.append(f"{fname} still holds the fused {f}")
    wm = json.loads((directory / layout.INDEX).read_text())["weight_map"]
    mapped = [k for k, v in wm.items() if v == donor_file]
    if sorted(mapped) != donor_keys:
        problems.append(f"{len(mapped)} index keys map to {donor_file}, expected the {len(donor_keys)} donor expert keys")
    cfg = json.loads((directory / "config.json").read_text())
    hq = json.loads((directory / "hf_quant_config.json").read_text())
    qc = cfg.get("quantization_config") or {}
    a = qc.get("ignore") or qc.get("exclude_modules") or []
    b = hq.get("quantization", {}).get("exclude_modules") or []
    if a != b:
        problems.append("the two exclude lists differ")
    if len(a) != excludes_expected or any(x in BLANKET for x in a):
        problems.append(f"exclude list has {len(a)} entries (expected {excludes_expected}, no blanket mtp globs)")
    for where, q in (("config.json", qc), ("hf_quant_config.json", hq.get("quantization") or {})):
        if str(q.get("quant_algo", "")).upper() == "MIXED_PRECISION" \
                and ((q.get("quantized_layers") or {}).get(MTP_EXPERTS) or {}).get("quant_algo") != "NVFP4":
            problems.append(f"{where}: {MTP_EXPERTS} is not NVFP4 in quantized_layers (vLLM would load it unquantized)")
    for need in ("mtp.fc_embedding", "mtp.fc_hidden"):
        if need not in a:
            problems.append(f"{need} is not excluded (vLLM would quantize it)")
    if (cfg.get("text_config") or {}).get("ple_embedding_dtype") != "float8_e4m3fn":
        problems.append("text_config.ple_embedding_dtype is no longer float8_e4m3fn")
    return problems


def build(snapshot: Path, donor_path: Path, donor: Donor = DONOR, progress=None) -> dict:
    """Plan the graft, then run it through the variant transaction (variant.py)."""
    from flash_common.stheader import read_header

    snapshot = Path(snapshot)
    hyb = hfcache.variant_dir(snapshot, "hybrid")
    dest = hfcache.variant_dir(snapshot, "hybrid-mtp")
    cfg0 = json.loads((hyb / "config.json").read_text())
    n_experts = int((cfg0.get("text_config") or cfg0).get("num_experts", 512))
    donor_keys, shared = check_donor(donor_path, n_experts * 12)
    idx = layout.load_index(hyb)
    wm: dict[str, str] = idx["weight_map"]
    fused_files = sorted({wm[f] for f in FUSED if f in wm})
    if len(fused_files) == 0 or not all(f in wm for f in FUSED):
        raise CheckpointError(f"{hyb}: the fused MTP experts {list(FUSED)} are not in the index; not a RadixArk export?")
    if donor.filename in wm.values():
        raise CheckpointError(f"{hyb} already maps tensors to {donor.filename}")
    cfg, hq, excludes = edit_configs(hyb, shared)
    # plan the rewritten shard(s): every tensor but the fused ones, same order
    plans = []
    for fname in fused_files:
        h = read_header(hyb / fname)
        keep = [t for t in sorted(h.tensors.values(), key=lambda t: t.begin) if t.name not in FUSED]
        entries = [stwriter.Entry(t.name, t.dtype, t.shape, t.nbytes) for t in keep]
        plans.append((fname, h, keep, entries, stwriter.file_size(entries, h.metadata)))
    new_wm = {k: v for k, v in wm.items() if k not in FUSED}
    for k in donor_keys:
        new_wm[k] = donor.filename
    skip = NOT_LINKED | set(fused_files)
    links = [(p, p.name) for p in sorted(hyb.iterdir()) if p.name not in skip and not p.name.startswith(".")]

    def write(partial: Path) -> None:
        for fname, h, keep, entries, _ in plans:
            if progress is not None:
                progress(f"  rewriting {fname} without {', '.join(FUSED)}")
            src = os.open(hyb / fname, os.O_RDONLY)
            w = stwriter.Writer(partial / fname, entries, h.metadata)
            try:
                for t in keep:
                    w.copy_range(src, t.begin, t.nbytes)
                w.close()
            except BaseException:
                w.abort()
                raise
            finally:
                os.close(src)
            os.chmod(partial / fname, 0o644)

    hm = hfcache.read_marker(hyb) or {}
    return variant.build(variant.Build(
        kind="hybrid-mtp", what="graft", source=snapshot, dest=dest,
        links=links + [(Path(donor_path), donor.filename)],
        configs={"config.json": cfg, "hf_quant_config.json": hq},
        rewritten=fused_files, weight_map=new_wm, index_metadata=idx.get("metadata") or {},
        write=write,
        gate=lambda partial, _: gate(partial, donor_keys, donor.filename, len(excludes)),
        gate_message="the graft failed its verification gate",
        marker=lambda _: dict(donor=f"{donor.repo}@{donor.revision}", donor_sha256=donor.sha256,
                              hybrid_build=hm.get("build_id"), removed=list(FUSED), added_keys=len(donor_keys),
                              excludes=len(excludes), rewritten=fused_files),
        bytes_needed=sum(p[4] for p in plans) + (hyb / layout.INDEX).stat().st_size * 2,
        bytes_free=shutil.disk_usage(snapshot.parent).free))


def prepare(snapshot: Path, settings, dry_run: bool = False, force: bool = False, donor: Donor = DONOR,
            progress=None) -> dict:
    model = settings["MODEL"]
    if not model.startswith("RadixArk/"):
        raise ConfigError(f"the MTP graft is for RadixArk/* checkpoints, not {model}",
                          hint="MODE=hybrid-mtp needs MODEL=RadixArk/Qwen3.8-Flash-Next-NVFP4; nvidia's MTP experts are already fp8")
    dest = hfcache.variant_dir(snapshot, "hybrid-mtp")
    state = hfcache.variant_state(snapshot, "hybrid-mtp")
    if state == "ready" and not force:
        return {"action": "none", "state": state, "dest": str(dest)}
    if hfcache.variant_state(snapshot, "hybrid") != "ready":
        raise WeightsMissing(f"the hybrid {hfcache.variant_dir(snapshot, 'hybrid').name} is not ready",
                             hint="flash prepare hybrid first (flash setup does both)")
    if dry_run:
        return {"action": "build", "state": state, "dest": str(dest), "donor": f"{donor.repo}@{donor.revision}"}
    path = fetch_donor(settings["HF_CACHE"], donor, progress=progress)
    data = build(snapshot, path, donor, progress=progress)
    return {"action": "built", "state": "ready", "dest": str(dest), "marker": data}
