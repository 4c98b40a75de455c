"""The ``pdserve`` command line. Each subcommand imports its heavy modules lazily so that
``pdserve --help`` and the pure subcommands start fast."""
from __future__ import annotations

import sys

USAGE = """usage: pdserve COMMAND [ARGS]

commands:
  demo               replay the Azure trace through the schedulers on a simulated worker
  make-tiny-model    write a small random Llama-family model (HF format) to a directory
  bench-scheduler    time one full scheduler step (see bench/scheduler.py)

Run `pdserve COMMAND --help` for a command's options.
"""


def _demo(argv: list[str]) -> int:
    from pdserve.bench.sched_replay import main

    return main(argv)


def _make_tiny_model(argv: list[str]) -> int:
    from pdserve.workers.tiny_model import main

    return main(argv)


def _bench_scheduler(argv: list[str]) -> int:
    from pdserve.bench.scheduler import main

    return main(argv)


COMMANDS = {
    "demo": _demo,
    "make-tiny-model": _make_tiny_model,
    "bench-scheduler": _bench_scheduler,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"pdserve: unknown command {argv[0]!r}\n\n{USAGE}", end="", file=sys.stderr)
        return 2
    return int(command(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
