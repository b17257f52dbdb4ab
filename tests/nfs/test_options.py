"""The nfs backend's options: schema, allow-list, contradictions, and the plan they give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flexhub_nfs import NfsBackend
from flexhub_nfs._options import FLAGS, VALUED, build_plan, parse_server, schema_pattern

from flexhub.driver.validation import check_backend_schema, validate_options
from flexhub.errors import InvalidOptions
from flexhub.volume import Volume
from tests.nfs.conftest import VolumeFactory

REPO = Path(__file__).resolve().parents[2]
KUBE = {
    "kubernetes.io/fsType": "",
    "kubernetes.io/readwrite": "rw",
    "kubernetes.io/pvOrVolumeName": "pv-nfs",
    "kubernetes.io/pod.name": "web-0",
    "kubernetes.io/pod.namespace": "default",
    "kubernetes.io/pod.uid": "0c9f-uid",
    "kubernetes.io/serviceAccount.name": "default",
}


def options(**extra: str) -> dict[str, str]:
    base = {"backend": "nfs", "server": "nfs1.example.com", "share": "/exports/team"}
    base.update(KUBE)
    base.update(extra)
    return base


# -- the schema -----------------------------------------------------------------------------


def test_schema_is_valid_and_packaged_as_a_relative_symlink() -> None:
    check_backend_schema(NfsBackend)
    link = REPO / "backends/nfs/flexhub_nfs/schema.json"
    assert link.is_symlink() and str(link.readlink()) == "../../../schemas/nfs.json"
    schema = NfsBackend.schema()
    assert schema["$id"] == "https://flexhub.invalid/schemas/nfs.json"
    assert schema["additionalProperties"] is False


def test_schema_mount_options_pattern_is_the_python_allow_list() -> None:
    schema = json.loads((REPO / "schemas/nfs.json").read_text())
    assert schema["properties"]["mountOptions"]["pattern"] == schema_pattern()
    description = schema["properties"]["mountOptions"]["description"]
    for name in (*FLAGS, *(f"{v}=" for v in VALUED)):
        assert name in description


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"server": "10.0.0.7"},
        {"server": "fd00::7"},
        {"server": "[fd00::7]"},
        {"server": "NFS-1.example.com"},
        {"share": "/"},
        {"share": "/exports/team", "subPath": "app/data"},
        {"subPath": "a", "createSubPath": "true", "subPathMode": "2775"},
        {"subPath": "a", "createSubPath": "false"},
        {"nfsVersion": "4.1"},
        {"mountOptions": "hard,timeo=600,retrans=2,rsize=1048576,wsize=1048576,noatime"},
        {"mountOptions": "nconnect=8,sec=krb5p,proto=tcp6,port=2049,lookupcache=positive"},
        {"mountOptions": "actimeo=30,nolock,vers=3,mountproto=tcp,local_lock=all"},
        {"mountOptions": ""},
        {"kubernetes.io/fsType": "nfs4", "kubernetes.io/readwrite": "ro"},
    ],
)
def test_good_options_pass_schema_and_check(extra: dict[str, str]) -> None:
    opts = options(**extra)
    validate_options(NfsBackend, opts)
    build_plan(Volume.from_options(opts))


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"server": ""}, "server"),
        ({"server": "-bad.example.com"}, "server"),
        ({"server": "srv_1"}, "server"),
        ({"server": "srv1;reboot"}, "server"),
        ({"server": "srv1 -o"}, "server"),
        ({"share": "exports"}, "share"),
        ({"share": "/exports/../etc"}, "share"),
        ({"share": "/exports/./a"}, "share"),
        ({"share": "/exports//a"}, "share"),
        ({"share": "/exports/"}, "share"),
        ({"share": "/a b"}, "share"),
        ({"share": "/a,b"}, "share"),
        ({"share": "/" + "a" * 1100}, "share"),
        ({"subPath": "/abs"}, "subPath"),
        ({"subPath": "../up"}, "subPath"),
        ({"subPath": "a/../../b"}, "subPath"),
        ({"subPath": "a//b"}, "subPath"),
        ({"nfsVersion": "5"}, "nfsVersion"),
        ({"nfsVersion": "4.3"}, "nfsVersion"),
        ({"createSubPath": "yes", "subPath": "a"}, "createSubPath"),
        ({"createSubPath": "true"}, "subPath"),
        ({"subPath": "a", "createSubPath": "true", "subPathMode": "999"}, "subPathMode"),
        ({"subPath": "a", "createSubPath": "true", "subPathMode": "04750"}, "subPathMode"),
        ({"mountOptions": "hard,bind"}, "mountOptions"),
        ({"mountOptions": "remount"}, "mountOptions"),
        ({"mountOptions": "rw"}, "mountOptions"),
        ({"mountOptions": "timeo=abc"}, "mountOptions"),
        ({"mountOptions": "hard, soft"}, "mountOptions"),
        ({"mountOptions": "clientaddr=1.2.3.4"}, "mountOptions"),
        ({"mountOptions": "proto=udp"}, "mountOptions"),
        ({"mountOptions": "nconnect=17"}, "mountOptions"),
        ({"mountOptions": "nconnect=0"}, "mountOptions"),
        ({"mountOptions": "x-mount.mkdir"}, "mountOptions"),
        ({"mountOptions": "sec=krb5,helper=/bin/sh"}, "mountOptions"),
        ({"kubernetes.io/fsType": "ext4"}, "fsType"),
        ({"kubernetes.io/readwrite": "wr"}, "readwrite"),
        ({"path": "/exports"}, "path"),
    ],
)
def test_bad_options_fail_the_schema(extra: dict[str, str], needle: str) -> None:
    with pytest.raises(InvalidOptions, match=needle):
        validate_options(NfsBackend, options(**extra))


def test_unknown_option_gets_a_suggestion() -> None:
    with pytest.raises(InvalidOptions, match="did you mean 'nfsVersion'"):
        validate_options(NfsBackend, options(nfsversion="4.1"))


# -- what only the Python check catches -------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "fs_type", "needle"),
    [
        ({"mountOptions": "hard,soft"}, "", "'hard' and 'soft' contradict"),
        ({"mountOptions": "ac,noac"}, "", "contradict"),
        ({"mountOptions": "noac,actimeo=3"}, "", "'noac' and 'actimeo' contradict"),
        ({"mountOptions": "lock,nolock"}, "", "contradict"),
        ({"mountOptions": "noatime,relatime"}, "", "contradict"),
        ({"mountOptions": "vers=3,nfsvers=3"}, "", "'vers' and 'nfsvers' contradict"),
        ({"mountOptions": "timeo=10,timeo=20"}, "", "'timeo' is given twice"),
        ({"mountOptions": "hard,hard"}, "", "given twice"),
        ({"mountOptions": "vers=3", "nfsVersion": "4.1"}, "", "vers=3 contradicts nfsVersion"),
        ({"mountOptions": "nfsvers=4.2", "nfsVersion": "4"}, "", "nfsvers=4.2 contradicts"),
        ({"nfsVersion": "3"}, "nfs4", "'nfs4' contradicts NFS version 3"),
        ({"mountOptions": "vers=3"}, "nfs4", "contradicts NFS version 3"),
        ({"nfsVersion": "4.1", "mountOptions": "mountport=20048"}, "", "NFSv3 only"),
        ({"mountOptions": "mountproto=tcp"}, "nfs4", "NFSv3 only"),
        ({"nfsVersion": "4.2", "mountOptions": "local_lock=all"}, "", "NFSv3 only"),
        ({"mountOptions": "nconnect=0"}, "", "'nconnect=0' has an invalid value"),
        ({"mountOptions": "nconnect=17"}, "", "invalid value"),
        ({"mountOptions": "retry=10001"}, "", r"out of range \(0\.\.10000\)"),
        ({"mountOptions": "port=70000"}, "", "out of range"),
        ({"mountOptions": "rsize=512"}, "", "out of range"),
        ({"server": "999.1.2.3"}, "", "server"),
        ({"server": "1.2.3"}, "", "server"),
        ({"server": "fd00::7::1"}, "", "server"),
        ({"server": "[fd00::7"}, "", "server"),
        ({"server": "fe80::1%eth0"}, "", "server"),
        ({"subPathMode": "0700", "subPath": "a"}, "", "needs createSubPath"),
        ({"subPathMode": "0700", "subPath": "a", "createSubPath": "false"}, "", "needs create"),
    ],
)
def test_contradictions_and_ranges_fail_the_check(
    make_volume: VolumeFactory, extra: dict[str, str], fs_type: str, needle: str
) -> None:
    with pytest.raises(InvalidOptions, match=needle):
        build_plan(make_volume(fs_type=fs_type, **extra))


def test_check_options_runs_the_same_rules(make_volume: VolumeFactory) -> None:
    with pytest.raises(InvalidOptions):
        NfsBackend.check_options(make_volume(mountOptions="hard,soft"))
    NfsBackend.check_options(make_volume(mountOptions="soft"))


# -- the plan: exact mount options ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "read_only", "fs_type", "expected"),
    [
        ({}, False, "", "hard,retry=0"),
        ({}, True, "", "hard,retry=0,ro"),
        ({}, False, "nfs4", "vers=4,hard,retry=0"),
        ({}, False, "nfs", "hard,retry=0"),
        ({"nfsVersion": "3"}, False, "", "vers=3,hard,retry=0"),
        ({"nfsVersion": "4.0"}, False, "", "vers=4.0,hard,retry=0"),
        ({"nfsVersion": "4.1"}, False, "nfs4", "vers=4.1,hard,retry=0"),
        ({"nfsVersion": "4.2"}, True, "", "vers=4.2,hard,retry=0,ro"),
        ({"mountOptions": "soft,timeo=50,retrans=3"}, False, "", "soft,timeo=50,retrans=3,retry=0"),
        ({"mountOptions": "nfsvers=3,nolock"}, False, "", "vers=3,nolock,hard,retry=0"),
        (
            {"mountOptions": "noatime,vers=4.1,nconnect=4", "nfsVersion": "4.1"},
            False,
            "",
            "vers=4.1,noatime,nconnect=4,hard,retry=0",
        ),
        ({"mountOptions": "retry=2,hard"}, False, "", "retry=2,hard"),
        ({"mountOptions": "ro,noatime"}, False, "", "noatime,hard,retry=0,ro"),
    ],
)
def test_plan_options(
    make_volume: VolumeFactory,
    extra: dict[str, str],
    read_only: bool,
    fs_type: str,
    expected: str,
) -> None:
    plan = build_plan(make_volume(read_only=read_only, fs_type=fs_type, **extra))
    assert ",".join(plan.options) == expected
    assert "ro" not in plan.root_options
    assert plan.read_only == ("ro" in plan.options)


@pytest.mark.parametrize(
    ("server", "share", "sub_path", "source"),
    [
        ("srv1", "/export", "", "srv1:/export"),
        ("SRV1.Example.COM", "/export", "", "srv1.example.com:/export"),
        ("10.1.2.3", "/export", "a/b", "10.1.2.3:/export/a/b"),
        ("fd00:0:0::7", "/export", "", "[fd00::7]:/export"),
        ("[::1]", "/", "team", "[::1]:/team"),
        ("::ffff:10.0.0.1", "/x", "", "[::ffff:a00:1]:/x"),
    ],
)
def test_plan_source(
    make_volume: VolumeFactory, server: str, share: str, sub_path: str, source: str
) -> None:
    extra = {"subPath": sub_path} if sub_path else {}
    plan = build_plan(make_volume(server=server, share=share, **extra))
    assert plan.source == source
    assert plan.root_source == source.rsplit(":", 1)[0] + ":" + share


def test_parse_server_forms() -> None:
    assert parse_server("127.0.0.1") == "127.0.0.1"
    assert parse_server("[fd00::1]") == "[fd00::1]"
    with pytest.raises(InvalidOptions):
        parse_server("a" * 64 + ".example.com")  # a label longer than 63


def test_sub_path_mode_default_and_given(make_volume: VolumeFactory) -> None:
    assert build_plan(make_volume(subPath="a", createSubPath="true")).sub_path_mode == 0o750
    plan = build_plan(make_volume(subPath="a", createSubPath="true", subPathMode="2775"))
    assert plan.sub_path_mode == 0o2775


def test_volume_id(make_volume: VolumeFactory, backend: NfsBackend) -> None:
    assert backend.volume_id(make_volume()) == "nfs:srv1:/export"
    assert backend.volume_id(make_volume(subPath="a/b")) == "nfs:srv1:/export/a/b"
    assert backend.volume_id(make_volume(server="FD00::1")) == "nfs:[fd00::1]:/export"
