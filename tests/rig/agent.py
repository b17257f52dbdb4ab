"""Guest agent of the flexhub VM rig (stdlib only, runs inside the guest; the
rig starts it with /usr/bin/python3 so that the ``lio`` op can use rtslib).

Reads one JSON request per line from the virtio-serial port named ``rig`` and
answers one JSON line per request.  Requests::

    {"id": 1, "op": "run", "argv": [...], "timeout": 60, "input": null,
     "env": null, "cwd": null, "merge": false, "background": false}
    {"id": 2, "op": "ping"}
    {"id": 3, "op": "write_file", "path": "/x", "data": "<base64>", "mode": 420}
    {"id": 4, "op": "read_file", "path": "/x"}
    {"id": 5, "op": "lio", "action": "create", "spec": {...}}   (see lio.py)

``run`` executes argv without a shell in a new session, stdin from ``input``
or /dev/null, stdout/stderr to temporary files (so daemons that keep the
descriptors open never block the answer).  On timeout the whole process group
is killed and the answer has ``timed_out`` set and rc 124.

With ``--pid1`` the agent is PID 1: it forks the serving process, reaps every
orphan, and powers the guest off (sysrq ``o``) when the serving process ends,
staying alive itself so the kernel never panics.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PORT_NAME = "rig"
MAX_OUTPUT = 4 * 1024 * 1024
DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
}


def find_port() -> str:
    """Return the /dev node of the virtio-serial port named ``rig``."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for entry in Path("/sys/class/virtio-ports").glob("*"):
            try:
                name = (entry / "name").read_text().strip()
            except OSError:
                continue
            if name == PORT_NAME:
                dev = Path("/dev") / entry.name
                if dev.exists():
                    return str(dev)
        time.sleep(0.05)
    raise SystemExit("rig-agent: virtio port 'rig' not found")


def _read_capped(path: str) -> str:
    with open(path, "rb") as fh:
        data = fh.read(MAX_OUTPUT + 1)
    text = data[:MAX_OUTPUT].decode("utf-8", errors="replace")
    if len(data) > MAX_OUTPUT:
        text += "\n[rig-agent: output truncated]\n"
    return text


def op_run(req: dict[str, Any]) -> dict[str, Any]:
    """Run one command and collect its result."""
    argv = req["argv"]
    timeout = float(req.get("timeout") or 60)
    env = dict(DEFAULT_ENV) if req.get("env") is None else dict(req["env"])
    env.update(req.get("env_add") or {})
    cwd = req.get("cwd") or "/"
    data = req.get("input")
    with tempfile.TemporaryDirectory(prefix="rig-run-") as tmp:
        out_path = os.path.join(tmp, "out")
        err_path = os.path.join(tmp, "err")
        in_path = os.path.join(tmp, "in")
        if data is not None:
            Path(in_path).write_text(data)
        else:
            in_path = os.devnull
        with open(in_path, "rb") as fin, open(out_path, "wb") as fout:
            ferr = fout if req.get("merge") else open(err_path, "wb")  # noqa: SIM115
            try:
                if req.get("background"):
                    log = req.get("log") or os.devnull
                    with open(log, "ab") as flog:
                        proc = subprocess.Popen(
                            argv,
                            stdin=subprocess.DEVNULL,
                            stdout=flog,
                            stderr=subprocess.STDOUT,
                            env=env,
                            cwd=cwd,
                            start_new_session=True,
                        )
                    return {
                        "rc": 0,
                        "pid": proc.pid,
                        "stdout": "",
                        "stderr": "",
                        "timed_out": False,
                    }
                start = time.monotonic()
                proc = subprocess.Popen(
                    argv,
                    stdin=fin,
                    stdout=fout,
                    stderr=ferr,
                    env=env,
                    cwd=cwd,
                    start_new_session=True,
                )
            except OSError as exc:
                return {
                    "rc": 127,
                    "stdout": "",
                    "stderr": f"rig-agent: {exc}\n",
                    "timed_out": False,
                }
            finally:
                if ferr is not fout:
                    ferr.close()
            timed_out = False
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = 124
        return {
            "rc": rc,
            "stdout": _read_capped(out_path),
            "stderr": "" if req.get("merge") else _read_capped(err_path),
            "timed_out": timed_out,
            "duration": time.monotonic() - start,
        }


def op_write_file(req: dict[str, Any]) -> dict[str, Any]:
    path = Path(req["path"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(req["data"]))
    os.chmod(path, int(req.get("mode", 0o644)))
    return {"rc": 0}


def op_read_file(req: dict[str, Any]) -> dict[str, Any]:
    try:
        data = Path(req["path"]).read_bytes()
    except OSError as exc:
        return {"rc": 1, "stderr": str(exc)}
    return {"rc": 0, "data": base64.b64encode(data).decode()}


_LIO: Any = None


def op_lio(req: dict[str, Any]) -> dict[str, Any]:
    """Run an action of lio.py (next to this file) in-process: rtslib is
    imported once instead of once per call.  rc 126 if rtslib is missing."""
    global _LIO
    if _LIO is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        try:
            import lio  # type: ignore[import-not-found]
        except ImportError as exc:
            return {"rc": 126, "stderr": f"rig-agent: {exc}\n"}
        _LIO = lio
    return {"rc": 0, "result": _LIO.ACTIONS[req["action"]](req["spec"])}


OPS = {
    "ping": lambda req: {"rc": 0},
    "lio": op_lio,
    "run": op_run,
    "write_file": op_write_file,
    "read_file": op_read_file,
}


def handle(line: bytes) -> bytes | None:
    try:
        req = json.loads(line)
    except ValueError:
        return None
    try:
        resp = OPS[req.get("op", "run")](req)
    except Exception as exc:
        resp = {"rc": 125, "stderr": f"rig-agent: {type(exc).__name__}: {exc}\n"}
    resp["id"] = req.get("id")
    return json.dumps(resp).encode() + b"\n"


def serve(port: str) -> None:
    """Serve requests from the port forever."""
    fd = os.open(port, os.O_RDWR)
    buf = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            chunk = b""
        if not chunk:  # host not connected: poll again shortly
            time.sleep(0.05)
            continue
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            answer = handle(line)
            if answer is not None:
                view = memoryview(answer)
                while view:
                    view = view[os.write(fd, view) :]


def pid1() -> None:
    """Be init: fork the server, reap orphans, power off when it ends."""
    child = os.fork()
    if child == 0:
        os.setsid()
        try:
            serve(find_port())
        finally:
            os._exit(1)
    while True:
        try:
            pid, _ = os.wait()
        except ChildProcessError:
            time.sleep(1)
            continue
        if pid == child:
            break
    with contextlib.suppress(OSError):
        Path("/proc/sysrq-trigger").write_text("o")
    while True:
        time.sleep(3600)


def main() -> None:
    if "--pid1" in sys.argv[1:]:
        pid1()
    else:
        serve(sys.argv[1] if len(sys.argv) > 1 else find_port())


if __name__ == "__main__":
    main()
