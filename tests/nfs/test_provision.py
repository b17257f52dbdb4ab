"""Provisioning for nfs on the host: pathPattern rendering and its refusals, and the class
parameters' checks. The claim directory's make/remove/archive walk (flexhub.claimdir, shared
with cifs) is tested on real directories in tests/core/test_claimdir.py; the VM tests run it
against a real NFS export."""

from __future__ import annotations

import pytest
from flexhub_nfs import NfsBackend
from flexhub_nfs._provision import DEFAULT_MODE, directory, read

from flexhub.driver.validation import validate_options
from flexhub.errors import InvalidOptions
from flexhub.node.runner import RecordingRunner
from flexhub.pathpattern import DEFAULT_PATTERN, check_pattern, check_recorded, render
from flexhub.provisioning import Claim
from flexhub.volume import Secrets

UID = "3f9a1c2e-5b7d-4e8f-9a0b-1c2d3e4f5a6b"
CLAIM = Claim(
    uid=UID,
    namespace="team-a",
    name="db",
    size=1 << 30,
    annotations={"example.com/team": "payments", "bad": "..", "slash": "a/b"},
)
CLASS = {"server": "nfs.example.com", "share": "/exports/k8s"}


def validate_parameters(parameters: dict[str, str]) -> None:
    """What the provisioner does with a class's parameters: the schema, then the backend."""
    import jsonschema

    jsonschema.Draft202012Validator(NfsBackend.parameters_schema()).validate(parameters)
    NfsBackend.check_parameters(parameters)


# -- pathPattern -------------------------------------------------------------------------------


def test_default_pattern_renders_namespace_name_and_pv_name() -> None:
    assert render(DEFAULT_PATTERN, CLAIM) == f"team-a-db-pvc-{UID}"


def test_every_placeholder() -> None:
    pattern = "k8s/${annotations['example.com/team']}/${namespace}/${name}-${uid}-${pvName}"
    assert render(pattern, CLAIM) == f"k8s/payments/team-a/db-{UID}-pvc-{UID}"


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        ("/abs/${pvName}", "absolute"),
        ("../${pvName}", "'..' segment"),
        ("a/../${pvName}", "'..' segment"),
        ("./${pvName}", "'.' segment"),
        ("a//${pvName}", "empty segment"),
        ("a\n/${pvName}", "control character"),
        ("a\x7f/${pvName}", "control character"),
        ("a b/${pvName}", "only letters"),
        ("${nope}/${pvName}", "unknown placeholder"),
        ("$HOME/${pvName}", "'$'"),
        ("${namespace}", "last segment must hold"),
        ("${pvName}/data", "last segment must hold"),
        ("x" * 250 + "${pvName}", "longer than"),
    ],
)
def test_unsafe_patterns_are_refused_by_name(pattern: str, why: str) -> None:
    with pytest.raises(InvalidOptions, match=r"^invalid parameter \$\['pathPattern'\]: ") as info:
        render(pattern, CLAIM)
    assert why in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("key", "why"),
    [("bad", "'..' segment"), ("slash", "holds a '/'"), ("missing", "has no annotation")],
)
def test_an_annotation_cannot_leave_its_segment(key: str, why: str) -> None:
    """A claim's author writes its annotations: ``..``, a ``/`` or nothing is refused."""
    with pytest.raises(InvalidOptions, match="pathPattern") as info:
        render(f"${{annotations['{key}']}}/${{pvName}}", CLAIM)
    assert why in str(info.value)


def test_pattern_checked_without_a_claim() -> None:
    check_pattern("teams/${annotations['example.com/team']}/${pvName}")
    with pytest.raises(InvalidOptions, match="pathPattern"):
        check_pattern("teams/../${pvName}")


def test_two_claims_never_share_a_directory() -> None:
    other = Claim(uid=UID.replace("3f", "4f"), namespace="team-a", name="db", size=1)
    assert render(DEFAULT_PATTERN, CLAIM) != render(DEFAULT_PATTERN, other)


def test_a_claim_directory_is_never_inside_another_claims() -> None:
    """Finding 15: classes on one export with different segment counts, or an annotation a
    claim's author chooses, could render a segment equal to another claim's directory (whose
    name always holds that claim's uid), nesting this claim inside it (that one's delete then
    removes this one's data). A segment before the last that holds a uid is refused, in any
    letter case (an SMB server may match names without it)."""
    other = "9e8d7c6b-5a49-4382-a170-6f5e4d3c2b1a"
    claim = Claim(
        uid=UID,
        namespace=f"pvc-{other}",
        name="db",
        size=1,
        annotations={
            "pv": f"pvc-{other}",
            "default": f"team-a-db-pvc-{other}",
            "upper": f"PVC-{other.upper()}",
            "short": "PVC-9E~1",  # an SMB 8.3 short name of pvc-9e8d...
        },
    )
    for pattern, segment in [
        ("${annotations['pv']}/${pvName}", f"pvc-{other}"),
        ("k8s/${annotations['default']}/${pvName}", f"team-a-db-pvc-{other}"),
        ("${annotations['upper']}/${pvName}", f"PVC-{other.upper()}"),
        ("${namespace}/${name}-${uid}", f"pvc-{other}"),
        ("${annotations['short']}/${pvName}", "PVC-9E~1"),
    ]:
        with pytest.raises(
            InvalidOptions, match=r"^invalid parameter \$\['pathPattern'\]: "
        ) as info:
            render(pattern, claim)
        assert repr(segment) in str(info.value) and "\n" not in str(info.value), pattern
    # a class whose own pattern puts the uid before the last segment is refused beforehand
    for pattern in ("${pvName}/${uid}", "x/${uid}-data/${pvName}"):
        with pytest.raises(InvalidOptions, match=r"pathPattern.*claim's directory"):
            check_pattern(pattern)
        with pytest.raises(InvalidOptions, match="pathPattern"):
            NfsBackend.check_parameters({**CLASS, "pathPattern": pattern})
    # a segment with no uid, and a uid in the last segment only, stay as they were
    assert render("${annotations['example.com/team']}/${pvName}", CLAIM) == f"payments/pvc-{UID}"


def test_a_nested_claim_directory_is_refused_before_any_mount(
    backend: NfsBackend, runner: RecordingRunner
) -> None:
    """The refusal comes before the provisioner mounts the export: nothing is made."""
    claim = Claim(
        uid=UID,
        namespace="team-a",
        name="db",
        size=1,
        annotations={"x": "pvc-9e8d7c6b-5a49-4382-a170-6f5e4d3c2b1a"},
    )
    parameters = {**CLASS, "pathPattern": "${annotations['x']}/${pvName}"}
    with pytest.raises(InvalidOptions, match="pathPattern"):
        backend.provision(claim, parameters, Secrets())
    assert runner.calls == []


# -- the reclaim record --------------------------------------------------------------------------


def test_the_recorded_path_is_re_validated() -> None:
    path = f"team-a-db-pvc-{UID}"
    record = {"path": path, "claimUid": UID}
    assert check_recorded({"subPath": path}, record) == path
    for options, bad in [
        ({"subPath": path}, {"path": "../x", "claimUid": UID}),  # leaves the export
        ({"subPath": ""}, {"path": "", "claimUid": UID}),  # the export's root
        ({"subPath": "other"}, record),  # not the PV's subPath
        ({"subPath": "team"}, {"path": "team", "claimUid": UID}),  # no uid in its name
        ({"subPath": f"{UID}/data"}, {"path": f"{UID}/data", "claimUid": UID}),  # nor there
        ({"subPath": path}, {"path": path, "claimUid": "x"}),  # not a uid
    ]:
        with pytest.raises(InvalidOptions, match=r"reclaim|path"):
            check_recorded(options, bad)


# -- parameters ----------------------------------------------------------------------------------


def test_a_class_and_its_pv_options() -> None:
    parameters = {**CLASS, "nfsVersion": "4.2", "mountOptions": "noatime", "gid": "2000"}
    validate_parameters(parameters)
    spec = read(parameters)
    assert (spec.uid, spec.gid, spec.mode) == (0, 2000, DEFAULT_MODE)
    options = spec.pv_options(directory(spec, CLAIM))
    assert options == {
        "server": "nfs.example.com",
        "share": "/exports/k8s",
        "nfsVersion": "4.2",
        "mountOptions": "noatime",
        "subPath": f"team-a-db-pvc-{UID}",
    }
    validate_options(NfsBackend, {"backend": "nfs", **options})  # what the node accepts


def test_default_mode_is_not_world_writable() -> None:
    assert DEFAULT_MODE & 0o007 == 0 and DEFAULT_MODE == 0o2770


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"server": "bad host!"}, "server"),
        ({"share": "relative"}, "share"),
        ({"mountOptions": "ro"}, "mountOptions"),
        ({"mountOptions": "hard,soft"}, "hard"),
        ({"uid": "4294967295"}, "uid"),
        ({"gid": "-1"}, "gid"),
        ({"mode": "4770"}, "mode"),
        ({"mode": "0070"}, "mode"),
        ({"pathPattern": "../${pvName}"}, "pathPattern"),
        ({"subPath": "x"}, "subPath"),
    ],
)
def test_bad_parameters_are_one_line_naming_the_key(extra: dict[str, str], key: str) -> None:
    with pytest.raises(InvalidOptions) as info:
        NfsBackend.check_parameters({**CLASS, **extra})
    assert key in str(info.value) and "\n" not in str(info.value)
