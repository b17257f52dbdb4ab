"""Publish a flexhub release: the DaemonSet image and the Helm chart, both as OCI artifacts.

    python3 deploy/release.py VERSION --registry HOST[:PORT][/PATH] [--runtime DIR]
                              [--node-runtime DIR]
                              [--out DIR] [--plain-http] [--dry-run]

``VERSION`` must be flexhub's own (``flexhub/__init__.py``, the chart's ``version`` and
``appVersion``): one version names the image tag, the chart and ``flexhub --version``, and a
tag that disagrees is refused before anything is built. Then, in order:

1. the runtimes (``deploy/build_runtime.py``, the full profile and the node profile, unless
   ``--runtime`` and ``--node-runtime`` name built ones) and their images as OCI layouts in
   ``OUT/image`` and ``OUT/image-node`` (``deploy/build_image.py``);
2. ``skopeo copy --preserve-digests`` of them to ``REGISTRY/flexhub:VERSION`` and
   ``REGISTRY/flexhub-node:VERSION``, whose pushed digests must equal the layouts';
3. a copy of the chart whose default images are ``REGISTRY/flexhub`` and, for a DaemonSet
   without the node agent, ``REGISTRY/flexhub-node`` (their tag defaults to the appVersion,
   ``VERSION``), ``helm package``\\ d to ``OUT/flexhub-VERSION.tgz`` and
   ``helm push``\\ ed to ``oci://REGISTRY/charts``, so that

       helm install flexhub oci://REGISTRY/charts/flexhub --version VERSION

   installs the image that was pushed. The registry is named once, on the command line (the
   release workflow takes it from the repository variable ``FLEXHUB_REGISTRY``).

Credentials are never arguments: log in first (``skopeo login`` and ``helm registry login``,
password on standard input), as ``.github/workflows/release.yml`` does. ``--plain-http`` is
for a registry on 127.0.0.1 without TLS (the release test's). ``--dry-run`` builds and packages
but pushes nothing. Tools: ``skopeo`` and the pinned ``helm`` (``deploy/render_manifest.py``).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import build_image  # noqa: E402
import build_runtime  # noqa: E402
import render_manifest  # noqa: E402

CHART = HERE / "helm" / "flexhub"
#: A registry reference: host[:port] and an optional path, nothing a shell or URL would read.
_REGISTRY = re.compile(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]{1,5})?(/[a-z0-9._-]+)*")
_VERSION = re.compile(r"[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?")
_IMAGE_LINE = re.compile(r"^(image:\n  repository: )flexhub( .*)$", re.MULTILINE)
_NODE_IMAGE_LINE = re.compile(r'^(  nodeRepository: )""$', re.MULTILINE)


class ReleaseError(Exception):
    """A release that cannot go on; its message is one line."""


def flexhub_version() -> str:
    text = (HERE.parent / "flexhub" / "__init__.py").read_text()
    found = re.search(r'^__version__ = "([^"]+)"', text, re.MULTILINE)
    if not found:
        raise ReleaseError("flexhub/__init__.py names no __version__")
    return found.group(1)


def check(version: str, registry: str) -> None:
    """Refuse a malformed version or registry, or a version that is not the tree's."""
    if not _VERSION.fullmatch(version):
        raise ReleaseError(f"version {version[:80]!r}: expected X.Y.Z (no leading v)")
    if not _REGISTRY.fullmatch(registry):
        raise ReleaseError(f"--registry {registry[:80]!r}: expected host[:port][/path], lowercase")
    ours = flexhub_version()
    chart = (CHART / "Chart.yaml").read_text()
    versions = {
        "flexhub/__init__.py": ours,
        "Chart.yaml version": _field(chart, "version"),
        "Chart.yaml appVersion": _field(chart, "appVersion"),
    }
    wrong = [f"{where} says {said}" for where, said in versions.items() if said != version]
    if wrong:
        raise ReleaseError(f"version {version} is not this tree's: {'; '.join(wrong)}")


def _field(chart: str, name: str) -> str:
    found = re.search(rf"^{name}: \"?([^\"\n]+)\"?$", chart, re.MULTILINE)
    return found.group(1) if found else ""


def chart_copy(out: Path, registry: str) -> Path:
    """The chart with its default image in ``registry``; the rest unchanged."""
    copy = out / "chart" / "flexhub"
    shutil.rmtree(copy.parent, ignore_errors=True)
    shutil.copytree(CHART, copy)
    values = copy / "values.yaml"
    text, count = _IMAGE_LINE.subn(rf"\g<1>{registry}/flexhub\g<2>", values.read_text())
    text, node = _NODE_IMAGE_LINE.subn(rf'\g<1>"{registry}/flexhub-node"', text)
    if count != 1 or node != 1:
        raise ReleaseError(
            "values.yaml: no `image.repository: flexhub` or `nodeRepository` line for the registry"
        )
    values.write_text(text)
    return copy


def _run(argv: list[str]) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise ReleaseError(f"{Path(argv[0]).name} {argv[1]} failed: {last[0][:300]}")
    return proc.stdout


def _runtime(given: Path | None, out: Path, version: str, profile: str) -> Path:
    runtime = given or build_runtime.build(out / "runtimes", profile=profile)
    marker = json.loads((runtime / build_runtime.MARKER).read_text())
    if marker["version"] != version:
        raise ReleaseError(
            f"the runtime at {runtime} is flexhub {marker['version']}, not {version}"
        )
    if marker.get("profile", "full") != profile:
        raise ReleaseError(f"the runtime at {runtime} is not of the {profile} profile")
    return runtime


def _layout(out: Path, name: str, runtime: Path, version: str) -> tuple[Path, str]:
    layout = out / name
    shutil.rmtree(layout, ignore_errors=True)
    layout.mkdir()
    return layout, str(build_image.build_image(layout, runtime, version)["digest"])


def _push(out: Path, layout: Path, version: str, image: str, digest: str, plain_http: bool) -> None:
    digestfile = out / "pushed-digest"
    tls = ["--dest-tls-verify=false"] if plain_http else []
    _run(["skopeo", "copy", "--quiet", "--preserve-digests", *tls, "--digestfile",
          str(digestfile), f"oci:{layout}:{version}", f"docker://{image}"])  # fmt: skip
    pushed = digestfile.read_text().strip()
    if pushed != digest:
        raise ReleaseError(f"{image}: the registry holds {pushed}, not {digest}")


def release(version: str, registry: str, out: Path, runtime: Path | None,
            node_runtime: Path | None, plain_http: bool,
            dry_run: bool) -> dict[str, str]:  # fmt: skip
    """Build, check and push; return what was published."""
    check(version, registry)
    if shutil.which("skopeo") is None and not dry_run:
        raise ReleaseError("skopeo is not installed (it pushes the images)")
    helm = render_manifest.helm_binary()
    out.mkdir(parents=True, exist_ok=True)
    full = _runtime(runtime, out, version, "full")
    lean = _runtime(node_runtime, out, version, "node")
    layout, digest = _layout(out, "image", full, version)
    node_layout, node_digest = _layout(out, "image-node", lean, version)
    image, node_image = f"{registry}/flexhub:{version}", f"{registry}/flexhub-node:{version}"
    package_dir = out / "packages"
    shutil.rmtree(package_dir, ignore_errors=True)
    package_dir.mkdir()
    _run([str(helm), "package", str(chart_copy(out, registry)), "--destination", str(package_dir)])
    package = package_dir / f"flexhub-{version}.tgz"
    published = {"image": image, "digest": digest, "node_image": node_image,
                 "node_digest": node_digest, "chart": str(package),
                 "chart_ref": f"oci://{registry}/charts/flexhub"}  # fmt: skip
    if dry_run:
        return published
    _push(out, layout, version, image, digest, plain_http)
    _push(out, node_layout, version, node_image, node_digest, plain_http)
    http = ["--plain-http"] if plain_http else []
    _run([str(helm), "push", str(package), f"oci://{registry}/charts", *http])
    return published


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version")
    parser.add_argument("--registry", required=True, help="host[:port][/path]")
    parser.add_argument("--runtime", type=Path, help="an already built full runtime")
    parser.add_argument("--node-runtime", type=Path, help="an already built node-profile runtime")
    parser.add_argument("--out", type=Path, default=HERE.parent / "out" / "release")
    parser.add_argument("--plain-http", action="store_true", help="a registry without TLS")
    parser.add_argument("--dry-run", action="store_true", help="build and package; push nothing")
    args = parser.parse_args()
    try:
        done = release(args.version, args.registry, args.out, args.runtime, args.node_runtime,
                       args.plain_http, args.dry_run)  # fmt: skip
    except ReleaseError as exc:
        print(f"release: {exc}", file=sys.stderr)
        return 1
    verb = "built (not pushed)" if args.dry_run else "pushed"
    print(f"image {done['image']} {done['digest']} {verb}")
    print(f"image {done['node_image']} {done['node_digest']} {verb}")
    print(f"chart {done['chart_ref']} --version {args.version} {verb}")
    print(f"install: helm install flexhub {done['chart_ref']} --version {args.version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
