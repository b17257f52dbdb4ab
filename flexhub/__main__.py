"""Entry point: kubelet operations go to the lean dispatcher, anything else to the admin CLI."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["init"] or args[:1] == ["unmount"]:
        from flexhub.driver import quick

        code = quick.serve(args)  # answered before anything else is imported, or None
        if code is not None:
            return code
    from flexhub.driver.kubelet import OPERATIONS, serve

    if not args or args[0] in OPERATIONS or not _looks_human(args[0]):
        return serve(args)
    from flexhub.cli import run

    return run(args)


def _looks_human(word: str) -> bool:
    """Admin commands and ``--help``; anything else is an operation kubelet may add later."""
    from flexhub.cli import COMMANDS

    return word in COMMANDS or word.startswith("-")


if __name__ == "__main__":
    sys.exit(main())
