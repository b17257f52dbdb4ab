"""The release script against a real OCI registry on 127.0.0.1: CNCF distribution's
``registry`` built from the Go module proxy (tests/deploy/build_registry.py). The pushed image
is read back by ``skopeo inspect`` and the pushed chart is rendered by ``helm template`` from
``oci://``: both are independent readers of what the script wrote."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.cluster import free_port
from tests.conftest import REPO, needs_root
from tests.deploy import build_registry

pytestmark = needs_root

sys.path.insert(0, str(REPO / "deploy"))
import release  # type: ignore[import-not-found]  # noqa: E402
import render_manifest  # type: ignore[import-not-found]  # noqa: E402

VERSION = release.flexhub_version()


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A registry serving plain HTTP on 127.0.0.1, its storage a fresh directory."""
    if shutil.which("go") is None and not build_registry.PROGRAM.complete():
        pytest.skip("the registry is built with Go, which is not installed (.ci/install-system.sh)")
    binary = build_registry.build()
    root = tmp_path_factory.mktemp("registry")
    port = free_port()
    config = root / "config.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "version": 0.1,
                "log": {"level": "warn"},
                "storage": {"filesystem": {"rootdirectory": str(root / "data")}},
                "http": {"addr": f"127.0.0.1:{port}"},
            }
        )
    )
    log = open(root / "registry.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([str(binary), "serve", str(config)], stdout=log, stderr=log)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://{address}/v2/", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"registry did not start: {(root / 'registry.log').read_text()[-500:]}")
            time.sleep(0.2)
        yield address
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


@pytest.fixture(scope="module")
def helm() -> Path:
    if shutil.which("go") is None and not render_manifest.helm_binary(build=False).is_file():
        pytest.skip("helm is built with Go, which is not installed (.ci/install-system.sh)")
    path: Path = render_manifest.helm_binary()
    return path


def tags(address: str, name: str) -> list[str]:
    try:
        with urllib.request.urlopen(f"http://{address}/v2/{name}/tags/list", timeout=5) as got:
            found: list[str] = json.load(got).get("tags") or []
            return found
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return []
        raise


def run_release(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "deploy" / "release.py"), *args],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def published(registry: str, helm: Path, runtime: Path, node_runtime: Path,
              tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:  # fmt: skip
    out = tmp_path_factory.mktemp("release")
    done = run_release(VERSION, "--registry", registry, "--runtime", str(runtime),
                       "--node-runtime", str(node_runtime), "--out", str(out),
                       "--plain-http")  # fmt: skip
    assert done.returncode == 0, done.stderr
    digests = {
        name: json.loads((out / name / "index.json").read_text())["manifests"][0]["digest"]
        for name in ("image", "image-node")
    }
    return {"out": out, "stdout": done.stdout, "digest": digests["image"],
            "node_digest": digests["image-node"]}  # fmt: skip


@pytest.mark.parametrize(
    ("name", "digest"), [("flexhub", "digest"), ("flexhub-node", "node_digest")]
)
def test_the_images_are_pushed_with_the_layouts_digests(registry: str, published: dict[str, Any],
                                                        name: str, digest: str) -> None:  # fmt: skip
    inspected = subprocess.run(
        ["skopeo", "inspect", "--tls-verify=false", f"docker://{registry}/{name}:{VERSION}"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    image = json.loads(inspected.stdout)
    assert image["Digest"] == published[digest]
    assert image["Labels"]["org.opencontainers.image.version"] == VERSION
    assert image["Architecture"] == "amd64"
    assert f"image {registry}/{name}:{VERSION} {published[digest]} pushed" in published["stdout"]
    assert published["digest"] != published["node_digest"]


def test_the_chart_installs_from_oci_with_the_pushed_image(registry: str, helm: Path,
                                                          published: dict[str, Any]) -> None:  # fmt: skip
    ref = f"oci://{registry}/charts/flexhub"
    assert f"install: helm install flexhub {ref} --version {VERSION}" in published["stdout"]
    rendered = subprocess.run(
        [str(helm), "template", "flexhub", ref, "--version", VERSION, "--plain-http",
         "--namespace", "flexhub-system"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    docs = [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]
    daemonset = next(doc for doc in docs if doc["kind"] == "DaemonSet")
    images = {c["image"] for c in daemonset["spec"]["template"]["spec"]["containers"]}
    assert images == {f"{registry}/flexhub-node:{VERSION}"}  # no node agent: the lean image
    shown = subprocess.run(
        [str(helm), "show", "chart", ref, "--version", VERSION, "--plain-http"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    chart = yaml.safe_load(shown.stdout)
    assert (chart["version"], chart["appVersion"]) == (VERSION, VERSION)
    # the tree's own chart is untouched: only the release copy names the registry
    assert "repository: flexhub " in (REPO / "deploy/helm/flexhub/values.yaml").read_text()


@pytest.mark.parametrize(
    ("version", "registry_arg", "says"),
    [
        ("9.9.9", None, "is not this tree's: flexhub/__init__.py says"),
        ("v" + VERSION, None, "expected X.Y.Z"),
        (VERSION, "Registry.example:5000", "expected host[:port][/path]"),
        (VERSION, "127.0.0.1:5000/$(id)", "expected host[:port][/path]"),
    ],
)
def test_a_wrong_version_or_registry_is_refused_before_anything_is_pushed(
    registry: str, runtime: Path, tmp_path: Path, version: str, registry_arg: str | None, says: str
) -> None:  # (refused before any runtime is read or built)
    before = [tags(registry, name) for name in ("flexhub", "flexhub-node", "charts/flexhub")]
    done = run_release(version, "--registry", registry_arg or registry, "--runtime", str(runtime),
                       "--out", str(tmp_path / "out"), "--plain-http")  # fmt: skip
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], done.stderr
    assert not (tmp_path / "out").exists()
    assert [
        tags(registry, name) for name in ("flexhub", "flexhub-node", "charts/flexhub")
    ] == before


def test_the_release_workflow_runs_the_script_on_a_version_tag() -> None:
    workflow = yaml.safe_load((REPO / ".github/workflows/release.yml").read_text())
    triggers = workflow[True] if True in workflow else workflow["on"]  # YAML 1.1 reads on: as True
    assert triggers["push"]["tags"] == ["v*"]
    steps = [step for job in workflow["jobs"].values() for step in job["steps"]]
    runs = "\n".join(step.get("run", "") for step in steps)
    assert 'python3 deploy/release.py "${GITHUB_REF_NAME#v}" --registry "$FLEXHUB_REGISTRY"' in runs
    # credentials reach the tools on standard input, never on a command line, and only once
    # everything that runs third-party install code (pip, go) has run
    assert "--password-stdin" in runs and "secrets." not in runs
    login = next(i for i, step in enumerate(steps) if "login" in step.get("run", ""))
    assert all("build_runtime" not in step.get("run", "") and "helm_binary" not in step.get("run", "")
               and "pip" not in step.get("run", "") for step in steps[login:])  # fmt: skip
