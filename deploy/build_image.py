"""Build flexhub's DaemonSet image as an OCI image layout, without a container engine.

    python3 deploy/build_image.py OUT_DIR [--runtime DIR] [--tag TAG]

The image holds only the relocatable runtime (``deploy/build_runtime.py``; built here unless
``--runtime`` names one) at ``/opt/flexhub/runtime``: no shell, no distribution. Its
entrypoint is ``flexhub daemonset --host-root /host``, started through the runtime's own
loader. The layer is written deterministically (sorted entries, owner root, mtime 0), so
the same runtime gives the same digest. Push it with ``skopeo copy oci:OUT_DIR:TAG
docker://REGISTRY/flexhub:TAG``; check it with ``umoci unpack --image OUT_DIR:TAG BUNDLE``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import sys
import tarfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import build_runtime

IMAGE_RUNTIME = "/opt/flexhub/runtime"
ENTRYPOINT = [
    f"{IMAGE_RUNTIME}/lib/{build_runtime.LOADER}",
    "--library-path",
    f"{IMAGE_RUNTIME}/lib",
    f"{IMAGE_RUNTIME}/bin/{build_runtime.PYVER}",
    "-I",
    "-m",
    "flexhub",
]
MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _layer(runtime: Path) -> bytes:
    """The runtime as an uncompressed tar under ``/opt/flexhub/runtime``."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for directory in ("opt", "opt/flexhub", "tmp"):
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if directory == "tmp" else 0o755
            tar.addfile(info)
        base = IMAGE_RUNTIME.lstrip("/")
        for path in [runtime, *sorted(runtime.rglob("*"))]:
            name = base if path == runtime else f"{base}/{path.relative_to(runtime)}"
            info = tar.gettarinfo(str(path), arcname=name)
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mtime = 0
            if info.isfile():
                with open(path, "rb") as handle:
                    tar.addfile(info, handle)
            else:
                tar.addfile(info)
    return buffer.getvalue()


def _blob(layout: Path, data: bytes) -> dict[str, object]:
    digest = hashlib.sha256(data).hexdigest()
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    (blobs / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def build_image(layout: Path, runtime: Path, tag: str) -> dict[str, object]:
    """Write (or add ``tag`` to) the OCI layout at ``layout``; return the manifest descriptor."""
    marker = json.loads((runtime / build_runtime.MARKER).read_text())
    raw = _layer(runtime)
    compressed = gzip.compress(raw, compresslevel=6, mtime=0)
    layer = _blob(layout, compressed)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": [*ENTRYPOINT, "daemonset", "--host-root", "/host"],
            "Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"],
            "WorkingDir": "/",
            "Labels": {
                "org.opencontainers.image.title": "flexhub",
                "org.opencontainers.image.version": marker["version"],
                "io.flexhub.runtime": marker["name"],
            },
        },
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(raw).hexdigest()}"]},
        "history": [{"created_by": "deploy/build_image.py", "comment": marker["name"]}],
    }
    config_blob = _blob(layout, json.dumps(config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config_blob},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **layer}],
    }
    descriptor = {
        "mediaType": MANIFEST,
        **_blob(layout, json.dumps(manifest, sort_keys=True).encode()),
        "annotations": {"org.opencontainers.image.ref.name": tag},
    }
    (layout / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    index_path = layout / "index.json"
    index: dict[str, Any] = (
        json.loads(index_path.read_text()) if index_path.exists() else {"schemaVersion": 2}
    )
    others = [
        m
        for m in index.get("manifests", [])
        if m.get("annotations", {}).get("org.opencontainers.image.ref.name") != tag
    ]
    index["manifests"] = [*others, descriptor]
    tmp = layout / f".index.json.{os.getpid()}"
    tmp.write_text(json.dumps(index, sort_keys=True))
    tmp.replace(index_path)
    return descriptor


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layout", type=Path)
    parser.add_argument("--runtime", type=Path, help="an already built runtime directory")
    parser.add_argument("--tag", default="", help="image tag (default: the flexhub version)")
    args = parser.parse_args()
    runtime = args.runtime or build_runtime.build(args.layout.parent / "runtimes")
    tag = args.tag or json.loads((runtime / build_runtime.MARKER).read_text())["version"]
    descriptor = build_image(args.layout, runtime, tag)
    print(f"{args.layout}:{tag} {descriptor['digest']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
