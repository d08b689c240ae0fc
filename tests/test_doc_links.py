"""Every relative link of the repository's markdown files (README, docs/, benchmarks/, studies/) names a file
or folder that exists. Cheap: reads the .md files, no model."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".pytest_cache", ".hypothesis", "artifacts"}
# [text](target) and ![alt](target); the target ends at whitespace (a title may follow) or ")"
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
# pages other branches add; a link to one is checked once the page exists
# `rotkv eval` writes README_section.md as a snippet for the top-level README: its links are relative to
# the repository root and name the run's default files, so it is not a page of its own
SNIPPET = "README_section.md"


def markdown_files():
    for base, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for f in files:
            if f.endswith(".md") and f != SNIPPET:
                yield os.path.join(base, f)


def relative_links(text: str):
    for m in LINK.finditer(CODE.sub("", text)):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # a URL (http:, mailto:, ...) or an anchor in the same page
        yield target.split("#")[0].split("?")[0]


def broken_links():
    out = []
    for md in markdown_files():
        with open(md, encoding="utf-8") as f:
            text = f.read()
        for target in relative_links(text):
            path = os.path.normpath(os.path.join(os.path.dirname(md), target))
            if not os.path.exists(path):
                out.append(f"{os.path.relpath(md, ROOT)} -> {target}")
    return out


def test_relative_links_resolve():
    broken = broken_links()
    assert not broken, f"{len(broken)} broken relative link(s):\n" + "\n".join(broken)


def test_the_link_pattern_finds_links_and_skips_urls_and_code():
    text = ("[a](docs/x.md) ![p](img.png \"t\") [u](https://e.org/x) [s](#part) `[c](not/a/link.md)`\n"
            "```\n[d](nor/this.md)\n```\n[e](docs/y.md#anchor)")
    assert list(relative_links(text)) == ["docs/x.md", "img.png", "docs/y.md"]
