"""Count the SASS instructions of a CUDA kernel's main loop, by opcode class (no GPU needed).

Builds ``rotkv/kernels/cuda/<source>`` with ``nvcc -cubin`` for one architecture and one set of
variant macros, disassembles it with ``cuobjdump -sass`` and reports the instructions between the
target and the source of the longest backward branch (the token loop of the decode kernel), plus
the registers and spills ptxas reports. This is how the instruction counts in docs/kernels.md were
taken::

    python studies/sass_loop.py --source int2_decode.cu -D ROTKV_D=128 -D ROTKV_NG=2 \\
        -D ROTKV_TILES=2 -D ROTKV_MINB=4 --arch 90 [--cuobjdump PATH] [--json out.json]

``cuobjdump`` is looked up on PATH, then beside ``nvcc``, then in triton's bundled binaries.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC_DIR = ROOT / "rotkv" / "kernels" / "cuda"
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")

# opcode prefix -> class reported
CLASSES = {
    "unpack (LOP3/PRMT/SHF)": ("LOP3", "PRMT", "SHF"),
    "fp32 (FMUL/FFMA/FADD/FMNMX)": ("FMUL", "FFMA", "FADD", "FMNMX", "FSEL", "FSETP"),
    "conversions (I2F/F2F/HADD2.F32/F2I/I2FP/F2FP)": ("I2F", "F2F", "HADD2", "F2I", "I2FP", "F2FP"),
    "MUFU": ("MUFU",),
    "int (IMAD/IADD3/ISETP/LEA/SEL/IMNMX)": ("IMAD", "IADD3", "ISETP", "LEA", "SEL", "IMNMX", "VIMNMX", "IABS"),
    "loads (LDG/LDS/LD)": ("LDG", "LDS", "LD.", "LDC"),
    "MMA (HMMA/IMMA)": ("HMMA", "IMMA"),
    "MOVM": ("MOVM",),
    "shuffle/vote (SHFL/VOTE/REDUX)": ("SHFL", "VOTE", "REDUX"),
    "moves (MOV/S2R/CS2R)": ("MOV", "S2R", "CS2R", "S2UR", "R2UR", "UMOV"),
    "branches (BRA/BSSY/BSYNC/WARPSYNC)": ("BRA", "BSSY", "BSYNC", "WARPSYNC", "EXIT"),
}


def _tool(name: str, nvcc: str) -> str:
    cands = [shutil.which(name), str(Path(nvcc).resolve().parent / name)]
    try:
        import triton  # the pip wheel ships cuobjdump
        cands.append(str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name))
    except ImportError:
        pass
    for c in cands:
        if c and os.path.exists(c):
            return c
    raise SystemExit(f"{name} not found: put it on PATH (pip's triton wheel ships one)")


def classify(op: str) -> str:
    for cls, prefixes in CLASSES.items():
        if any(op.startswith(p) for p in prefixes):
            return cls
    return "other"


def loop_body(sass: str) -> list[tuple[int, str]]:
    """(address, opcode) of the instructions of the main loop: the backward branch whose span holds
    the most MMA instructions, the shortest of those (the token loop; a warp-divergence fallback
    path of nvcc's also loops back over part of it), else the longest backward branch."""
    ins = [(int(m.group(1), 16), m.group(3), m.group(4)) for m in LINE.finditer(sass)]
    spans = []
    for addr, op, rest in ins:
        if op.startswith("BRA"):
            tgt = re.search(r"0x([0-9a-f]+)", rest)
            if tgt and int(tgt.group(1), 16) < addr:
                spans.append((int(tgt.group(1), 16), addr))
    if not spans:
        raise SystemExit("no backward branch found")
    n_mma = {s: sum(s[0] <= a <= s[1] and op.startswith(("HMMA", "IMMA")) for a, op, _ in ins) for s in spans}
    best = min(spans, key=lambda s: (-n_mma[s], s[1] - s[0] if n_mma[s] else s[0] - s[1]))
    return [(a, op) for a, op, _ in ins if best[0] <= a <= best[1]]


def count(source: str, macros: list[str], arch: str, cuobjdump: str | None = None,
          fast_math: bool = True) -> dict:
    from rotkv.kernels.nvcc import nvcc_path  # ROTKV_NVCC, PATH, CUDA_HOME, as the loader

    nvcc = nvcc_path()
    if nvcc is None:
        raise SystemExit("nvcc not found (set ROTKV_NVCC or CUDA_HOME)")
    cuobjdump = cuobjdump or _tool("cuobjdump", nvcc)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cmd = [nvcc, "-O3", "-std=c++17", *(["-use_fast_math"] if fast_math else []), "-cubin",
               f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v", "-diag-suppress", "177",
               *(f"-D{m}" for m in macros), "-o", str(cubin), str(SRC_DIR / source)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(res.stderr[-3000:])
        regs = re.findall(r"Used (\d+) registers", res.stderr)
        spills = re.findall(r"(\d+) bytes spill stores", res.stderr)
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    body = loop_body(sass)
    by_op = collections.Counter(op.split(".")[0] for _, op in body)
    by_cls = collections.Counter(classify(op) for _, op in body)
    return {"source": source, "macros": macros, "arch": arch, "loop_instructions": len(body),
            "registers": [int(r) for r in regs], "spill_store_bytes": [int(s) for s in spills],
            "classes": dict(by_cls.most_common()), "opcodes": dict(by_op.most_common())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default="int2_decode.cu")
    ap.add_argument("-D", dest="macros", action="append", default=[], help="NAME=VALUE, repeatable")
    ap.add_argument("--arch", default="90")
    ap.add_argument("--cuobjdump")
    ap.add_argument("--no-fast-math", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    r = count(a.source, a.macros, a.arch, a.cuobjdump, not a.no_fast_math)
    print(f"{a.source} {' '.join(a.macros)} sm_{a.arch}: {r['loop_instructions']} instructions in the main loop, "
          f"registers {r['registers']}, spill stores {r['spill_store_bytes']} bytes")
    for cls, n in r["classes"].items():
        print(f"  {n:5d}  {cls}")
    print("  opcodes:", ", ".join(f"{k} {v}" for k, v in r["opcodes"].items()))
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
