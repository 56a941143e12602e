#!/usr/bin/env python3
"""Writes an OCI image, as an image-layout tarball, from a root file system folder: no daemon.

    python3 scripts/oci_image.py --rootfs DIR --name REF --out TAR \
        [--entrypoint JSON-ARRAY] [--cmd JSON-ARRAY] [--user UID:GID] [--env K=V ...] \
        [--label K=V ...] [--expose PORT/tcp ...] [--workdir DIR] [--dockerfile FILE]

--dockerfile takes the user, entrypoint, command, environment, labels, ports and working folder
from the last stage of a Dockerfile (USER, ENTRYPOINT and CMD in JSON form, ENV, LABEL, EXPOSE,
WORKDIR), so an image built here and one built from that Dockerfile cannot drift apart.

The tarball is what `ctr images import`, `skopeo copy oci-archive:` and `podman load` read. One
layer holds the folder's files; every entry is owned by 0:0 and dated SOURCE_DATE_EPOCH (0 when
unset), entries are sorted and gzip carries no name or time, so the same folder and arguments
always give the same image digest. The digest is printed on stdout.
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import shlex
import stat
import sys
import tarfile
import time

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


def canonical(obj):
    """JSON with sorted keys and no spaces: one byte string per value."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def entry(name, mtime, mode, kind=tarfile.REGTYPE, size=0, link=""):
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.linkname = kind, mode, size, link
    info.mtime, info.uid, info.gid, info.uname, info.gname = mtime, 0, 0, "", ""
    return info


def layer_tar(rootfs, mtime):
    """The uncompressed layer: every file, folder and symbolic link under rootfs, sorted."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        paths = []
        for top, dirs, files in os.walk(rootfs):
            dirs.sort()
            for name in sorted(dirs + files):
                paths.append(os.path.join(top, name))
        for path in sorted(paths, key=lambda p: os.path.relpath(p, rootfs)):
            rel = os.path.relpath(path, rootfs)
            st = os.lstat(path)
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                tar.addfile(entry(rel, mtime, 0o777, tarfile.SYMTYPE, link=os.readlink(path)))
            elif stat.S_ISDIR(st.st_mode):
                tar.addfile(entry(rel, mtime, mode, tarfile.DIRTYPE))
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    tar.addfile(entry(rel, mtime, mode, size=st.st_size), f)
            else:
                sys.exit(f"oci_image.py: {rel}: only files, folders and symbolic links go in an image")
    return out.getvalue()


def gzipped(data):
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=6) as gz:
        gz.write(data)
    return out.getvalue()


def digest(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def pairs(items, what):
    result = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            sys.exit(f"oci_image.py: {what} {item!r} is not KEY=VALUE")
        result[key] = value
    return result


def last_stage(path):
    """The instructions of a Dockerfile's last stage, as (INSTRUCTION, text) pairs."""
    with open(path) as f:
        text = f.read().replace("\\\n", " ")
    stage = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            stage = []
        else:
            stage.append((word.upper(), rest.strip()))
    return stage


def from_dockerfile(path, a):
    """Fills the image configuration in `a` from the Dockerfile's last stage."""
    for word, rest in last_stage(path):
        if word in ("ENTRYPOINT", "CMD"):
            if not rest.startswith("["):
                sys.exit(f"oci_image.py: {path}: {word} must be in JSON form")
            setattr(a, word.lower(), rest)
        elif word == "USER":
            a.user = rest
        elif word == "WORKDIR":
            a.workdir = rest
        elif word == "EXPOSE":
            a.expose += [p if "/" in p else p + "/tcp" for p in rest.split()]
        elif word in ("LABEL", "ENV"):
            items = shlex.split(rest)
            (a.label if word == "LABEL" else a.env).extend(items)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rootfs", required=True, help="folder whose content is the image's file system")
    p.add_argument("--name", required=True, help="full reference, e.g. ghcr.io/org/app:1.0")
    p.add_argument("--out", required=True, help="tarball to write")
    p.add_argument("--entrypoint", default="[]", help="JSON array")
    p.add_argument("--cmd", default="[]", help="JSON array")
    p.add_argument("--user", default="", help="UID:GID the process runs as")
    p.add_argument("--workdir", default="/")
    p.add_argument("--env", action="append", default=[], help="K=V (repeatable)")
    p.add_argument("--label", action="append", default=[], help="K=V (repeatable)")
    p.add_argument("--expose", action="append", default=[], help="PORT/tcp (repeatable)")
    p.add_argument("--dockerfile", help="take the configuration from this Dockerfile's last stage")
    a = p.parse_args()
    if a.dockerfile:
        from_dockerfile(a.dockerfile, a)

    entrypoint, cmd = json.loads(a.entrypoint), json.loads(a.cmd)
    for what, value in (("--entrypoint", entrypoint), ("--cmd", cmd)):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            sys.exit(f"oci_image.py: {what} must be a JSON array of strings")
    if not os.path.isdir(a.rootfs):
        sys.exit(f"oci_image.py: --rootfs {a.rootfs}: not a folder")
    tag = a.name.rsplit("/", 1)[-1].partition(":")[2]
    if not tag:
        sys.exit(f"oci_image.py: --name {a.name!r} needs a tag (name:tag)")

    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
    plain = layer_tar(a.rootfs, epoch)
    layer = gzipped(plain)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": created,
        "config": {
            "User": a.user,
            "Entrypoint": entrypoint,
            "Cmd": cmd,
            "Env": [f"{k}={v}" for k, v in pairs(a.env, "--env").items()],
            "Labels": pairs(a.label, "--label"),
            "ExposedPorts": {port: {} for port in a.expose},
            "WorkingDir": a.workdir,
        },
        "rootfs": {"type": "layers", "diff_ids": [digest(plain)]},
        "history": [{"created": created, "created_by": "scripts/oci_image.py"}],
    }
    config_blob = canonical(config)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": {"mediaType": CONFIG, "digest": digest(config_blob), "size": len(config_blob)},
        "layers": [{"mediaType": LAYER, "digest": digest(layer), "size": len(layer)}],
        "annotations": {"org.opencontainers.image.created": created},
    }
    manifest_blob = canonical(manifest)
    index = {
        "schemaVersion": 2,
        "mediaType": INDEX,
        "manifests": [{
            "mediaType": MANIFEST,
            "digest": digest(manifest_blob),
            "size": len(manifest_blob),
            "platform": {"architecture": "amd64", "os": "linux"},
            # containerd names the image from the first, OCI tools from the second.
            "annotations": {"io.containerd.image.name": a.name, "org.opencontainers.image.ref.name": tag},
        }],
    }

    files = [("oci-layout", canonical({"imageLayoutVersion": "1.0.0"})), ("index.json", canonical(index))]
    for blob in sorted((layer, config_blob, manifest_blob), key=digest):
        files.append(("blobs/sha256/" + digest(blob)[7:], blob))
    tmp = a.out + ".tmp"
    with tarfile.open(tmp, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for folder in ("blobs", "blobs/sha256"):
            tar.addfile(entry(folder, epoch, 0o755, tarfile.DIRTYPE))
        for name, data in files:
            tar.addfile(entry(name, epoch, 0o644, size=len(data)), io.BytesIO(data))
    os.replace(tmp, a.out)
    print(digest(manifest_blob))


if __name__ == "__main__":
    main()
