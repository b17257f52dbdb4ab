"""VM test files CI leaves out for now, run by hand.

``test_iscsi_snapshots.py`` (iSCSI snapshots, restores and clones against the guest's real
LIO target; fileio 274 s and block 259 s, both passed on 2026-12-05) runs with
``FLEXHUB_VM_ISCSI_SNAPSHOTS=1``: with it, CI's VM groups ran far past the warm budget. The
same remote code runs on the host against real files, xfs and loop devices in
``tests/iscsi/test_lio_snapshots.py``, which CI runs.
"""

from __future__ import annotations

import os

collect_ignore = (
    [] if os.environ.get("FLEXHUB_VM_ISCSI_SNAPSHOTS") == "1" else ["test_iscsi_snapshots.py"]
)
