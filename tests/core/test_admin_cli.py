"""The human commands: backends, schema, validate, version, help."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.conftest import PYTHON, TEST_SITE

PV = """\
apiVersion: v1
kind: PersistentVolume
metadata: {name: pv-good}
spec:
  capacity: {storage: 1Gi}
  accessModes: [ReadWriteOnce]
  flexVolume:
    driver: k8s/flexhub
    options: {backend: echo, tag: good}
---
apiVersion: v1
kind: PersistentVolume
metadata: {name: pv-typo}
spec:
  flexVolume:
    driver: k8s/flexhub
    readOnly: true
    options: {backend: echo, tag: typo, sever: x}
---
apiVersion: v1
kind: Pod
metadata: {name: web}
spec:
  containers: [{name: c, image: nginx}]
  volumes:
    - name: data
      flexVolume: {driver: k8s/flexhub, options: {backend: nosuch}}
    - name: other
      flexVolume: {driver: other/driver, options: {anything: goes}}
"""


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "flexhub", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(TEST_SITE),
            "FLEXHUB_CONFIG": os.environ["FLEXHUB_CONFIG"],  # the session's, not the node's
        },
        check=False,
    )


def test_version() -> None:
    proc = cli("version")
    assert proc.returncode == 0
    assert proc.stdout.startswith("flexhub ")


def test_help_lists_commands() -> None:
    proc = cli("--help")
    assert proc.returncode == 0
    for command in ("backends", "schema", "validate", "install", "demo"):
        assert command in proc.stdout


def test_backends_reports_broken_ones() -> None:
    proc = cli("backends")
    lines = {line.split()[0]: line for line in proc.stdout.splitlines()}
    assert "ok" in lines["echo"] and "flexhub-testbackends 0.0" in lines["echo"]
    assert "BROKEN" in lines["broken"] and "libfrobnicate" in lines["broken"]
    assert proc.returncode == 1  # a broken backend is worth a non-zero exit


def test_schema_prints_the_backends_schema() -> None:
    proc = cli("schema", "echo")
    assert proc.returncode == 0
    assert json.loads(proc.stdout)["properties"]["backend"] == {"const": "echo"}
    missing = cli("schema", "nosuch")
    assert missing.returncode == 1
    assert "unknown backend 'nosuch'" in missing.stderr


def test_validate_manifest(tmp_path: Path) -> None:
    manifest = tmp_path / "pv.yaml"
    manifest.write_text(PV)
    proc = cli("validate", str(manifest))
    assert proc.returncode == 1
    out = proc.stdout.splitlines()
    assert out[0] == "PersistentVolume/pv-good: ok"
    assert out[1] == (
        "PersistentVolume/pv-typo: spec.flexVolume.options.sever: unknown option, "
        "did you mean server?"
    )
    assert out[2].startswith(
        "Pod/web volume data: spec.volumes[0].flexVolume.options.backend: unknown backend 'nosuch'"
    )
    assert len(out) == 3  # the other driver's volume is not ours


def test_validate_options_json_from_stdin() -> None:
    good = cli("validate", "-", stdin='{"backend": "echo", "tag": "x"}')
    assert good.returncode == 0, good.stdout + good.stderr
    bad = cli("validate", "-", stdin='{"backend": "echo", "tag": 7}')
    assert bad.returncode == 1
    assert "must be a string" in bad.stdout


def test_validate_runs_the_backends_option_rules(tmp_path: Path) -> None:
    manifest = tmp_path / "nfs.yaml"
    manifest.write_text(
        "kind: PersistentVolume\nmetadata: {name: pv-nfs}\nspec:\n  flexVolume:\n"
        "    driver: k8s/flexhub\n    options: {backend: nfs, server: srv1, share: /x,"
        " mountOptions: 'hard,soft'}\n"
    )
    proc = cli("validate", str(manifest))
    assert proc.returncode == 1
    assert "PersistentVolume/pv-nfs:" in proc.stdout and "hard" in proc.stdout


def test_validate_finds_nothing(tmp_path: Path) -> None:
    manifest = tmp_path / "empty.yaml"
    manifest.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    proc = cli("validate", str(manifest))
    assert proc.returncode == 0  # a tree of manifests holds many such files
    assert proc.stdout == f"{manifest}: no flexVolume with driver k8s/flexhub\n"


def test_usage_error_is_short() -> None:
    proc = cli("schema")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr


def test_the_api_clients_outside_a_pod_say_what_to_pass(tmp_path: Path) -> None:
    """Without a pod's service account and without --kubeconfig, ``provisioner`` and
    ``node-agent`` say so in one line (it was ``internal error: ConfigException``); a
    --kubeconfig that cannot be used is named with the reason."""
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(TEST_SITE),
        "FLEXHUB_CONFIG": os.environ["FLEXHUB_CONFIG"],
    }
    broken = tmp_path / "kubeconfig"
    broken.write_text("apiVersion: v1\n")
    cases = {
        ("provisioner",): "no in-cluster config",
        ("node-agent", "--node", "n1"): "no in-cluster config",
        (
            "provisioner",
            "--kubeconfig",
            str(tmp_path / "nosuch"),
        ): f"--kubeconfig {tmp_path / 'nosuch'}: no such file",
        ("node-agent", "--node", "n1", "--kubeconfig", str(broken)): f"--kubeconfig {broken}: ",
    }
    for args, start in cases.items():
        proc = subprocess.run(
            [PYTHON, "-m", "flexhub", *args], env=env, capture_output=True, text=True,
            timeout=60, check=False,
        )  # fmt: skip
        lines = proc.stderr.splitlines()
        assert proc.returncode == 1, (args, proc.stderr)
        assert len(lines) == 1, (args, proc.stderr)
        assert lines[0].startswith(f"flexhub: {start}"), (args, lines)
        assert "internal error" not in lines[0] and "ConfigException" not in lines[0]
        if "--kubeconfig" not in args:
            assert "pass --kubeconfig" in lines[0], lines
