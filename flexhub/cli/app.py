"""Admin commands: backends, schema, validate, version, state, install, uninstall, doctor,
daemonset, demo, fence, new-backend, csi, convert."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from flexhub import DRIVER_NAME, __version__
from flexhub.cli.commands import COMMANDS
from flexhub.cli.convert import register as register_convert
from flexhub.cli.csi import register as register_csi
from flexhub.cli.fence import fence_app  # re-exported: the fence commands live there
from flexhub.cli.fence import register as register_fence
from flexhub.cli.provisioning import register as register_provisioning
from flexhub.errors import FlexhubError

__all__ = ["app", "fence_app", "main"]

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
    the driver's init as kubelet runs it, then stay up (never uninstalls: see
    docs/operators/upgrade.md).
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

    if config is not None and host_root == Path("/"):
        config = config.absolute()  # a host path: relative to here, not to host_root
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
        bool,
        typer.Option("--verbose", "-v", help="show each call's arguments and reply (whole lines)"),
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


register_fence(app)
register_provisioning(app)
register_csi(app)
register_convert(app)


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


#: Packages only some commands import (the provisioner and node agent, ``flexhub csi``), by
#: module: a runtime built with ``--profile node`` does not have them.
_OPTIONAL_PACKAGES = {"kubernetes": "kubernetes", "grpc": "grpcio", "google": "protobuf"}


def _one_line(exc: BaseException) -> str:
    from flexhub.errors import one_line

    if isinstance(exc, OSError) and exc.strerror:
        where = f"{exc.filename}: " if exc.filename else ""
        return one_line(f"{where}{exc.strerror}")
    missing = (exc.name or "").split(".")[0] if isinstance(exc, ModuleNotFoundError) else ""
    if missing in _OPTIONAL_PACKAGES:
        return one_line(
            f"this command needs the Python package {_OPTIONAL_PACKAGES[missing]!r}, which is not "
            "installed here (the node runtime and image leave it out: use the full one)"
        )
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
