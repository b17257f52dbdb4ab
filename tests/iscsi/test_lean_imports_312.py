"""The iSCSI import diet takes CPython's built-in SHA-256 from ``_sha2`` (CPython 3.12+)
or ``_sha256`` (before): on an interpreter without ``_sha256`` no iSCSI driver call loads
``hashlib`` (OpenSSL). The guard tests/iscsi/test_lean_imports.py only runs on the interpreter
CI uses; this one makes the 3.12 layout (``_sha2`` there, ``_sha256`` gone) by hand."""

from __future__ import annotations

from tests.iscsi.test_lean_imports import NOT_ON_IMPORT, loaded_by_the_import


def test_the_import_diet_holds_on_an_interpreter_without__sha256() -> None:
    loaded = loaded_by_the_import(
        "import _sha256\n"
        "sys.modules['_sha2'] = _sha256  # CPython >= 3.12: the module is _sha2 ...\n"
        "sys.modules['_sha256'] = None  # ... and _sha256 is gone\n"
    )
    assert "flexhub_iscsi._keys" in loaded
    assert sorted(loaded & set(NOT_ON_IMPORT)) == []
