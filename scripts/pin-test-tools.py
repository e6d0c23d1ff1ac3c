#!/usr/bin/env python3
"""Writes scripts/test-tools.txt: the test tools' Python packages (scripts/test-tools.in and
everything they depend on) pinned to exact versions, each with the sha256 of every wheel
PyPI has for that version that Linux on x86_64 or aarch64 may install, so that `pip install --require-hashes` (scripts/setup.sh)
installs exactly these bytes or nothing.

The dependencies are resolved once per supported Python version (wheels only, Linux
x86_64), since some exist only for some versions; a package whose version differs by
Python, or that only some versions need, gets a `python_version` marker. Run it again to
move the pins (it needs PyPI):

    python3 scripts/pin-test-tools.py
"""

import html.parser
import os
import re
import subprocess
import sys
import tempfile
import urllib.request

PYTHONS = ["3.9", "3.10", "3.11", "3.12", "3.13", "3.14"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64"]
HERE = os.path.dirname(os.path.abspath(__file__))
INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")


def normalize(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def resolve(python, requirements, into):
    """{normalized name: version} pip picks for `python`."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--only-binary=:all:",
         "--python-version", python, "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)],
         "-d", into, "-r", requirements],
        check=True,
    )
    found = {}
    for f in os.listdir(into):
        name, version = f.split("-")[:2]
        found[normalize(name)] = version
    return found


class Links(html.parser.HTMLParser):
    """The files of a PEP 503 project page: (file name, sha256)."""

    def __init__(self):
        super().__init__()
        self.files = []

    def handle_starttag(self, tag, attrs):
        href = dict(attrs).get("href") or ""
        if tag == "a" and "#sha256=" in href:
            url, digest = href.split("#sha256=")
            self.files.append((url.rsplit("/", 1)[-1], digest))


def file_version(name, filename):
    """The version in a wheel's or sdist's file name, when it is `name`'s."""
    if filename.endswith(".whl"):
        project, version = filename.split("-")[:2]
    else:
        stem = re.sub(r"\.(tar\.gz|zip|tar\.bz2)$", "", filename)
        if "-" not in stem:
            return None
        project, version = stem.rsplit("-", 1)
    return version if normalize(project) == name else None


def installable(filename):
    """A wheel setup.sh may install: pure Python, or built for Linux on x86_64 or aarch64
    (`--only-binary`, so never an sdist, whose build would fetch unpinned tools)."""
    return filename.endswith(".whl") and (filename.endswith("-none-any.whl") or ("linux" in filename and ("x86_64" in filename or "aarch64" in filename)))


def hashes(name, version):
    with urllib.request.urlopen(f"{INDEX}/{name}/") as r:
        page = Links()
        page.feed(r.read().decode())
    found = sorted({d for f, d in page.files if file_version(name, f) == version and installable(f)})
    if not found:
        sys.exit(f"pin-test-tools: no files with sha256 for {name}=={version} at {INDEX}/{name}/")
    return found


def marker(pythons):
    if pythons == PYTHONS:
        return ""
    return " ; " + " or ".join(f'python_version == "{p}"' for p in pythons)


def main():
    requirements = os.path.join(HERE, "test-tools.in")
    by_name = {}
    with tempfile.TemporaryDirectory() as tmp:
        for python in PYTHONS:
            for name, version in resolve(python, requirements, os.path.join(tmp, python)).items():
                by_name.setdefault(name, {}).setdefault(version, []).append(python)
    lines = [
        "# Written by scripts/pin-test-tools.py from scripts/test-tools.in; do not edit by hand.",
        "# Resolved on Linux x86_64 for the CPython versions below; every Linux x86_64 / aarch64 and",
        "# pure-Python wheel of each version is hashed. scripts/setup.sh reads the next line.",
        f"# pythons: {' '.join(PYTHONS)}",
    ]
    for name in sorted(by_name):
        for version, pythons in sorted(by_name[name].items()):
            lines.append(f"{name}=={version}{marker(pythons)} \\")
            digests = hashes(name, version)
            lines += [f"    --hash=sha256:{d}" + (" \\" if i + 1 < len(digests) else "") for i, d in enumerate(digests)]
    with open(os.path.join(HERE, "test-tools.txt"), "w") as out:
        out.write("\n".join(lines) + "\n")
    print(f"pin-test-tools: {sum(len(v) for v in by_name.values())} pins written to scripts/test-tools.txt")


if __name__ == "__main__":
    main()
