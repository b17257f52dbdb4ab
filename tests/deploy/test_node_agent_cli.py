"""`flexhub daemonset --node-agent` refuses to start without the node's name, before it
installs anything (the chart sets NODE_NAME from spec.nodeName)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_node_agent_without_node_name_fails_in_one_line_before_installing(tmp_path: Path) -> None:
    host = tmp_path / "host"
    host.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "flexhub", "daemonset", "--node-agent", "--host-root", str(host)],
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "flexhub: --node-agent needs the node's name in NODE_NAME (spec.nodeName)"
    ]
    assert list(host.iterdir()) == []  # nothing copied, nothing installed
