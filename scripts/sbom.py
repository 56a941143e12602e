#!/usr/bin/env python3
"""Writes a CycloneDX 1.5 JSON SBOM of the crates built into the targetlease binary.

    python3 scripts/sbom.py --target TRIPLE --out FILE [--commit ID] [--epoch SECONDS]

The crates are exactly what `cargo tree -e normal --target TRIPLE` shows under the targetlease
package: its normal dependencies for that platform, with the features a build of the package
alone resolves (no dev-dependency, no build-dependency, nothing another workspace member
enables). Each has its name, version, purl (pkg:cargo/NAME@VERSION), its license expression
when its manifest has one, and for a crate from crates.io the SHA-256 checksum Cargo.lock
records (the hash of the .crate file). The edges are the dependency tree's. Nothing depends on
the clock: the timestamp is --epoch (SOURCE_DATE_EPOCH or the commit's date) and the serial
number is derived from the name, version and commit, so one commit gives one SBOM.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tomllib
import uuid
from datetime import datetime, timezone

ROOT = "targetlease"
LINE = re.compile(r"^(\d+)(\S+) v(\S+)(?: \(([^)]*)\))?(?: \(\*\))?$")


def cargo(repo, *args):
    out = subprocess.run(
        ["cargo", *args], cwd=repo, check=False, capture_output=True, text=True
    )
    if out.returncode != 0:
        sys.exit(f"sbom.py: cargo {' '.join(args)} failed:\n{out.stderr}")
    return out.stdout


def tree(repo, target):
    """(crates, edges): the (name, version) pairs of the tree and who depends on whom."""
    text = cargo(
        repo, "tree", "--locked", "-p", ROOT, "-e", "normal,no-proc-macro", "--target", target,
        "--prefix", "depth", "-f", "{p}",
    )
    crates, edges, stack = set(), {}, []
    for line in text.splitlines():
        if not line.strip():
            continue
        m = LINE.match(line.strip())
        if not m:
            sys.exit(f"sbom.py: cannot read the cargo tree line {line!r}")
        depth, crate = int(m.group(1)), (m.group(2), m.group(3))
        del stack[depth:]
        if stack:
            edges.setdefault(stack[-1], set()).add(crate)
        stack.append(crate)
        crates.add(crate)
    return crates, edges


def purl(name, version):
    return f"pkg:cargo/{name}@{version}"


def license_of(expression):
    # Old manifests write "MIT/Apache-2.0" for "MIT OR Apache-2.0".
    return [{"expression": " OR ".join(p.strip() for p in expression.split("/"))}]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="the platform triple the binary is built for")
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--commit", default="unknown", help="the commit the binary is built from")
    p.add_argument("--epoch", type=int, default=0, help="the SBOM's timestamp, seconds since 1970")
    a = p.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    crates, edges = tree(repo, a.target)
    meta = json.loads(cargo(
        repo, "metadata", "--locked", "--format-version", "1", "--filter-platform", a.target,
    ))
    packages = {(pkg["name"], pkg["version"]): pkg for pkg in meta["packages"]}
    with open(os.path.join(repo, "Cargo.lock"), "rb") as f:
        lock = tomllib.load(f)
    checksums = {
        (pkg["name"], pkg["version"]): pkg["checksum"]
        for pkg in lock.get("package", [])
        if "checksum" in pkg
    }

    def component(crate, kind):
        name, version = crate
        pkg = packages.get(crate)
        if pkg is None:
            sys.exit(f"sbom.py: cargo metadata does not know {name} {version}")
        c = {"type": kind, "bom-ref": purl(name, version), "name": name,
             "version": version, "purl": purl(name, version)}
        if pkg.get("description"):
            c["description"] = " ".join(pkg["description"].split())
        if pkg.get("license"):
            c["licenses"] = license_of(pkg["license"])
        if crate in checksums:
            c["hashes"] = [{"alg": "SHA-256", "content": checksums[crate]}]
        return c

    roots = [c for c in crates if c[0] == ROOT]
    if len(roots) != 1:
        sys.exit(f"sbom.py: the tree has {len(roots)} {ROOT} packages")
    root = roots[0]
    others = sorted(crates - {root})
    bom = {
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "serialNumber": "urn:uuid:" + str(uuid.uuid5(
            uuid.NAMESPACE_URL, f"{purl(*root)}?commit={a.commit}&target={a.target}")),
        "version": 1,
        "metadata": {
            "timestamp": datetime.fromtimestamp(a.epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "tools": {"components": [{"type": "application", "name": "scripts/sbom.py"}]},
            "component": component(root, "application"),
            "properties": [
                {"name": "cargo:target", "value": a.target},
                {"name": "git:commit", "value": a.commit},
            ],
        },
        "components": [component(c, "library") for c in others],
        "dependencies": [
            {"ref": purl(*c), "dependsOn": sorted(purl(*d) for d in edges.get(c, ()))}
            for c in [root, *others]
        ],
    }
    with open(a.out, "w") as f:
        json.dump(bom, f, indent=2, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
