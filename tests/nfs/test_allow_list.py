"""The NFS mount-option allow-list: docs/volumes/nfs.md's "Allowed mountOptions" is the code's own list
(``flexhub_nfs._options.FLAGS`` and ``VALUED``), and examples written by hand (not derived from
the code) for every entry must pass both the schema and the backend's own check, while each
rejected one must fail before any command runs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from flexhub_nfs import NfsBackend
from flexhub_nfs._options import FLAGS, VALUED, build_plan

from flexhub.driver.validation import validate_options
from flexhub.errors import InvalidOptions
from flexhub.volume import Volume

DOC = Path(__file__).resolve().parents[2] / "docs" / "volumes" / "nfs.md"

DOCUMENTED_FLAGS = [
    "hard",
    "soft",
    "ro",
    "noatime",
    "relatime",
    "nodiratime",
    "nosuid",
    "nodev",
    "noexec",
    "ac",
    "noac",
    "cto",
    "nocto",
    "lock",
    "nolock",
    "sharecache",
    "nosharecache",
    "resvport",
    "noresvport",
    "rdirplus",
    "nordirplus",
    "acl",
    "noacl",
]
DOCUMENTED_VALUED = {
    "vers": ["3", "4", "4.0", "4.1", "4.2"],
    "nfsvers": ["3", "4.2"],
    "timeo": ["600"],
    "retrans": ["2"],
    "retry": ["0"],
    "rsize": ["1048576"],
    "wsize": ["65536"],
    "nconnect": ["1", "16"],
    "actimeo": ["30"],
    "acregmin": ["3"],
    "acregmax": ["60"],
    "acdirmin": ["30"],
    "acdirmax": ["60"],
    "sec": ["sys", "none", "krb5", "krb5i", "krb5p"],
    "proto": ["tcp", "tcp6", "rdma", "rdma6"],
    "port": ["2049"],
    "lookupcache": ["all", "none", "pos", "positive"],
    "local_lock": ["none", "all", "flock", "posix"],
    "mountport": ["20048"],
    "mountproto": ["tcp", "tcp6", "udp", "udp6"],
    "mountvers": ["3"],
}
V3_ONLY = {"mountport", "mountproto", "mountvers", "local_lock", "acl", "noacl"}

REJECTED = [
    "rw", "remount", "bind", "rbind", "move", "defaults", "auto", "user", "users", "suid", "dev",
    "exec", "fsc", "sloppy", "_netdev", "nofail", "x-mount.mkdir", "context=system_u",
    "clientaddr=10.0.0.1", "addr=10.0.0.9", "mountaddr=10.0.0.9", "mounthost=evil",
    "namlen=255", "fsc=cache", "nconnect=0", "nconnect=17", "proto=udp", "sec=ntlm",
    "lookupcache=some", "local_lock=maybe", "mountproto=sctp", "vers=2", "vers=5", "hard=1",
    "timeo=", "timeo=-1", "port=70000", "HARD", "hard ", "helper=/bin/sh",
]  # fmt: skip


def opts(mount_options: str, version: str | None) -> dict[str, str]:
    base = {
        "backend": "nfs",
        "server": "nfs1.example.com",
        "share": "/exports/team",
        "mountOptions": mount_options,
        "kubernetes.io/fsType": "",
        "kubernetes.io/readwrite": "rw",
        "kubernetes.io/pvOrVolumeName": "pv-nfs",
        "kubernetes.io/pod.uid": "0c9f-uid",
    }
    if version:
        base["nfsVersion"] = version
    return base


def accepted() -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = [
        (f, "3" if f in V3_ONLY else None) for f in DOCUMENTED_FLAGS
    ]
    for name, values in DOCUMENTED_VALUED.items():
        for value in values:
            version = value if name in ("vers", "nfsvers") else None
            out.append((f"{name}={value}", "3" if name in V3_ONLY else version))
    return out


def test_the_readme_documents_exactly_the_code_s_list() -> None:
    """The docs' allow-list is the backend's own (``FLAGS``, ``VALUED``), and the examples
    above give every one of them (so each is seen accepted below)."""
    text = DOC.read_text()
    section = text[text.index("**Allowed `mountOptions`**") :]
    section = section[: section.index("- **Errors")]
    documented = set(re.findall(r"\b([a-z_]+)=", section))
    assert documented == set(VALUED)
    flags = section[section.index("flags `") + 7 :]
    assert sorted(flags[: flags.index("`")].split()) == sorted(FLAGS)
    assert sorted(DOCUMENTED_FLAGS) == sorted(FLAGS) and set(DOCUMENTED_VALUED) == set(VALUED)


@pytest.mark.parametrize(("option", "version"), accepted())
def test_every_documented_option_is_accepted(option: str, version: str | None) -> None:
    raw = opts(option, version)
    validate_options(NfsBackend, raw)
    plan = build_plan(Volume.from_options(raw))
    assert option.replace("nfsvers=", "vers=") in plan.options


@pytest.mark.parametrize("option", REJECTED)
def test_anything_else_is_rejected(option: str) -> None:
    """The driver runs the schema, then the backend's check; one of them must refuse."""
    raw = opts(option, None)
    with pytest.raises(InvalidOptions):
        validate_options(NfsBackend, raw)
        build_plan(Volume.from_options(raw))
