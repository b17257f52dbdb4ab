"""``flexhub validate`` as a person uses it: every problem of every volume, in the manifest's
terms, over several files and directories, StorageClasses too (the installed flexhub and its
real backends and schemas; the echo test backend where named)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.conftest import PYTHON, TEST_SITE


def validate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "flexhub", "validate", *args],
        capture_output=True,
        text=True,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(TEST_SITE),
            "FLEXHUB_CONFIG": os.environ["FLEXHUB_CONFIG"],
        },
        check=False,
    )


def pv(name: str, options: str, extra: str = "") -> str:
    return (
        f"apiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: {name}}}\nspec:\n"
        f"  capacity: {{storage: 1Gi}}\n  flexVolume:\n    driver: k8s/flexhub\n{extra}"
        f"    options: {options}\n"
    )


def test_every_problem_of_every_volume_in_the_manifests_terms(tmp_path: Path) -> None:
    manifest = tmp_path / "pv.yaml"
    manifest.write_text(
        pv("a", "{backend: loopfile, flie: a.img, size: 1Gi}", "    fsType: btrfs\n")
        + "---\n"
        + pv("b", "{backend: loopfile, file: b.img, size: 1Gi, preallocate: 'yes'}")
    )
    proc = validate(str(manifest))
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == [
        "PersistentVolume/a: 3 problems",
        "  spec.flexVolume.options.file: required",
        "  spec.flexVolume.options.flie: unknown option, did you mean file?",
        '  spec.flexVolume.fsType: must be one of "", "ext4", "ext3", "xfs", not "btrfs"',
        'PersistentVolume/b: spec.flexVolume.options.preallocate: must be one of "true", '
        '"false", not "yes"',
    ]


def test_pod_templates_are_named_by_their_path(tmp_path: Path) -> None:
    manifest = tmp_path / "deploy.yaml"
    manifest.write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web}\nspec:\n  template:\n"
        "    spec:\n      containers: [{name: c, image: x}]\n      volumes:\n"
        "      - {name: cache, emptyDir: {}}\n"
        "      - name: data\n        flexVolume: {driver: k8s/flexhub, readOnly: true,"
        " options: {backend: echo, tagg: x}}\n"
    )
    proc = validate(str(manifest))
    assert proc.stdout.splitlines() == [
        "Deployment/web volume data: 2 problems",
        "  spec.template.spec.volumes[1].flexVolume.options.tag: required",
        "  spec.template.spec.volumes[1].flexVolume.options.tagg: unknown option, did you mean tag?",
    ]


def test_several_files_and_a_directory(tmp_path: Path) -> None:
    tree = tmp_path / "manifests"
    (tree / "nested").mkdir(parents=True)
    (tree / "good.yaml").write_text(pv("good", "{backend: echo, tag: x}"))
    (tree / "nested" / "bad.yml").write_text(pv("bad", "{backend: echo}"))
    (tree / "broken.json").write_text("{not json nor yaml: [")
    (tree / "README.md").write_text(pv("ignored", "{backend: nosuch}"))
    (tree / ".hidden.yaml").write_text(pv("hidden", "{backend: nosuch}"))
    single = tmp_path / "cm.yaml"
    single.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    proc = validate(str(tree), str(single))
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"{tree / 'broken.json'}: not valid YAML or JSON (line 1)")
    assert lines[1:] == [
        f"{tree / 'good.yaml'}: PersistentVolume/good: ok",
        f"{tree / 'nested' / 'bad.yml'}: PersistentVolume/bad: spec.flexVolume.options.tag: "
        "required",
        f"{single}: no flexVolume with driver k8s/flexhub",
    ]


def test_files_without_flexhub_volumes_pass(tmp_path: Path) -> None:
    manifest = tmp_path / "other.yaml"
    manifest.write_text(
        "apiVersion: v1\nkind: PersistentVolume\nmetadata: {name: x}\nspec:\n"
        "  flexVolume: {driver: other/driver, options: {anything: goes}}\n"
    )
    proc = validate(str(manifest))
    assert proc.returncode == 0
    assert proc.stdout == f"{manifest}: no flexVolume with driver k8s/flexhub\n"


def test_storage_classes(tmp_path: Path) -> None:
    """flexhub's classes are read as the provisioner reads them, every problem on its line;
    the driver's name as provisioner is a mistake; other provisioners' classes are skipped."""
    manifest = tmp_path / "sc.yaml"
    sc = "apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata: {{name: {}}}\n"
    wait = "volumeBindingMode: WaitForFirstConsumer\n"
    manifest.write_text(
        sc.format("plain")
        + "provisioner: flexhub\n---\n"
        + sc.format("typo")
        + "provisioner: flexhub\nparameters: {backend: loopfle}\n---\n"
        + sc.format("driver")
        + "provisioner: k8s/flexhub\nparameters: {backend: loopfile}\n---\n"
        + sc.format("fast")
        + f"provisioner: flexhub\n{wait}parameters: {{backend: loopfile, fsType: xfs}}\n---\n"
        + sc.format("bad")
        + "provisioner: flexhub\nmountOptions: [noatime]\n"
        + "parameters: {backend: loopfile, onDelete: archive, secretName: s, drectory: x,"
        + " preallocate: true}\n---\n"
        + "apiVersion: v1\nkind: List\nitems:\n- apiVersion: storage.k8s.io/v1\n"
        + "  kind: StorageClass\n  metadata: {name: listed}\n  provisioner: flexhub\n"
        + f"  {wait}  parameters: {{backend: loopfile, directory: /abs}}\n---\n"
        + sc.format("other")
        + "provisioner: ebs.csi.aws.com\n"
    )
    proc = validate(str(manifest))
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == [
        "StorageClass/plain: parameters.backend: required (installed: broken, cifs, echo, iscsi, "
        "loopfile, nfs, notabackend)",
        "StorageClass/typo: parameters.backend: unknown backend 'loopfle', did you mean loopfile?",
        "StorageClass/driver: provisioner: 'k8s/flexhub' is the FlexVolume driver's name; "
        "flexhub's provisioner is 'flexhub'",
        "StorageClass/fast: ok (backend loopfile, onDelete delete)",
        "StorageClass/bad: 6 problems",
        "  parameters.preallocate: must be a string, not a boolean (quote it)",
        "  parameters.onDelete: backend loopfile honours delete, retain, not 'archive'",
        "  parameters.secretNamespace: required with secretName",
        "  parameters.drectory: unknown parameter, did you mean directory?",
        "  mountOptions: a FlexVolume PV cannot carry mountOptions (kubelet fails its mount): "
        "put them in parameters.mountOptions, comma-separated",
        "  volumeBindingMode: backend loopfile keeps a volume on one node, so the class must be"
        " WaitForFirstConsumer (not 'Immediate'): the volume is made where the pod is scheduled",
        "StorageClass/listed: parameters.directory: '/abs' is not valid: expected Directory of"
        " the files, relative to the loopfile root (default provisioned); segments of"
        " A-Za-z0-9_.+-, no . or ..",
        "StorageClass/other: skipped (provisioner 'ebs.csi.aws.com' is not flexhub's)",
    ]


def test_sizes_in_human_units(tmp_path: Path) -> None:
    manifest = tmp_path / "pv.yaml"
    manifest.write_text(
        pv("same", "{backend: loopfile, file: a.img, size: 1Gi}")
        + "---\n"
        + pv("differs", "{backend: loopfile, file: b.img, size: '1610612736'}")
    )
    proc = validate(str(manifest))
    assert proc.returncode == 0
    assert proc.stdout.splitlines() == [
        "PersistentVolume/same: ok (size 1 GiB)",
        "PersistentVolume/differs: ok (size 1.5 GiB, but spec.capacity.storage is 1 GiB)",
    ]


def test_a_long_allow_list_is_summarised(tmp_path: Path) -> None:
    manifest = tmp_path / "nfs.yaml"
    manifest.write_text(
        pv("n", "{backend: nfs, server: srv1, share: /x, mountOptions: 'hard,foo=1'}")
    )
    proc = validate(str(manifest))
    assert proc.returncode == 1
    assert proc.stdout == (
        'PersistentVolume/n: spec.flexVolume.options.mountOptions: "foo=1" not allowed: expected '
        "comma-separated NFS mount options from the allow-list (44 allowed; flexhub schema nfs "
        "lists them)\n"
    )


def test_the_backends_cross_option_rules_run(tmp_path: Path) -> None:
    manifest = tmp_path / "nfs.yaml"
    manifest.write_text(
        pv("n", "{backend: nfs, server: srv1, share: /x, mountOptions: 'hard,soft'}")
    )
    proc = validate(str(manifest))
    assert proc.returncode == 1
    assert proc.stdout.startswith("PersistentVolume/n: spec.flexVolume.options")
    assert "hard" in proc.stdout and "soft" in proc.stdout


def test_a_secret_ref_when_the_options_need_credentials(tmp_path: Path) -> None:
    iscsi = "{backend: iscsi, targetPortal: 10.0.0.1, iqn: 'iqn.2020-01.com.x:t', lun: '0', chapAuthSession: 'true'}"
    cifs = "{backend: cifs, server: srv1, share: data}"
    secret = "    secretRef: {name: creds}\n"
    manifest = tmp_path / "pv.yaml"
    manifest.write_text(
        "---\n".join(
            [
                pv("chap", iscsi),
                pv("chap-ok", iscsi, secret),
                pv("smb", cifs),
                pv("smb-ok", cifs, secret),
            ]
        )
    )
    proc = validate(str(manifest))
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == [
        "PersistentVolume/chap: spec.flexVolume.secretRef: required: chapAuthSession takes the "
        "CHAP credentials from a Secret",
        "PersistentVolume/chap-ok: ok",
        "PersistentVolume/smb: spec.flexVolume.secretRef: required: cifs takes the username and "
        "password only from a Secret",
        "PersistentVolume/smb-ok: ok",
    ]


def test_a_schema_error_does_not_hide_the_backends_own_rules(tmp_path: Path) -> None:
    """One run shows every problem: the schema's (a bad server, a typo) and the backend's
    cross-option rule (hard and soft), which ran only once the schema passed."""
    manifest = tmp_path / "nfs.yaml"
    manifest.write_text(
        pv(
            "n",
            "{backend: nfs, server: 'bad_host!', share: /x, mountOptions: 'hard,soft', sever: y}",
        )
    )
    proc = validate(str(manifest))
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert lines[0] == "PersistentVolume/n: 3 problems", proc.stdout
    assert lines[1].startswith("  spec.flexVolume.options.server: 'bad_host!' is not valid")
    assert lines[2] == "  spec.flexVolume.options.sever: unknown option, did you mean server?"
    assert lines[3] == (
        "  spec.flexVolume.options: mount options 'hard' and 'soft' contradict each other"
    )


def test_a_backend_rule_is_named_by_its_path_not_json_path(tmp_path: Path) -> None:
    """``invalid option $['x']`` (the kubelet reply's form) reads ``spec....options.x``."""
    manifest = tmp_path / "cifs.yaml"
    manifest.write_text(
        pv("n", "{backend: cifs, server: srv1, share: data, vers: '1.0'}",
           "    secretRef: {name: creds}\n")
    )  # fmt: skip
    proc = validate(str(manifest))
    assert proc.returncode == 1
    assert proc.stdout.startswith(
        "PersistentVolume/n: spec.flexVolume.options.vers: SMB1 (vers 1.0) is refused"
    ), proc.stdout
    assert "$[" not in proc.stdout


def test_almost_our_driver_or_provisioner_gets_a_did_you_mean(tmp_path: Path) -> None:
    """Not skipped in silence with exit 0: a flexVolume driver or a StorageClass provisioner
    that is almost flexhub's is a problem with the name it meant."""
    manifest = tmp_path / "near.yaml"
    sc = "apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata: {{name: {}}}\n"
    manifest.write_text(
        "apiVersion: v1\nkind: PersistentVolume\nmetadata: {name: dir-form}\nspec:\n"
        "  flexVolume: {driver: k8s~flexhub/flexhub, options: {backend: echo, tag: x}}\n---\n"
        "apiVersion: v1\nkind: Pod\nmetadata: {name: web}\nspec:\n"
        "  containers: [{name: c, image: x}]\n"
        "  volumes: [{name: data, flexVolume: {driver: flexhub, options: {backend: echo}}}]\n"
        "---\n"
        + sc.format("by-backend")
        + "provisioner: flexhub/nfs\nparameters: {server: s, share: /x}\n---\n"
        + sc.format("other")
        + "provisioner: ebs.csi.aws.com\n"
    )
    proc = validate(str(manifest))
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == [
        "PersistentVolume/dir-form: spec.flexVolume.driver: 'k8s~flexhub/flexhub' is not"
        " flexhub's driver name, did you mean k8s/flexhub? (k8s~flexhub is its directory)",
        "Pod/web volume data: spec.volumes[0].flexVolume.driver: 'flexhub' is not flexhub's"
        " driver name, did you mean k8s/flexhub?",
        "StorageClass/by-backend: provisioner: 'flexhub/nfs' is not flexhub's provisioner name,"
        " did you mean flexhub? (the backend goes in parameters.backend: nfs)",
        "StorageClass/other: skipped (provisioner 'ebs.csi.aws.com' is not flexhub's)",
    ]


def test_a_directory_without_manifests_is_one_line_and_exit_1(tmp_path: Path) -> None:
    tree = tmp_path / "manifests"
    tree.mkdir()
    (tree / "README.md").write_text("not a manifest\n")
    proc = validate(str(tree))
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr == (
        f"flexhub: {tree}: no manifests (*.yaml, *.yml, *.json) in this directory\n"
    )


def test_descriptions_are_not_counted_as_allow_lists(tmp_path: Path) -> None:
    """Only an allow-list is summarised as "N allowed" (its items counted, not the commas of
    its note); any other description is shown whole, its parentheses balanced."""
    manifest = tmp_path / "pv.yaml"
    manifest.write_text(
        pv("sub", "{backend: nfs, server: srv1, share: /x, subPath: '../x'}")
        + "---\n"
        + pv("mode", "{backend: cifs, server: srv1, share: data, file_mode: '999'}",
             "    secretRef: {name: creds}\n")
    )  # fmt: skip
    proc = validate(str(manifest))
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, proc.stdout
    assert "allowed" not in proc.stdout, proc.stdout
    assert lines[0].startswith(
        "PersistentVolume/sub: spec.flexVolume.options.subPath: '../x' is not valid: expected a"
        " sub-directory of the export to mount instead of its root: relative, letters"
    ), lines[0]
    for line in lines:
        assert line.count("(") == line.count(")"), line


def test_a_class_schema_error_does_not_hide_its_path_pattern(tmp_path: Path) -> None:
    """A StorageClass's backend rules (``pathPattern`` among them) run beside its schema
    errors, and are named ``parameters.pathPattern``, not ``$['pathPattern']``."""
    manifest = tmp_path / "sc.yaml"
    manifest.write_text(
        "apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata: {name: p}\n"
        "provisioner: flexhub\nparameters: {backend: nfs, server: nfs1.example.com, "
        "share: /exports, uid: abc, pathPattern: '${.PVC.name}/x'}\n"
    )
    proc = validate(str(manifest))
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == [
        "StorageClass/p: 2 problems",
        "  parameters.uid: 'abc' is not valid: expected numeric owner of the claim's directory"
        " (default 0)",
        "  parameters.pathPattern: its last segment must hold ${uid} or ${pvName}, so that no two"
        " claims share a directory (and one claim's reclaim never deletes another's data)",
    ]
