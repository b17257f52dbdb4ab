"""``flexhub fence``: iSCSI fencing (SCSI-3 persistent reservations) from a person's seat:
this node's key, a takeover of a LUN whose holder died, the pending takeovers, and their
cancelling. Loads ``flexhub_iscsi`` only when a fence command runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from flexhub.errors import FlexhubError

__all__ = ["fence_app", "register"]

fence_app = typer.Typer(
    help="iSCSI fencing (SCSI-3 persistent reservations): this node's key, and taking over "
    "a LUN whose holder died.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


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


def register(app: typer.Typer) -> None:
    app.add_typer(fence_app, name="fence")
