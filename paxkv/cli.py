"""The `paxkv` console script: `paxkv serve MODEL [flags]` (more subcommands may follow)."""
from __future__ import annotations

import sys
from typing import Sequence

_USAGE = "usage: paxkv serve MODEL [flags]   (paxkv serve --help for the flags)"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from paxkv.serve.cli import main as serve
        return serve(rest)
    print(f"paxkv: unknown command {command!r}\n{_USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
