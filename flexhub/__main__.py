"""Entry point: who is calling, kubelet or a person?

The rule (docs/operators/troubleshoot.md, "kubelet's calls and people's commands"):

1. no argument: the help (kubelet always names an operation);
2. a kubelet operation (``init``, ``mount``, ...): the kubelet protocol, one JSON reply
   (``flexhub mount --help`` at a terminal prints the operation's arguments instead: kubelet
   never passes an option);
3. an admin command (``validate``, ``doctor``, ...) or an option (``--help``): the human CLI;
4. any other word: with a terminal on stdin, stdout or stderr, a person typed it: the CLI's
   "unknown command, did you mean ...?" on stderr, exit 2, nothing logged. Without one it is
   kubelet (kubelet gives a driver no terminal: stdin is ``/dev/null``, stdout and stderr one
   pipe), calling an operation of a later version: ``{"status": "Not supported"}`` as always.
"""

# (no ``from __future__ import annotations``: importing __future__ costs init 0.1 ms)
import os
import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["init"] or args[:1] == ["unmount"]:
        from flexhub.driver import quick

        code = quick.serve(args)  # answered before anything else is imported, or None
        if code is not None:
            return code
    from flexhub.driver.kubelet import OPERATIONS, serve

    if args[:1] and args[0] in OPERATIONS and set(args[1:2]) & {"-h", "--help"} and _at_terminal():
        from flexhub.driver.kubelet import USAGE

        print(
            f"Usage: flexhub {USAGE[args[0]]}\n\n  A kubelet (FlexVolume) call, answered with one "
            "JSON object.\n  People's commands: flexhub --help"
        )
        return 0
    if args and (args[0] in OPERATIONS or not (_looks_human(args[0]) or _at_terminal())):
        return serve(args)
    from flexhub.cli import run

    return run(args)


def _looks_human(word: str) -> bool:
    """Admin commands and options (``--help``, ``--version``)."""
    from flexhub.cli import COMMANDS

    return word in COMMANDS or word.startswith("-")


def _at_terminal() -> bool:
    """Whether a person is at a terminal: any of stdin, stdout and stderr is one."""
    return any(os.isatty(fd) for fd in (0, 1, 2))


if __name__ == "__main__":
    sys.exit(main())
