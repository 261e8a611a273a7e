"""``lightning-tsp`` console script.

    lightning-tsp plan --model paper-7b --seq-len 131072 --gpus 1024 --gpus-per-node 8
    lightning-tsp demo --tsp-size 2 --steps 150

Subcommands import only what they need (``plan`` answers without importing torch).
"""

from __future__ import annotations

import sys

COMMANDS = {
    "plan": ("lightning_tsp.planning.cli", "which parallel layout fits a model, sequence length and cluster"),
    "demo": ("lightning_tsp.demo", "tiny TSP training on CPU processes on Python's own source text"),
}


def _usage() -> str:
    lines = ["usage: lightning-tsp COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<6} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"lightning-tsp: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    import importlib

    result = importlib.import_module(COMMANDS[name][0]).main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
