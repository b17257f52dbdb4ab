"""Admin commands: backends, schema, validate, version, state, install, uninstall, doctor,
daemonset, demo, fence, new-backend."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from flexhub import DRIVER_NAME, __version__
from flexhub.cli.commands import COMMANDS
from flexhub.cli.provisioning import register as register_provisioning
from flexhub.errors import FlexhubError

app = typer.Typer(
    name="flexhub",
    help="flexhub: one FlexVolume driver for many kinds of storage.\n\n"
    "kubelet runs `flexhub <operation> ...` (init, mount, unmount, ...); "
    "the commands below are for people.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"flexhub {__version__}")
        raise typer.Exit(0)


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Print flexhub's version and exit.",
            is_eager=True,
            callback=_print_version,
        ),
    ] = False,
    debug: Annotated[
        bool, typer.Option("--debug", help="Show tracebacks and log records on stderr.")
    ] = False,
) -> None:
    """flexhub: one FlexVolume driver for many kinds of storage."""


@app.command()
def version() -> None:
    """Print flexhub's version."""
    typer.echo(f"flexhub {__version__}")


@app.command()
def backends() -> None:
    """List installed backends: distribution, version, and whether they import."""
    from flexhub.driver.loader import describe_backends

    infos = describe_backends()
    if not infos:
        typer.echo("no backends installed (entry-point group flexhub.backends)")
        raise typer.Exit(1)
    width = max(len(i.name) for i in infos)
    broken = False
    for info in infos:
        state = "ok" if not info.error else f"BROKEN: {info.error}"
        broken |= bool(info.error)
        typer.echo(
            f"{info.name:<{width}}  {info.distribution} {info.version}  {info.target}  {state}"
        )
    raise typer.Exit(1 if broken else 0)


@app.command()
def schema(name: Annotated[str, typer.Argument(help="backend name, e.g. loopfile")]) -> None:
    """Print a backend's JSON Schema."""
    from flexhub.driver.loader import load_backend

    typer.echo(json.dumps(load_backend(name).schema(), indent=2))


@app.command()
def validate(
    files: Annotated[
        list[Path],
        typer.Argument(
            help="manifests (YAML or JSON, several documents each), directories of them "
            "(*.yaml, *.yml, *.json), or an options JSON object; '-' = stdin"
        ),
    ],
    driver: Annotated[str, typer.Option(help="flexVolume.driver to check")] = DRIVER_NAME,
) -> None:
    """Report every problem of every flexhub volume (and flexhub StorageClass) in manifests,
    in the manifest's terms. Exit 1 when any has one; files without flexhub volumes are fine."""
    from flexhub.admin.manifest import validate_paths

    reports, empty = validate_paths(files, driver)
    for report in reports:
        for line in report.lines():
            typer.echo(line)
    for path in empty:
        typer.echo(f"{path}: no flexVolume with driver {driver}")
    raise typer.Exit(0 if all(r.ok for r in reports) else 1)


@app.command()
def state(
    config: Annotated[
        Path | None, typer.Option(help="node config (default: FLEXHUB_CONFIG)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Show the node's journal: staged volumes and pod directories, checked against mounts."""
    from flexhub.admin.state import node_state, render_state
    from flexhub.config import load_config

    result = node_state(load_config(config))
    if as_json:
        typer.echo(json.dumps(result, indent=2, sort_keys=True))
    else:
        for line in render_state(result):
            typer.echo(line)


@app.command()
def install(
    plugin_dir: Annotated[
        str | None,
        typer.Option("--plugin-dir", help="kubelet's --volume-plugin-dir (default: detected)"),
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="node config to export as FLEXHUB_CONFIG")
    ] = None,
    driver: Annotated[str, typer.Option(help="driver name vendor/name")] = DRIVER_NAME,
) -> None:
    """Install the driver executable into kubelet's plugin directory (atomically).

    Without --plugin-dir the directory is detected: kubelet's command line, its config
    file, then the distribution's default; the rule that decided is printed. The directory
    (and every one above it) must be root's and not writable by others; it is recorded in
    the state directory, where `doctor` finds it.
    """
    from flexhub.admin.install import install_on_node

    path, found = install_on_node(plugin_dir, config=config, driver=driver)
    if plugin_dir is None:
        typer.echo(f"plugin directory: {found.describe()}")
    typer.echo(str(path))


@app.command()
def daemonset(
    host_root: Annotated[Path, typer.Option(help="where the host's / is mounted")] = Path("/host"),
    plugin_dir: Annotated[
        str | None,
        typer.Option("--plugin-dir", help="kubelet's --volume-plugin-dir (default: detected)"),
    ] = None,
    config: Annotated[
        str | None, typer.Option(help="node config on the host, exported to the driver")
    ] = None,
    config_from: Annotated[
        Path | None,
        typer.Option(
            "--config-from",
            help="check this file (the chart's ConfigMap), write it to --config once installed",
        ),
    ] = None,
    runtime_dir: Annotated[
        str, typer.Option(help="where runtimes live on the host")
    ] = "/var/lib/flexhub/runtime",
    once: Annotated[bool, typer.Option("--once", help="install and exit")] = False,
    node_agent: Annotated[
        bool,
        typer.Option(
            "--node-agent",
            help="then reclaim this node's released PVs ($NODE_NAME; the pod's service account)",
        ),
    ] = False,
) -> None:
    """The DaemonSet's entrypoint: install this runtime and the driver onto the host, check
    the driver's init as kubelet runs it, then stay up (never uninstalls: see the README).
    With --node-agent it stays up as the node agent: the storage of released PVs on this
    node (loop files) is reclaimed by the installed driver, in the host, with its config."""
    import os

    from flexhub.admin.deploy import deploy, serve_forever

    node = os.environ.get("NODE_NAME", "")
    if node_agent and not once and not node:
        raise FlexhubError("--node-agent needs the node's name in NODE_NAME (spec.nodeName)")
    done = deploy(
        host_root,
        plugin_dir=plugin_dir,
        config=config,
        runtime_dir=runtime_dir,
        config_from=config_from,
    )
    summary = {
        "runtime": done.runtime,
        "driver": done.driver,
        "plugin_dir": done.plugin_dir.describe(),
        "removed": list(done.removed),
    }
    typer.echo(json.dumps({"flexhub": "installed", **summary}, sort_keys=True))
    if once:
        return
    if node_agent:
        from flexhub.admin.reclaim import host_reclaimer
        from flexhub.provisioner.service import run_node_agent

        run_node_agent(None, None, node, reclaim=host_reclaimer(host_root, done.driver))
        return
    serve_forever()


@app.command()
def doctor(
    plugin_dir: Annotated[
        str | None,
        typer.Option("--plugin-dir", help="kubelet's --volume-plugin-dir (default: detected)"),
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="node config (default: FLEXHUB_CONFIG)")
    ] = None,
    driver: Annotated[str, typer.Option(help="driver name vendor/name")] = DRIVER_NAME,
    host_root: Annotated[
        Path, typer.Option(help="where the host's / is mounted (in a container)")
    ] = Path("/"),
    probe: Annotated[
        bool, typer.Option("--probe", help="only the cheap checks (a liveness probe)")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Check this node: driver, init, directories, backends and their tools, journal."""
    from flexhub.admin.doctor import Doctor, render

    doc = Doctor(plugin_dir=plugin_dir, config=config, driver=driver, host_root=host_root)
    checks = doc.probe() if probe else doc.run()
    if as_json:
        typer.echo(json.dumps([c.to_json() for c in checks], indent=2))
    else:
        for line in render(checks):
            typer.echo(line)
    raise typer.Exit(1 if any(c.status == "fail" for c in checks) else 0)


@app.command()
def uninstall(
    plugin_dir: Annotated[Path, typer.Option("--plugin-dir", help="kubelet's --volume-plugin-dir")],
    driver: Annotated[str, typer.Option(help="driver name vendor/name")] = DRIVER_NAME,
    config: Annotated[
        Path | None,
        typer.Option(help="node config (default: the one the installed driver reads)"),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="remove the driver even while volumes are mounted")
    ] = False,
) -> None:
    """Remove the driver executable from a kubelet plugin directory.

    Refused while the node's journal shows flexhub volumes mounted (kubelet could not unmount
    them without the driver), unless --force.
    """
    from flexhub.admin.install import driver_path, mounted_volumes
    from flexhub.admin.install import uninstall as do_uninstall

    if not force:
        mounted = mounted_volumes(driver_path(plugin_dir, driver), config)
        if mounted:
            shown = ", ".join(mounted[:5]) + (
                f" and {len(mounted) - 5} more" if len(mounted) > 5 else ""
            )
            raise FlexhubError(
                f"{len(mounted)} flexhub volume(s) still mounted on this node ({shown}): "
                "without the driver kubelet cannot unmount them; drain the node first, "
                "or pass --force"
            )
    removed = do_uninstall(plugin_dir, driver=driver)
    typer.echo("removed" if removed else "nothing to remove")


@app.command()
def demo(
    keep: Annotated[bool, typer.Option(help="keep the temporary tree for inspection")] = False,
    fs_type: Annotated[str, typer.Option(help="filesystem: xfs, ext4 or ext3")] = "xfs",
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="show each call's arguments and reply")
    ] = False,
) -> None:
    """Replay kubelet's calls for a loopfile volume, for real (needs root)."""
    from flexhub.admin.demo import run_demo

    raise typer.Exit(run_demo(keep=keep, fs_type=fs_type, verbose=verbose))


@app.command("new-backend")
def new_backend(
    name: Annotated[str, typer.Argument(help="backend name: lowercase letters, digits, '_'")],
    directory: Annotated[
        Path, typer.Option("--directory", help="where to write flexhub-backend-NAME/")
    ] = Path("."),
) -> None:
    """Write a backend distribution flexhub-backend-NAME/ (pyproject with the entry point,
    schema, a working backend class, README, a test file using the conformance kit)."""
    from flexhub.admin.scaffold import new_backend as scaffold

    path = scaffold(name, directory)
    typer.echo(f"{path}: backend {name!r} written; see its README.md")


fence_app = typer.Typer(
    help="iSCSI fencing (SCSI-3 persistent reservations): this node's key, and taking over "
    "a LUN whose holder died.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(fence_app, name="fence")
register_provisioning(app)


def _iscsi_fencing() -> Any:
    try:
        import flexhub_iscsi._reservation as reservation
    except ImportError:
        raise FlexhubError("the iscsi backend (flexhub_iscsi) is not installed") from None
    return reservation


def _node_key(config: Path | None) -> tuple[Any, int]:
    from flexhub.config import load_config

    reservation = _iscsi_fencing()
    from flexhub_iscsi._options import Settings

    node = load_config(config)
    settings = Settings.from_table(node.backend_table("iscsi"))
    return node, reservation.node_key(node.state_dir, settings.reservation_key)


@fence_app.command("key")
def fence_key(
    config: Annotated[
        Path | None, typer.Option(help="node config (default: FLEXHUB_CONFIG)")
    ] = None,
) -> None:
    """Print this node's reservation key (what other nodes' errors name as the holder)."""
    reservation = _iscsi_fencing()
    _, key = _node_key(config)
    typer.echo(reservation.format_key(key))


def _fence_volume(volume: str) -> str:
    """``iscsi:<iqn>:<lun>`` as the backend names it (the LUN without leading zeros)."""
    prefix, _, lun = volume.rpartition(":")
    iqn = prefix.removeprefix("iscsi:")
    if not prefix.startswith("iscsi:") or not iqn or not lun.isdigit():
        raise FlexhubError(f"--volume {volume!r} is not iscsi:<target iqn>:<lun>")
    return f"iscsi:{iqn}:{int(lun)}"


def _ttl(text: str) -> float:
    """``--ttl``: seconds, or a number with ``s``, ``m`` or ``h``."""
    import re

    reservation = _iscsi_fencing()
    found = re.fullmatch(r"([0-9]{1,6})([smh]?)", text.strip())
    seconds = (
        int(found.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[found.group(2)] if found else 0
    )
    if not 0 < seconds <= reservation.MAX_TTL:
        raise FlexhubError(
            f"--ttl {text!r}: give seconds or a number with s, m or h, more than 0 and at most "
            f"{reservation.MAX_TTL // 3600}h"
        )
    return float(seconds)


def _reservation_here(volume: str, key: int, timeout: float) -> tuple[int | None, int] | None:
    """(holder, PR generation) of ``volume`` read through this node's own session to it, or
    ``None`` when this node has no path to the LUN."""
    reservation = _iscsi_fencing()
    from flexhub_iscsi._sysfs import Sysfs

    from flexhub.node.runner import SubprocessRunner

    iqn, _, lun = volume.removeprefix("iscsi:").rpartition(":")
    sysfs = Sysfs()
    devices = [
        str(sysfs.dev / disk)
        for session in sysfs.sessions()
        if session.target == iqn and session.logged_in
        for disk in sysfs.lun_disks(session, int(lun))
        if sysfs.node_exists(disk)
    ]
    if not devices:
        return None
    fence = reservation.Fence(SubprocessRunner(timeout=timeout), timeout, key, devices)
    holder, generation = fence.reservation()
    return holder, generation


@fence_app.command("preempt")
def fence_preempt(
    volume: Annotated[str, typer.Option(help="the volume: iscsi:<target iqn>:<lun>")],
    key: Annotated[str, typer.Option(help="the dead holder's key, as the error names it")],
    generation: Annotated[
        str | None,
        typer.Option(
            help="the reservation's PR generation, as the refused mount names it (read from "
            "the LUN instead when this node has a session to it)"
        ),
    ] = None,
    ttl: Annotated[
        str, typer.Option(help="how long the permission lasts: seconds, or with s, m, h")
    ] = "15m",
    config: Annotated[
        Path | None, typer.Option(help="node config (default: FLEXHUB_CONFIG)")
    ] = None,
) -> None:
    """Let this node's next read-write mount of VOLUME take it over from KEY (once).

    Only for a holder that is dead or cut off for good: its registrations are removed, so it
    can no longer write to the LUN even if it comes back. The permission expires after
    --ttl, and holds only while the reservation stays at the generation given (or read now):
    a holder that registers again meanwhile is alive, and the permission is void.
    """
    reservation = _iscsi_fencing()
    volume = _fence_volume(volume)
    holder = reservation.parse_key(key)
    given = reservation.parse_generation(generation) if generation is not None else None
    seconds = _ttl(ttl)
    node, own = _node_key(config)
    if holder == own:
        raise FlexhubError(
            f"{reservation.format_key(holder)} is this node's own key: nothing to preempt"
        )
    seen = _reservation_here(volume, own, node.command_timeout)
    if seen is not None:
        now_holder, now_generation = seen
        if now_holder != holder:
            who = reservation.format_key(now_holder) if now_holder is not None else "nobody"
            raise FlexhubError(
                f"{volume} is held by {who}, not by {reservation.format_key(holder)}: "
                "nothing allowed"
            )
        if given is not None and given != now_generation:
            raise FlexhubError(
                f"the reservation of {volume} is at PR generation {now_generation:#x}, not "
                f"{given:#x}: it changed since (the holder registered again?); nothing allowed"
            )
        given = now_generation
    elif given is None:
        raise FlexhubError(
            f"this node has no session to {volume} to read its reservation: pass --generation "
            "as the refused mount's message names it"
        )
    grant = reservation.authorize_preempt(node.state_dir, volume, holder, given, seconds)
    typer.echo(
        f"the next read-write mount of {volume} on this node will preempt key "
        f"{reservation.format_key(holder)} if that key still holds it at PR generation "
        f"{given:#x}, until {_utc(grant.expires)} (flexhub fence cancel --volume {volume} "
        "to withdraw it)"
    )


def _utc(moment: float) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(moment))


def _left(expires: float) -> str:
    import time

    seconds = int(expires - time.time())
    if seconds <= 0:
        return "expired"
    return f"in {seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"in {seconds}s"


@fence_app.command("list")
def fence_list(
    config: Annotated[
        Path | None, typer.Option(help="node config (default: FLEXHUB_CONFIG)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Show this node's pending preemption permissions: volume, key, generation, expiry.

    An expired one is shown as such; a mount never uses it (and deletes it when it meets it).
    """
    from flexhub.config import load_config

    reservation = _iscsi_fencing()
    grants = reservation.pending_preempts(load_config(config).state_dir)
    if as_json:
        typer.echo(json.dumps([g.to_json() for g in grants], indent=2))
        return
    if not grants:
        typer.echo("no pending preemption on this node")
        return
    rows = [("VOLUME", "KEY", "GENERATION", "EXPIRES")]
    rows += [
        (
            g.volume,
            reservation.format_key(g.key),
            f"{g.generation:#x}",
            f"{_utc(g.expires)} ({_left(g.expires)})",
        )
        for g in grants
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        cells = [row[i].ljust(widths[i]) for i in range(3)]
        typer.echo("  ".join([*cells, row[3]]))


@fence_app.command("cancel")
def fence_cancel(
    volume: Annotated[str, typer.Option(help="the volume: iscsi:<target iqn>:<lun>")],
    key: Annotated[
        str | None, typer.Option(help="cancel only if the permission is for this key")
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="node config (default: FLEXHUB_CONFIG)")
    ] = None,
) -> None:
    """Withdraw this node's pending permission to preempt a key of VOLUME."""
    from flexhub.config import load_config

    reservation = _iscsi_fencing()
    volume = _fence_volume(volume)
    only = reservation.parse_key(key) if key is not None else None
    state_dir = load_config(config).state_dir
    grant = reservation.pending_preempt(state_dir, volume)
    if grant is None:
        raise FlexhubError(f"no pending preemption of {volume} on this node")
    if only is not None and grant.key != only:
        raise FlexhubError(
            f"the pending preemption of {volume} is for key {reservation.format_key(grant.key)}, "
            f"not {reservation.format_key(only)}: nothing cancelled"
        )
    reservation.cancel_preempt(state_dir, volume)
    typer.echo(
        f"cancelled: this node will not preempt key {reservation.format_key(grant.key)} on {volume}"
    )


def main(args: list[str]) -> int:
    """Run an admin command; returns the exit code. Every error is one line on stderr (with
    ``--debug``, anywhere on the line: the traceback and the log records too)."""
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    _set_up_logging(debug)
    if not args or args[0] == "help":
        args = ["--help", *args[1:]] if args else ["--help"]
    if not args[0].startswith("-") and args[0] not in COMMANDS:
        from flexhub.errors import did_you_mean

        hint = did_you_mean(args[0], COMMANDS - {"help"}).strip(" ()") or "see flexhub --help"
        typer.echo(f"flexhub: unknown command {args[0][:80]!r}, {hint}", err=True)
        return 2
    try:
        result = app(args=args, prog_name="flexhub", standalone_mode=False)
    except typer.Exit as exc:
        return int(exc.exit_code)
    except FlexhubError as exc:
        typer.echo(f"flexhub: {exc.message}", err=True)
        return exc.exit_code
    except (KeyboardInterrupt, typer.Abort):
        typer.echo("flexhub: interrupted", err=True)
        return 130
    except Exception as exc:
        usage = getattr(exc, "format_message", None)
        if usage is not None:
            typer.echo(f"flexhub: {usage()}", err=True)
            return int(getattr(exc, "exit_code", 2))
        if debug:
            import traceback

            traceback.print_exc()
        typer.echo(f"flexhub: {_one_line(exc)}", err=True)
        return 1
    return int(result) if isinstance(result, int) else 0


def _one_line(exc: BaseException) -> str:
    from flexhub.errors import one_line

    if isinstance(exc, OSError) and exc.strerror:
        where = f"{exc.filename}: " if exc.filename else ""
        return one_line(f"{where}{exc.strerror}")
    return one_line(f"internal error: {type(exc).__name__}: {exc} (--debug shows where)")


def _set_up_logging(debug: bool) -> None:
    """Log records (a backend's import traceback among them) go to stderr only with
    ``--debug``; otherwise nowhere, not even Python's last-resort handler."""
    import logging

    root = logging.getLogger()
    if debug:
        logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(name)s: %(message)s")
    elif not root.handlers:
        root.addHandler(logging.NullHandler())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
