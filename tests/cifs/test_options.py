"""The cifs backend's options: schema, allow-list, SMB1, credentials, fsGroup, the plan."""

from __future__ import annotations

import re

import pytest
from flexhub_cifs import CifsBackend
from flexhub_cifs._options import (
    CREDENTIAL_OPTIONS,
    FLAGS,
    OWNERSHIP_OPTIONS,
    VALUED,
    build_plan,
    credentials,
)
from jsonschema import Draft202012Validator

from flexhub.backend import InvalidOptions
from tests.cifs.conftest import PASSWORD, volume

# -- the schema ------------------------------------------------------------------------------


def schema_validator() -> Draft202012Validator:
    schema = CifsBackend.schema()
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def test_schema_lint_rules_hold() -> None:
    """Every option has a description and examples that validate; every pattern is anchored
    (each alternative starts with ^ and ends with $); no property is a kubernetes.io/ key."""
    schema = CifsBackend.schema()
    validator = schema_validator()
    for name, prop in schema["properties"].items():
        assert not name.startswith("kubernetes.io/"), name
        assert prop.get("description"), name
        assert prop.get("examples"), name
        for example in prop["examples"]:
            sub = Draft202012Validator(prop)
            assert sub.is_valid(example), (name, example)
        pattern = prop.get("pattern")
        if pattern:
            for branch in re.split(r"\|(?=\^)", pattern):
                assert branch.startswith("^") and branch.endswith("$(?!\\n)"), (name, branch)
    assert validator.is_valid({"backend": "cifs", "server": "srv", "share": "team"})
    assert not validator.is_valid({"backend": "cifs", "server": "srv", "share": "a/b"})
    assert not validator.is_valid({"backend": "cifs", "server": "srv", "share": "x", "user": "b"})


def test_mount_options_description_names_the_allow_list() -> None:
    description = CifsBackend.schema()["properties"]["mountOptions"]["description"]
    for name in (*FLAGS, *(f"{v}=" for v in VALUED)):
        assert name in description, name


# -- the plan ----------------------------------------------------------------------------------


def test_default_plan() -> None:
    plan = build_plan(volume())
    assert plan.root_source == plan.source == "//files.example.com/team"
    assert plan.options == ("vers=default", "hard", "rw")
    assert CifsBackend.volume_id.__doc__ and "cifs://" in CifsBackend.volume_id.__doc__


def test_full_plan() -> None:
    plan = build_plan(
        volume(
            {
                "server": "Files.Example.COM",
                "vers": "3.1.1",
                "subPath": "a/b",
                "mountOptions": "soft,seal,cache=none,actimeo=1",
                "uid": "1000",
                "gid": "2000",
                "file_mode": "0640",
                "dir_mode": "750",
            },
            read_only=True,
        )
    )
    assert plan.host == "files.example.com" and plan.source == "//files.example.com/team/a/b"
    assert plan.options == (
        "vers=3.1.1",
        "soft",
        "seal",
        "cache=none",
        "actimeo=1",
        "uid=1000",
        "gid=2000",
        "file_mode=0640",
        "dir_mode=0750",
        "ro",
    )
    assert plan.read_only


def test_fs_group_defaults_gid_and_group_modes() -> None:
    assert build_plan(volume(fs_group=4321)).options == (
        "vers=default",
        "hard",
        "gid=4321",
        "file_mode=0770",
        "dir_mode=0770",
        "rw",
    )
    explicit = build_plan(volume({"gid": "7", "file_mode": "0600"}, fs_group=4321))
    assert "gid=7" in explicit.options and "file_mode=0600" in explicit.options
    assert "dir_mode=0770" in explicit.options


@pytest.mark.parametrize("vers", ["1.0", "1"])
def test_smb1_is_refused_clearly(vers: str) -> None:
    with pytest.raises(InvalidOptions, match=r"SMB1 \(vers 1(\.0)?\) is refused"):
        build_plan(volume({"vers": vers}))
    with pytest.raises(InvalidOptions, match="SMB1 is insecure"):
        build_plan(volume({"mountOptions": f"vers={vers}"}))


@pytest.mark.parametrize("vers", ["2.0", "3.1", "4", "3.1.1 "])
def test_unknown_dialects_are_refused(vers: str) -> None:
    with pytest.raises(InvalidOptions, match=r"is not one of 2\.1, 3, 3\.0, 3\.02, 3\.1\.1"):
        build_plan(volume({"vers": vers}))


@pytest.mark.parametrize("name", sorted(CREDENTIAL_OPTIONS))
def test_credentials_in_mount_options_are_refused_without_echo(name: str) -> None:
    with pytest.raises(InvalidOptions) as caught:
        build_plan(volume({"mountOptions": f"noatime,{name}={PASSWORD}"}))
    assert "credentials come only from the Secret" in caught.value.message
    assert PASSWORD not in caught.value.message and "Sup3r" not in caught.value.message


@pytest.mark.parametrize("name", OWNERSHIP_OPTIONS)
def test_ownership_in_mount_options_is_refused(name: str) -> None:
    with pytest.raises(InvalidOptions, match=f"use the option '{name}'"):
        build_plan(volume({"mountOptions": f"{name}=0"}))


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"mountOptions": "setuids"}, "not allowed"),
        ({"mountOptions": "noperm"}, "not allowed"),
        ({"mountOptions": "ip=10.0.0.1"}, "not allowed"),
        ({"mountOptions": "prefixpath=/x"}, "not allowed"),
        ({"mountOptions": "sec=krb5"}, "invalid value"),
        ({"mountOptions": "cache=loose"}, "invalid value"),
        ({"mountOptions": "port=0"}, "out of range"),
        ({"mountOptions": "hard,soft"}, "contradict"),
        ({"mountOptions": "seal,seal"}, "twice"),
        ({"mountOptions": "Seal"}, "lower-case"),
        ({"mountOptions": "cache"}, "use cache=..."),
        ({"server": "a_b"}, "server"),
        ({"server": "fd00::1"}, "server"),
        ({"server": "999.1.1.1"}, "server"),
        ({"share": "a/b"}, "share"),
        ({"share": ".hidden"}, "share"),
        ({"share": ""}, "share"),
        ({"subPath": "../etc"}, "subPath"),
        ({"subPath": "a//b"}, "subPath"),
        ({"uid": "4294967295"}, "uid"),
        ({"gid": "-1"}, "gid"),
        ({"file_mode": "4755"}, "file_mode"),
        ({"dir_mode": "0778"}, "dir_mode"),
    ],
)
def test_bad_options(options: dict[str, str], needle: str) -> None:
    with pytest.raises(InvalidOptions, match=re.escape(needle)):
        build_plan(volume(options))


def test_fs_type_must_be_empty_or_cifs() -> None:
    build_plan(volume(fs_type="cifs"))
    with pytest.raises(InvalidOptions, match="fsType"):
        build_plan(volume(fs_type="ext4"))


# -- credentials -------------------------------------------------------------------------------


def test_credentials_from_the_secret() -> None:
    creds = credentials(volume(secrets={"username": "bob", "password": PASSWORD}).secrets)
    assert creds.file_text() == f"username=bob\npassword={PASSWORD}\n".encode()
    assert PASSWORD not in repr(creds)
    with_domain = volume(secrets={"username": "bob", "password": "p", "domain": "CORP"}).secrets
    assert credentials(with_domain).file_text() == b"username=bob\npassword=p\ndomain=CORP\n"


@pytest.mark.parametrize(
    ("secrets", "needle"),
    [
        ({}, "missing: username, password"),
        ({"username": "bob"}, "missing: password"),
        ({"username": "bob\npassword=x", "password": "p"}, "'username'"),
        ({"username": "bob,uid=0", "password": "p"}, "'username'"),
        ({"username": "bob", "password": "p\nq"}, "'password'"),
        ({"username": "bob", "password": "p", "domain": "a\rb"}, "'domain'"),
        ({"username": "", "password": "p"}, "'username'"),
    ],
)
def test_bad_credentials_name_the_key_never_the_value(secrets: dict[str, str], needle: str) -> None:
    with pytest.raises(InvalidOptions) as caught:
        credentials(volume(secrets=secrets).secrets)
    assert needle in caught.value.message
    for value in secrets.values():
        if len(value) > 2:
            assert value not in caught.value.message
