"""The iSCSI backend's import, which every iSCSI driver call pays (in an emulated guest, about
2 s of Python start and imports a call), loads no module that only a few calls need: OpenSSL's
``hashlib``, ``hmac`` and ``secrets`` (a CHAP volume's digest, the node key's one creation),
and ``concurrent.futures`` (a multipath login's threads). Each is imported where it is used."""

from __future__ import annotations

import json
import subprocess
import sys

#: What ``import flexhub_iscsi`` (and the node's staging code a mount runs) must not load.
NOT_ON_IMPORT = ("hashlib", "_hashlib", "hmac", "secrets", "concurrent.futures", "random")


def loaded_by_the_import(setup: str = "") -> set[str]:
    """The modules ``import flexhub_iscsi, flexhub.node.staging`` loads in a fresh interpreter
    started as the driver is (``-I``), after ``setup`` (Python lines) ran."""
    code = (
        "import json, sys\n"
        f"{setup}"
        "before = set(sys.modules)\n"
        "import flexhub_iscsi, flexhub.node.staging\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return set(json.loads(out))


def test_the_backend_s_import_loads_no_module_only_some_calls_need() -> None:
    loaded = loaded_by_the_import()
    assert "flexhub_iscsi._chap" in loaded and "flexhub_iscsi._sessions" in loaded
    assert sorted(loaded & set(NOT_ON_IMPORT)) == []


def test_the_lazily_imported_digest_is_the_same_hmac() -> None:
    import hashlib
    import hmac

    from flexhub_iscsi import _chap

    key = b"k" * 32
    assert (
        _chap._digest(key, "user", "alice")
        == hmac.new(key, b"user\0alice", hashlib.sha256).hexdigest()
    )
    assert _chap._digest(key, "user", "") == ""
