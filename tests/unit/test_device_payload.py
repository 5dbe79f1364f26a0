"""lab/device_payload.py: pack with fake wheels (no network), split, receive in any order,
refuse corrupt parts and incomplete stores, install into a prefix with a stand-in pip."""

import hashlib
import json
import random
import zipfile
from pathlib import Path

import pytest

from lab import device_payload

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dp():
    return device_payload


def quiet(*a, **k):
    pass


WHEELS = [
    "tinya-1.0-py3-none-any.whl",
    "tinyb-2.0.1-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
    "tinyc-0.3-cp312-abi3-manylinux_2_31_x86_64.whl",
    "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
]


def make_wheel(path: Path, seed: int, size: int = 3000) -> Path:
    """A real (zip) wheel with a module and dist-info, padded with incompressible bytes."""
    name, version = path.name.split("-")[:2]
    rnd = random.Random(seed)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", f"__version__ = {version!r}\n")
        z.writestr(f"{name}/blob.bin", bytes(rnd.getrandbits(8) for _ in range(size)))
        z.writestr(f"{name}-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return path


class FakeDownloader:
    def __init__(self):
        self.calls = []

    def __call__(self, filename, dest):
        self.calls.append(filename)
        return make_wheel(dest / filename, seed=len(self.calls))


@pytest.fixture()
def packed(dp, tmp_path):
    """The fake wheels fetched through the injected downloader and packed into 1 KiB-ish parts."""
    dl = FakeDownloader()
    cache = tmp_path / "cache"
    wheels = dp.fetch_wheels(WHEELS, cache, dl, local_dirs=(), log=quiet)
    out = tmp_path / "payload"
    m = dp.pack("0.33.0", wheels, out, part_size=4096)
    return m, out, cache, dl


def test_wheel_requirement_and_platforms(dp):
    assert dp.wheel_requirement("torch-2.14.0-cp312-cp312-manylinux_2_28_x86_64.whl") == ("torch", "2.14.0")
    assert dp.wheel_requirement("partial_json_parser-0.2.1.1.post7-py3-none-any.whl")[1] == "0.2.1.1.post7"
    assert dp.wheel_platforms(WHEELS[1]) == ["manylinux_2_17_x86_64", "manylinux2014_x86_64"]
    assert dp.wheel_platforms(WHEELS[0]) == []
    with pytest.raises(dp.PayloadError, match="not a wheel filename"):
        dp.wheel_requirement("torch-2.14.0.tar.gz")


def test_read_list_skips_comments_and_refuses_duplicates(dp, tmp_path):
    lst = tmp_path / "l.txt"
    lst.write_text("# header\n\n" + "\n".join(WHEELS) + "\n")
    assert dp.read_list(lst) == WHEELS
    lst.write_text(WHEELS[0] + "\n" + WHEELS[0] + "\n")
    with pytest.raises(dp.PayloadError, match="twice"):
        dp.read_list(lst)
    lst.write_text("not-a-wheel.zip\n")
    with pytest.raises(dp.PayloadError, match="not a wheel"):
        dp.read_list(lst)


def test_pack_splits_into_parts_whose_hashes_the_manifest_holds(dp, packed):
    m, out, cache, dl = packed
    parts = sorted(out.glob("part-*"))
    assert [p.name for p in parts] == [p["name"] for p in m["parts"]]
    assert len(parts) > 3, "the small part size must split the tar"
    assert all(p.stat().st_size <= 4096 for p in parts)
    assert all(p.stat().st_size == 4096 for p in parts[:-1])
    for p, e in zip(parts, m["parts"]):
        assert hashlib.sha256(p.read_bytes()).hexdigest() == e["sha256"]
    whole = b"".join(p.read_bytes() for p in parts)
    assert len(whole) == m["tar"]["size"]
    assert hashlib.sha256(whole).hexdigest() == m["tar"]["sha256"]
    assert sorted(w["name"] for w in m["wheels"]) == sorted(WHEELS)
    for w in m["wheels"]:
        assert hashlib.sha256((cache / w["name"]).read_bytes()).hexdigest() == w["sha256"]
    # manifest round trip: the file on disk loads back to the same data
    assert dp.load_manifest(out / "manifest.json") == m


def test_pack_is_deterministic_and_cache_makes_repack_download_nothing(dp, packed, tmp_path):
    m, out, cache, dl = packed
    n = len(dl.calls)
    assert n == len(WHEELS)
    wheels = dp.fetch_wheels(WHEELS, cache, dl, local_dirs=(), log=quiet)
    assert len(dl.calls) == n, "a re-pack must take every wheel from the cache"
    m2 = dp.pack("0.33.0", wheels, tmp_path / "again", part_size=4096)
    assert m2["tar"]["sha256"] == m["tar"]["sha256"]


def test_fetch_prefers_a_local_wheel_dir(dp, tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    make_wheel(local / WHEELS[3], seed=9)
    dl = FakeDownloader()
    got = dp.fetch_wheels([WHEELS[3]], tmp_path / "cache", dl, local_dirs=(local,), log=quiet)
    assert got == [local / WHEELS[3]] and dl.calls == []


def test_downloader_result_must_be_the_listed_file(dp, tmp_path):
    def wrong(filename, dest):
        return make_wheel(dest / "tinya-1.0-py2-none-any.whl", seed=1)

    with pytest.raises(dp.PayloadError, match="expected"):
        dp.fetch_wheels([WHEELS[0]], tmp_path / "c", wrong, local_dirs=(), log=quiet)


def test_pip_downloader_tries_the_filenames_own_tags_first_and_refuses_other_builds(dp, tmp_path, monkeypatch):
    seen = []

    class R:
        def __init__(self, rc):
            self.returncode, self.stdout, self.stderr = rc, "", "ERROR: No matching distribution"

    def fake_run(argv, **kw):
        plats = [argv[i + 1] for i, a in enumerate(argv) if a == "--platform"]
        seen.append(plats)
        dest = Path(argv[argv.index("-d") + 1])
        if plats == ["manylinux_2_31_x86_64"]:  # pip would pick another build for this set
            make_wheel(dest / "tinyc-0.3-cp312-abi3-manylinux_2_17_x86_64.whl", seed=1)
            return R(0)
        if "manylinux_2_34_x86_64" in plats:
            make_wheel(dest / WHEELS[2], seed=1)
            return R(0)
        return R(1)

    monkeypatch.setattr(dp.subprocess, "run", fake_run)
    out = dp.pip_downloader(WHEELS[2], tmp_path)
    assert out == tmp_path / WHEELS[2] and out.is_file()
    assert seen[0] == ["manylinux_2_31_x86_64"]
    assert seen[-1][-1] == "manylinux_2_34_x86_64"
    assert not list(tmp_path.glob(".dl-*")), "temporary download dirs are removed"
    monkeypatch.setattr(dp.subprocess, "run", lambda argv, **kw: R(1))
    with pytest.raises(dp.PayloadError, match="tinyc==0.3"):
        dp.pip_downloader(WHEELS[2], tmp_path)


def carry(out: Path, name: str, where: Path) -> Path:
    """What the device tool does: the part appears in a fresh checkout copy."""
    where.mkdir(parents=True, exist_ok=True)
    dst = where / name
    dst.write_bytes((out / name).read_bytes())
    return dst


def test_receive_in_random_order_then_install(dp, packed, tmp_path, capsys):
    m, out, cache, dl = packed
    store = tmp_path / "store"
    names = [p["name"] for p in m["parts"]]
    order = names[:]
    random.Random(3).shuffle(order)
    assert order != names
    for i, name in enumerate(order):
        part = carry(out, name, tmp_path / f"call{i}")
        st = dp.receive([part], store, m, log=quiet)
        assert not part.exists(), "a received part is moved into the store"
        assert st["have"] == i + 1
        assert st["missing"] == [n for n in names if n not in order[: i + 1]]
        assert st["complete"] == (i == len(order) - 1)
    # the manifest was staged in the store: a later call finds it without one carried
    assert dp.find_manifest(None, [], store, None) == m
    # the CLI's status line is machine-readable
    dp.print_status(st)
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith(dp.STATUS_PREFIX)][0]
    assert json.loads(line[len(dp.STATUS_PREFIX):])["complete"] is True

    pip_calls = []

    def fake_pip(argv, **kw):
        if argv[1:3] == ["-m", "pip"]:
            pip_calls.append(argv)
            target = Path(argv[argv.index("--target") + 1])
            for whl in argv[argv.index("--target") + 2:]:
                with zipfile.ZipFile(whl) as z:
                    z.extractall(target)
            return type("R", (), {"returncode": 0, "stdout": "", "stderr": ""})()
        raise AssertionError(argv)

    s = dp.open_store(store, m)
    prefix = tmp_path / "prefix"
    orig = dp.subprocess.run
    dp.subprocess.run = fake_pip
    try:
        mark = dp.install(s, prefix, log=quiet)
    finally:
        dp.subprocess.run = orig
    assert mark["wheels"] == len(WHEELS)
    argv = pip_calls[0]
    for flag in ("--no-index", "--no-deps", "--no-compile"):
        assert flag in argv
    assert sorted(Path(w).name for w in argv[argv.index("--target") + 2:]) == sorted(WHEELS)
    assert (prefix / "tinyb" / "__init__.py").is_file()
    env = (prefix / "env.sh").read_text()
    assert f"{prefix}:{prefix}/nvidia_cutlass_dsl/dsl_packages" in env
    assert "VLLM_USE_FLASHINFER_SAMPLER=0" in env
    assert not prefix.with_name("prefix.partial").exists()
    # the versions subprocess really imports from the prefix (our fake packages stand in)
    v = dp.imported_versions(prefix, modules=("tinya", "tinyb", "nosuchmod"))
    assert v["tinya"]["version"] == "1.0" and v["tinya"]["file"].startswith(str(prefix))
    assert v["tinyb"]["version"] == "2.0.1"
    assert "ModuleNotFoundError" in v["nosuchmod"]["error"]
    # idempotent: a second install of the same payload runs no pip
    dp.subprocess.run = lambda *a, **k: (_ for _ in ()).throw(AssertionError("pip ran again"))
    try:
        assert dp.install(s, prefix, log=quiet)["tar_sha256"] == m["tar"]["sha256"]
    finally:
        dp.subprocess.run = orig


def test_corrupt_part_is_rejected_and_not_stored(dp, packed, tmp_path):
    m, out, cache, dl = packed
    store = tmp_path / "store"
    part = carry(out, "part-001", tmp_path / "call")
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(dp.PayloadError, match="part-001 is corrupt") as e:
        dp.receive([part], store, m, log=quiet)
    assert e.value.code == 3
    assert part.exists(), "a rejected part stays where it was carried"
    s = dp.open_store(store, m)
    assert "part-001" in s.missing() and not s.part_path("part-001").exists()
    stray = carry(out, "part-000", tmp_path / "c2").rename(tmp_path / "c2" / "part-999")
    with pytest.raises(dp.PayloadError, match="part-999 is not a part"):
        dp.receive([stray], store, m, log=quiet)


def test_install_refuses_an_incomplete_store(dp, packed, tmp_path):
    m, out, cache, dl = packed
    store = tmp_path / "store"
    for p in m["parts"][:-1]:
        dp.receive([carry(out, p["name"], tmp_path / "c")], store, m, log=quiet)
    s = dp.open_store(store, m)
    with pytest.raises(dp.PayloadError, match=f"missing 1 of {len(m['parts'])} parts \\({m['parts'][-1]['name']}\\)"):
        dp.install(s, tmp_path / "prefix", pip=["false"], log=quiet)
    assert not (tmp_path / "prefix").exists()


def test_install_refuses_a_part_damaged_after_receipt(dp, packed, tmp_path):
    m, out, cache, dl = packed
    store = tmp_path / "store"
    for p in m["parts"]:
        dp.receive([carry(out, p["name"], tmp_path / "c")], store, m, log=quiet)
    s = dp.open_store(store, m)
    victim = s.part_path("part-002")
    data = bytearray(victim.read_bytes())
    data[5] ^= 1
    victim.write_bytes(bytes(data))  # same size: only the hash can tell
    with pytest.raises(dp.PayloadError, match=r"bad parts: \['part-002'\]"):
        dp.install(s, tmp_path / "prefix", pip=["false"], log=quiet)
    assert s.missing() == ["part-002"], "the damaged part is asked for again"


def test_cli_receive_reports_missing_and_install_exit_code(dp, packed, tmp_path, capsys):
    m, out, cache, dl = packed
    store = tmp_path / "store"
    call = tmp_path / "call"
    part = carry(out, "part-000", call)
    carry(out, "manifest.json", call)
    assert dp.main(["receive", str(part), "--store", str(store)]) == 0
    lines = capsys.readouterr().out.splitlines()
    st = json.loads([x for x in lines if x.startswith(dp.STATUS_PREFIX)][0][len(dp.STATUS_PREFIX):])
    assert st["have"] == 1 and st["missing"][0] == "part-001"
    # next call carries no manifest: the store's is used
    part = carry(out, "part-001", tmp_path / "call2")
    assert dp.main(["receive", str(part), "--store", str(store)]) == 0
    assert dp.main(["install", "--store", str(store), "--prefix", str(tmp_path / "p")]) == 3
    assert "incomplete" in capsys.readouterr().err
    assert dp.main(["status", "--store", str(store), "--prefix", str(tmp_path / "p")]) == 0
    assert f"2/{len(m['parts'])} parts" in capsys.readouterr().out


def _report(*wheels: tuple[str, str, str]) -> dict:
    """A `pip install --dry-run --report` document: (metadata name, version, wheel filename)."""
    return {"version": "1", "install": [
        {"metadata": {"name": n, "version": v},
         "download_info": {"url": f"https://files.example/packages/ab/cd/{fn}#sha256=00",
                           "archive_info": {"hashes": {"sha256": "00"}}}} for n, v, fn in wheels]}


class FakePip:
    """Stands in for subprocess.run: answers the interpreter probe and writes a resolver report."""

    def __init__(self, report: dict | None, version: str = "3.12", rc: int = 0, stderr: str = ""):
        self.report, self.version, self.rc, self.stderr = report, version, rc, stderr
        self.argv = []

    def __call__(self, argv, **kw):
        self.argv.append(argv)
        R = type("R", (), {})
        r = R()
        if argv[1] == "-c":  # python_version_of
            r.returncode, r.stdout, r.stderr = 0, self.version + "\n", ""
            return r
        if "--report" not in argv:  # pip --version
            r.returncode, r.stdout, r.stderr = 0, "pip 23.2.1 from /x (python 3.12)\n", ""
            return r
        if self.report is not None and self.rc == 0:
            Path(argv[argv.index("--report") + 1]).write_text(json.dumps(self.report))
        r.returncode, r.stdout, r.stderr = self.rc, "", self.stderr
        return r


REPORT_029 = _report(
    ("vllm", "0.29.0", "vllm-0.29.0-cp38-abi3-manylinux_2_28_x86_64.whl"),
    ("torch", "2.13.0", "torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl"),
    ("Jinja2", "3.1.6", "jinja2-3.1.6-py3-none-any.whl"),
    ("nvidia-nccl-cu13", "2.29.7", "nvidia_nccl_cu13-2.29.7-py3-none-manylinux_2_18_x86_64.whl"),
    ("nvidia-cudnn-cu13", "9.20.0.48", "nvidia_cudnn_cu13-9.20.0.48-py3-none-manylinux_2_27_x86_64.whl"),
)


def test_release_without_a_list_is_resolved_by_pip_minus_the_image(dp, tmp_path):
    """The resolver runs as a dry run with a report (nothing installed), for the device's Python
    and every manylinux_2_N tag; the image's exact name==version pairs stay home, other versions of
    the same package (the image's cudnn, torch) travel."""
    pip = FakePip(REPORT_029)
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("# header\njinja2==3.1.6\ntorch==2.11.0\nnvidia-cudnn-cu13==9.24.0.43\n"
                      "nvidia_nccl_cu13==2.29.7  # same version, other spelling\nlocalpkg @ file:///x\n")
    names = dp.resolve_release("0.29.0", dp.read_freeze(freeze), "py312", run=pip)
    argv = pip.argv[-1]
    assert argv[:5] == ["py312", "-m", "pip", "install", "--dry-run"] and argv[-1] == "vllm==0.29.0"
    assert "--report" in argv and "--target" in argv and "--only-binary=:all:" in argv
    assert argv[argv.index("--python-version") + 1] == "3.12"
    plats = [argv[i + 1] for i, x in enumerate(argv) if x == "--platform"]
    assert "manylinux_2_18_x86_64" in plats and "manylinux_2_31_x86_64" in plats and "manylinux2014_x86_64" in plats
    assert names == ["nvidia_cudnn_cu13-9.20.0.48-py3-none-manylinux_2_27_x86_64.whl",
                     "torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl",
                     "vllm-0.29.0-cp38-abi3-manylinux_2_28_x86_64.whl"]


def test_resolver_failure_and_non_wheels_are_named(dp):
    with pytest.raises(dp.PayloadError, match="could not resolve vllm==0.29.0.*No matching distribution") as e:
        dp.resolve("vllm==0.29.0", "py312", run=FakePip(None, rc=1, stderr="ERROR: No matching distribution"))
    assert e.value.code == 4
    sdist = _report(("oldpkg", "1.0", "oldpkg-1.0.tar.gz"))
    with pytest.raises(dp.PayloadError, match="oldpkg 1.0 to 'oldpkg-1.0.tar.gz', not a wheel"):
        dp.resolve("vllm==0.29.0", "py312", run=FakePip(sdist))


def test_resolver_needs_the_devices_python(dp):
    """pip evaluates markers under the interpreter it runs in: a 3.11 pip drops vLLM's
    `six; python_version > "3.11"`. An explicit --python of another version is refused by name."""
    with pytest.raises(dp.PayloadError, match="--python /usr/bin/python3.11 is Python 3.11.*needs CPython 3.12"):
        dp.device_python("/usr/bin/python3.11", run=FakePip(None, version="3.11"))
    assert dp.device_python("/opt/py312", run=FakePip(None, version="3.12")) == "/opt/py312"
    with pytest.raises(dp.PayloadError, match="no CPython 3.12 found"):
        dp.device_python(None, run=FakePip(None, version="3.11"))


def test_read_freeze_refuses_a_missing_or_empty_file(dp, tmp_path):
    with pytest.raises(dp.PayloadError, match="image freeze .*nope.txt not found"):
        dp.read_freeze(tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_text("# only a comment\n")
    with pytest.raises(dp.PayloadError, match="names no name==version"):
        dp.read_freeze(tmp_path / "empty.txt")


def test_approx_freeze_is_the_resolution_minus_what_the_device_lacked(dp):
    resolved = dp.resolve("vllm==0.29.0", "py312", run=FakePip(REPORT_029))
    lacking = ["vllm-0.29.0-cp38-abi3-manylinux_2_28_x86_64.whl", "torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl"]
    assert dp.approx_freeze(resolved, lacking) == ["jinja2==3.1.6", "nvidia-cudnn-cu13==9.20.0.48",
                                                   "nvidia-nccl-cu13==2.29.7"]
    # a lacking wheel the resolution did not pick: the two describe different days or releases
    with pytest.raises(dp.PayloadError, match=r"torch==2.14.0 \(resolved: 2.13.0\)"):
        dp.approx_freeze(resolved, ["torch-2.14.0-cp312-cp312-manylinux_2_28_x86_64.whl"])


def test_image_freeze_cli_writes_a_header_and_the_pairs(dp, tmp_path, monkeypatch):
    pip = FakePip(REPORT_029)
    monkeypatch.setattr(dp.subprocess, "run", pip)
    lst = tmp_path / "lack.txt"
    lst.write_text("vllm-0.29.0-cp38-abi3-manylinux_2_28_x86_64.whl\n")
    extra = tmp_path / "extra.txt"
    extra.write_text("torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl\n")
    out = tmp_path / "freeze.txt"
    assert dp.main(["image-freeze", "--release", "0.29.0", "--list", str(lst), "--extra-list", str(extra),
                    "--python", "py312", "--note", "checked: nothing", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# APPROXIMATE device image freeze")
    assert "5 packages" in text and "minus the 2 wheels" in text and "# checked: nothing\n" in text
    assert [x for x in text.splitlines() if not x.startswith("#")] == [
        "jinja2==3.1.6", "nvidia-cudnn-cu13==9.20.0.48", "nvidia-nccl-cu13==2.29.7"]
    assert dp.read_freeze(out) == {"jinja2": "3.1.6", "nvidia-cudnn-cu13": "9.20.0.48", "nvidia-nccl-cu13": "2.29.7"}


def test_pack_without_a_list_resolves_minus_the_freeze_and_fetches_only_what_travels(dp, tmp_path, monkeypatch, capsys):
    pip = FakePip(REPORT_029)
    monkeypatch.setattr(dp.subprocess, "run", pip)
    monkeypatch.setattr(dp, "default_list", lambda release: None)
    monkeypatch.setattr(dp, "VLLM_WHEEL_DIRS", ())
    fetched = []

    def fake_download(fn, dest):
        fetched.append(fn)
        return make_wheel(dest / fn, seed=len(fetched), size=100)

    monkeypatch.setattr(dp, "pip_downloader", fake_download)
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("jinja2==3.1.6\nnvidia-nccl-cu13==2.29.7\n")
    extra = tmp_path / "extra.txt"
    extra.write_text("pycountry-26.2.16-py3-none-any.whl\n")
    out = tmp_path / "payload"
    assert dp.main(["pack", "--release", "0.29.0", "--image-freeze", str(freeze), "--extra-list", str(extra),
                    "--python", "py312", "--cache", str(tmp_path / "cache"), "--out", str(out)]) == 0
    assert sorted(fetched) == ["nvidia_cudnn_cu13-9.20.0.48-py3-none-manylinux_2_27_x86_64.whl",
                               "pycountry-26.2.16-py3-none-any.whl",
                               "torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl",
                               "vllm-0.29.0-cp38-abi3-manylinux_2_28_x86_64.whl"]
    m = dp.load_manifest(out / "manifest.json")
    assert m["release"] == "0.29.0" and [w["name"] for w in m["wheels"]] == sorted(fetched)
    assert m["source"] == "pip resolver minus freeze.txt + extra.txt"
    assert "packed 4 wheels" in capsys.readouterr().out


def test_the_shipped_approximate_freeze_and_029_extra_list_parse(dp):
    """The files in lab/payload/ that `pack --release 0.29.0` reads by default."""
    freeze = dp.PAYLOAD_DIR / dp.APPROX_FREEZE
    text = freeze.read_text()
    assert "APPROXIMATE" in text and "pip list --format=freeze" in text
    pairs = dp.read_freeze(freeze)
    assert "torch" not in pairs and "vllm" not in pairs and "pycountry" not in pairs  # all three travelled
    assert pairs["six"] and pairs["setuptools"].split(".")[0] == "80"  # markers evaluated for 3.12
    assert dp.read_list(dp.PAYLOAD_DIR / "vllm-0.29.0-extra.txt") == ["pycountry-26.2.16-py3-none-any.whl"]


def _fake_vllm_prefix(root: Path, reasoning_body: str) -> Path:
    (root / "vllm" / "reasoning").mkdir(parents=True)
    (root / "vllm" / "tool_parsers").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    (root / "vllm" / "reasoning" / "__init__.py").write_text(
        "class ReasoningParserManager:\n    @classmethod\n    def get_reasoning_parser(cls, name):\n"
        f"        assert name == 'qwen3'\n        {reasoning_body}\n")
    (root / "vllm" / "tool_parsers" / "__init__.py").write_text(
        "class ToolParserManager:\n    @classmethod\n    def get_tool_parser(cls, name):\n"
        "        assert name in ('qwen3_coder', 'qwen3_xml'), name\n        return object\n")
    return root


def test_install_names_a_parser_that_cannot_load(dp, tmp_path):
    """The recipe's lazily loaded parsers are imported at install time: a wheel missing from the
    payload (pycountry, twice on the H200) is named there, not at the first boot."""
    bad = _fake_vllm_prefix(tmp_path / "bad", "import pycountry_not_carried")
    problem = dp.parsers_problem(bad)
    assert problem and "ModuleNotFoundError" in problem and "pycountry_not_carried" in problem
    good = _fake_vllm_prefix(tmp_path / "good", "return object")
    assert dp.parsers_problem(good) is None


def test_install_checks_every_tool_parser_a_profile_names(dp):
    """A profile's TOOL_PARSER that install never loads would first fail at a boot on the device."""
    from flash_cli import profiles
    from flash_cli.settings import BY_NAME

    default = BY_NAME["TOOL_PARSER"].default
    named = {profiles.load(n).values.get("TOOL_PARSER", default) for n in profiles.names()}
    assert "qwen3_xml" in named and "qwen3_coder" in named  # nvidia's and everyone else's
    assert named <= set(dp.TOOL_PARSERS)


def test_the_measured_device_freeze_is_the_default_and_agrees_with_what_booted(dp):
    """lab/payload/device-image-freeze.txt is the device's real `pip list` (session of 25174b3): pack
    prefers it to the approximation, and it agrees with what the 0.33.0 boots showed: the image's
    own torch 2.11 and transformers 5.17, no vllm, no pycountry (both travelled)."""
    assert dp.default_freeze() == dp.PAYLOAD_DIR / dp.REAL_FREEZE
    pairs = dp.read_freeze(dp.PAYLOAD_DIR / dp.REAL_FREEZE)
    assert pairs["torch"] == "2.11.0" and pairs["transformers"] == "5.17.0"
    assert "vllm" not in pairs and "pycountry" not in pairs and len(pairs) > 150


def test_kept_lists_are_the_default(dp):
    """A fresh checkout re-packs the exact wheel set a passing device run installed (run42 for
    0.29.0), not today's resolution."""
    kept = dp.default_list("0.29.0")
    assert kept == ROOT / "lab" / "payload" / "vllm-0.29.0-wheels.txt"
    names = dp.read_list(kept)
    assert len(names) == 159 and any(n.startswith("vllm-0.29.0-") for n in names)
    assert any(n.startswith("torch-2.13.0") for n in names) and any(n.startswith("pycountry-") for n in names)
    assert dp.read_list(dp.default_list("0.33.0"))  # the 0.33.0 set the device sessions carry
    assert dp.default_list("0.31.0") is None  # none kept: pack resolves


def test_carry_part_size_fits_one_call_beside_the_tree(dp):
    MIB = dp.MIB
    # e3ac91a's tree (7.74 MiB): 56 MiB parts were refused by the device tool; 53 fit
    assert dp.carry_part_size(8_112_640) == 53 * MIB
    for tree in (0, 1, 3 * MIB, 20 * MIB + 5):
        size = dp.carry_part_size(tree)
        assert size % MIB == 0 and size + tree + dp.CARRY_HEADROOM <= dp.CALL_LIMIT < size + MIB + tree + dp.CARRY_HEADROOM
    assert dp.carry_part_size(None) == 48 * MIB
    with pytest.raises(dp.PayloadError, match=r"working tree is 50\.0 MiB.*--part-size-mib"):
        dp.carry_part_size(50 * MIB)


def test_tree_bytes_counts_what_a_device_call_copies(dp, tmp_path):
    import subprocess
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text(".payload/\n")  # 10 bytes
    (repo / "tracked.txt").write_bytes(b"x" * 1000)
    (repo / "untracked.txt").write_bytes(b"y" * 300)
    (repo / ".payload").mkdir()
    (repo / ".payload" / "part-000").write_bytes(b"z" * 50_000)  # ignored: carried by name, not counted
    subprocess.run(["git", "-C", str(repo), "add", "tracked.txt", ".gitignore"], check=True)
    assert dp.tree_bytes(repo) == 1310
    (repo / "tracked.txt").unlink()  # deleted but still in the index: not copied, not counted
    assert dp.tree_bytes(repo) == 310
    assert dp.tree_bytes(tmp_path / "not-a-repo") is None


def test_cli_pack_sizes_parts_from_the_tree(dp, packed, tmp_path, monkeypatch, capsys):
    m, out, cache, dl = packed
    lst = tmp_path / "list.txt"
    lst.write_text("\n".join(WHEELS) + "\n")
    monkeypatch.setattr(dp, "tree_bytes", lambda: 40 * dp.MIB + 123)
    extra = tmp_path / "extra.txt"  # a wheel the list holds: the real extra list would download
    extra.write_text(WHEELS[0] + "\n")
    args = ["pack", "--release", "0.33.0", "--list", str(lst), "--cache", str(cache), "--extra-list", str(extra)]
    assert dp.main(args + ["--out", str(tmp_path / "auto")]) == 0
    assert "part size 20 MiB: 64 MiB a call - the 40.0 MiB tree - 3 MiB headroom" in capsys.readouterr().out
    assert dp.load_manifest(tmp_path / "auto" / "manifest.json")["part_size"] == 20 * dp.MIB
    monkeypatch.setattr(dp, "tree_bytes", lambda: 50 * dp.MIB)
    fetch, fetched = dp.fetch_wheels, []
    monkeypatch.setattr(dp, "fetch_wheels", lambda *a, **k: fetched.append(a) or fetch(*a, **k))
    assert dp.main(args + ["--out", str(tmp_path / "big")]) == 2
    assert "working tree is 50.0 MiB" in capsys.readouterr().err
    assert fetched == [], "a tree that cannot be carried fails before any download"
    assert not (tmp_path / "big").exists(), "nothing is packed when the parts cannot fit a call"
    assert dp.main(args + ["--out", str(tmp_path / "given"), "--part-size-mib", "0.004"]) == 0
    assert dp.load_manifest(tmp_path / "given" / "manifest.json")["part_size"] == int(0.004 * dp.MIB)
    assert dp.main(args + ["--out", str(tmp_path / "neg"), "--part-size-mib", "-1"]) == 2
    assert "--part-size-mib -1: give a positive size" in capsys.readouterr().err
