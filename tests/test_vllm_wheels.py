"""scripts/vllm_wheels.sh and scripts/vllm_device_install.sh on fake wheels: download check, slim, split,
batches under the cap, reassembly in any batch order, sha256 checks against SET and the lock, the install
and the import check. No network: OFFLINE=1 and pip --no-index."""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "scripts" / "vllm_wheels.sh"
INSTALL = ROOT / "scripts" / "vllm_device_install.sh"
VLLM_FILE = "vllm-0.0.1-py3-none-any.whl"
DEP_FILE = "tinydep-1.0-py3-none-any.whl"
FA2 = "_vllm_fa2_C.abi3.so"  # the library FA2=1 sends compressed (SLIM drops it from the wheel)
FA2_BYTES = b"\x7fELF fake flash-attention 2 library " * 400  # compressible, as the real one is

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("split") is None,
                                reason="needs bash and coreutils")


def _wheel(path: Path, name: str, version: str, files: dict[str, bytes]) -> None:
    info = f"{name}-{version}.dist-info"
    files = dict(files)
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{info}/RECORD"] = "".join(f"{k},,\n" for k in files).encode() + f"{info}/RECORD,,\n".encode()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for k, v in files.items():
            z.writestr(zipfile.ZipInfo(k, date_time=(2020, 1, 1, 0, 0, 0)), v)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _lock(path: Path, dl: Path, slim_sha: str = "0" * 64, slim_size: int = 1, fa2_sha: str | None = None) -> None:
    lines = ["# name version size sha256 file source"]
    for name, ver, f in (("vllm", "0.0.1", VLLM_FILE), ("tinydep", "1.0", DEP_FILE)):
        p = dl / f
        lines.append(f"{name} {ver} {p.stat().st_size} {_sha(p)} {f} pypi")
    lines.append(f"vllm 0.0.1 {slim_size} {slim_sha} {VLLM_FILE} slim")
    lines.append(f"vllm-fa2 0.0.1 {len(FA2_BYTES)} {fa2_sha or hashlib.sha256(FA2_BYTES).hexdigest()} {FA2} fa2")
    path.write_text("\n".join(lines) + "\n")


def _run(script: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], env={**os.environ, **env}, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture()
def fake(tmp_path):
    dl = tmp_path / "dl"
    dl.mkdir()
    rng = random.Random(0)
    noise = bytes(rng.getrandbits(8) for _ in range(12000))  # incompressible: the wheel must be split
    _wheel(dl / VLLM_FILE, "vllm", "0.0.1", {
        "vllm/__init__.py": b"class LLM:\n    pass\n",
        "vllm/blob.bin": noise,
        "vllm/vllm-rs": b"x" * 3000,  # one of SLIM_DROP's members
        f"vllm/vllm_flash_attn/{FA2}": FA2_BYTES,  # another
    })
    _wheel(dl / DEP_FILE, "tinydep", "1.0", {"tinydep/__init__.py": b"VALUE = 7\n"})
    lock = tmp_path / "wheels.lock"
    _lock(lock, dl)
    check = tmp_path / "check.py"
    check.write_text("import tinydep, vllm\nfrom vllm import LLM\nprint('import check ok', tinydep.VALUE)\n")
    env = {"LOCK": str(lock), "DL_DIR": str(dl), "OUT_DIR": str(tmp_path / "out"), "OFFLINE": "1",
           "PIECE_BYTES": "4000", "BATCH_BYTES": "9000", "PYTHON": sys.executable,
           "VLLM_WHL_DIR": str(tmp_path / "w"), "VLLM_SITE": str(tmp_path / "site"),
           "IMPORT_CHECK": f"{sys.executable} {check}"}
    return tmp_path, env


def _prepare(tmp_path: Path, env: dict[str, str], fa2_sha: str | None = None) -> list[Path]:
    """Runs vllm_wheels.sh with SLIM=1: the first run refuses the placeholder slim sha and names the real
    one; the lock then gets it and the second run batches."""
    r = _run(WHEELS, env)
    assert r.returncode != 0 and "slim" in r.stderr, r.stderr
    got = re.search(r"sha256 ([0-9a-f]{64}) is not the lock's", r.stderr).group(1)
    slim = tmp_path / "dl" / "slim" / VLLM_FILE
    assert _sha(slim) == got
    names = zipfile.ZipFile(slim).namelist()
    assert "vllm/vllm-rs" not in names and "vllm/__init__.py" in names and "vllm/blob.bin" in names
    assert f"vllm/vllm_flash_attn/{FA2}" not in names
    _lock(Path(env["LOCK"]), tmp_path / "dl", got, slim.stat().st_size, fa2_sha)
    r = _run(WHEELS, env)
    assert r.returncode == 0, r.stderr
    batches = [ROOT / m for m in re.findall(r"^carry: (\S+)", r.stdout, re.M)]
    assert len(batches) >= 2, r.stdout
    return batches


@pytest.mark.skipif(shutil.which("zip") is None, reason="needs zip for the slim wheel")
def test_split_batch_reassemble_install(fake):
    tmp_path, env = fake
    batches = _prepare(tmp_path, env)
    out = tmp_path / "out"
    assert sorted(batches) == sorted(out.glob("b*"))
    for b in batches:
        payload = [f for f in b.iterdir() if f.name != "SET"]
        assert sum(f.stat().st_size for f in payload) + (b / "SET").stat().st_size <= 9000
        assert (b / "SET").read_text() == (batches[0] / "SET").read_text()
    pieces = sorted(out.glob(f"b*/{VLLM_FILE}.part-*"))
    assert len(pieces) >= 2 and all(p.stat().st_size <= 4000 for p in pieces)
    assert b"".join(p.read_bytes() for p in sorted(pieces, key=lambda p: p.name)) == \
        (tmp_path / "dl" / "slim" / VLLM_FILE).read_bytes()

    order = batches[::-1]  # any order works
    for b in order[:-1]:
        r = _run(INSTALL, env, str(b))
        assert r.returncode == 0 and "still to come" in r.stdout, r.stdout + r.stderr
        assert not (tmp_path / "site").exists()
    r = _run(INSTALL, env, str(order[-1]))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 wheels verified" in r.stdout and "import check ok 7" in r.stdout
    assert (tmp_path / "site" / "vllm" / "__init__.py").exists()
    assert not (tmp_path / "site" / "vllm" / "vllm-rs").exists()
    r = _run(INSTALL, env)  # a later call: installed already, the check runs again
    assert r.returncode == 0 and "already installed" in r.stdout and "import check ok" in r.stdout


@pytest.mark.skipif(shutil.which("zip") is None, reason="needs zip for the slim wheel")
def test_corrupt_piece_and_foreign_wheel_are_refused(fake):
    tmp_path, env = fake
    batches = _prepare(tmp_path, env)
    piece = next((tmp_path / "out").glob(f"b*/{VLLM_FILE}.part-01"))
    data = bytearray(piece.read_bytes())
    data[100] ^= 0xFF
    piece.write_bytes(bytes(data))
    r = _run(INSTALL, env, *map(str, batches))
    assert r.returncode != 0 and f"{VLLM_FILE}: sha256" in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "site").exists()

    # a SET that matches its files but not the committed lock (a wheel nobody locked) is refused too
    lock = Path(env["LOCK"])
    lock.write_text("\n".join(line for line in lock.read_text().splitlines() if DEP_FILE not in line) + "\n")
    data[100] ^= 0xFF
    piece.write_bytes(bytes(data))
    shutil.rmtree(tmp_path / "w")
    r = _run(INSTALL, env, *map(str, batches))
    assert r.returncode != 0 and f"{DEP_FILE}" in r.stderr and "is not in" in r.stderr, r.stdout + r.stderr


@pytest.mark.skipif(any(shutil.which(t) is None for t in ("zip", "unzip", "xz")), reason="needs zip, unzip and xz")
def test_fa2_library_travels_compressed_and_is_checked_after(fake):
    """FA2=1: the FlashAttention-2 library the slim wheel drops goes as FILE.xz in the batches; the install puts
    it into vllm/vllm_flash_attn/ byte for byte, and refuses it where its content is not the lock's."""
    tmp_path, env = fake
    env = {**env, "FA2": "1"}
    batches = _prepare(tmp_path, env)
    sets = (batches[0] / "SET").read_text().split()
    assert f"{FA2}.xz" in sets
    xzs = list((tmp_path / "out").glob(f"b*/{FA2}.xz*"))
    assert xzs and sum(p.stat().st_size for p in xzs) < len(FA2_BYTES) // 4  # compressed
    r = _run(INSTALL, env, *map(str, batches))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 wheels verified" in r.stdout and "import check ok 7" in r.stdout
    lib = tmp_path / "site" / "vllm" / "vllm_flash_attn" / FA2
    assert lib.read_bytes() == FA2_BYTES
    assert (tmp_path / "site" / "vllm" / "__init__.py").exists()

    # the same batches against a lock whose library differs: refused after decompression, nothing installed
    lock = Path(env["LOCK"])
    lock.write_text(lock.read_text().replace(hashlib.sha256(FA2_BYTES).hexdigest(), "1" * 64))
    shutil.rmtree(tmp_path / "w")
    shutil.rmtree(tmp_path / "site")
    r = _run(INSTALL, env, *map(str, batches))
    assert r.returncode != 0 and f"{FA2}: sha256 after xz" in r.stderr, r.stdout + r.stderr
    assert not lib.exists()


def test_download_check_refuses_a_changed_wheel(fake):
    tmp_path, env = fake
    with zipfile.ZipFile(tmp_path / "dl" / DEP_FILE, "a") as z:
        z.writestr("tinydep/extra.py", b"")
    r = _run(WHEELS, {**env, "SLIM": "0"})
    assert r.returncode != 0 and "OFFLINE=1" in r.stderr and DEP_FILE in r.stderr, r.stderr


def test_full_wheel_without_slim(fake):
    tmp_path, env = fake
    r = _run(WHEELS, {**env, "SLIM": "0", "BATCH_BYTES": "50000"})
    assert r.returncode == 0, r.stderr
    sets = list((tmp_path / "out").glob("b*/SET"))
    assert len(sets) == 1
    lines = {ln.split()[0]: ln.split() for ln in sets[0].read_text().splitlines()}
    assert lines[VLLM_FILE][1] == _sha(tmp_path / "dl" / VLLM_FILE) and int(lines[VLLM_FILE][3]) >= 4


def test_committed_lock_is_well_formed():
    rows = [ln.split() for ln in (ROOT / "scripts" / "vllm_wheels.lock").read_text().splitlines()
            if ln.strip() and not ln.lstrip().startswith("#")]
    assert all(len(r) == 6 and re.fullmatch(r"[0-9a-f]{64}", r[3]) and r[2].isdigit() for r in rows)
    assert all(r[5] in ("pypi", "slim", "fa2") for r in rows)
    pypi = [r for r in rows if r[5] == "pypi"]
    assert len({r[0] for r in pypi}) == len(pypi)  # one version of each package
    vllm = {r[5]: r for r in rows if r[0] == "vllm"}
    assert vllm["pypi"][1] == "0.26.0" and vllm["slim"][4] == vllm["pypi"][4]
    wheels = [r for r in rows if r[5] != "fa2"]
    assert all(r[4].endswith(".whl") and ("-none-any" in r[4] or "x86_64" in r[4]) for r in wheels)
    (fa2,) = [r for r in rows if r[5] == "fa2"]  # the library TurboQuant needs, as the registry's wheel holds it
    assert fa2[4] == "_vllm_fa2_C.abi3.so" and fa2[1] == vllm["pypi"][1]
