"""Provisioning for cifs on the host: the class parameters' checks and the PV options and Secret
they give. pathPattern itself is tested in tests/nfs/test_provision.py and the share-side walk
(flexhub.claimdir, shared with nfs) on real directories in tests/core/test_claimdir.py; the VM
tests run it against Samba."""

from __future__ import annotations

import pytest
from flexhub_cifs import CifsBackend
from flexhub_cifs._provision import read

from flexhub.driver.validation import validate_options
from flexhub.errors import InvalidOptions

CLASS = {
    "server": "files.example.com",
    "share": "k8s",
    "secretName": "smb-k8s",
    "secretNamespace": "flexhub",
}


def test_a_class_its_pv_options_and_secret() -> None:
    import jsonschema

    parameters = {**CLASS, "vers": "3.1.1", "uid": "1000", "mountOptions": "seal"}
    jsonschema.Draft202012Validator(CifsBackend.parameters_schema()).validate(parameters)
    spec = read(parameters)
    assert spec.secret == ("flexhub", "smb-k8s")
    options = spec.pv_options("team-a-db-pvc-x")
    assert options == {
        "server": "files.example.com",
        "share": "k8s",
        "vers": "3.1.1",
        "mountOptions": "seal",
        "uid": "1000",
        "dir_mode": "0770",
        "file_mode": "0660",
        "subPath": "team-a-db-pvc-x",
    }
    validate_options(CifsBackend, {"backend": "cifs", **options})


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"secretName": ""}, "secretName"),
        ({"secretNamespace": "Bad_NS"}, "secretNamespace"),
        ({"share": "a/b"}, "share"),
        ({"vers": "1.0"}, "vers"),
        ({"mountOptions": "password=hunter2"}, "password"),
        ({"mountOptions": "ro"}, "mountOptions"),
        ({"mode": "2770"}, "mode"),
        ({"fileMode": "x"}, "fileMode"),
        ({"uid": "99999999999"}, "uid"),
        ({"pathPattern": "/${pvName}"}, "pathPattern"),
        ({"pathPattern": "${pvName}/${uid}"}, "pathPattern"),  # a claim inside a claim
        ({"username": "u"}, "username"),
    ],
)
def test_bad_parameters_are_one_line_naming_the_key(extra: dict[str, str], key: str) -> None:
    with pytest.raises(InvalidOptions) as info:
        CifsBackend.check_parameters({**CLASS, **extra})
    message = str(info.value)
    assert key in message and "\n" not in message and "hunter2" not in message
