"""Command line of the tasks package: write Parallax prompt records for a task.

python -m tasks geometry3k --input train.parquet --out data/geo3k [--split train] [--model DIR]
python -m tasks synthetic --out data/shapes [--task colour] [--train 2000] [--test 64]
python -m tasks zoom --out data/zoom [--tool-free]       (a multi-turn task with the crop tool)

Each subcommand's options are its config dataclass (tasks/geometry3k.py, tasks/synthetic.py, tasks/zoom.py),
resolved by runtime.config.load_config (`--config FILE.toml` works too). Bad input (a parquet
without a needed column, no usable row) exits 1 with one line naming the problem.
"""

from __future__ import annotations

import sys

from tasks.geometry3k import BadInput, Geo3kConfig, preprocess
from tasks.synthetic import SyntheticConfig, write_task
from tasks.zoom import ZoomConfig
from tasks.zoom import write_task as write_zoom

COMMANDS = {
    "geometry3k": (Geo3kConfig, preprocess),
    "synthetic": (SyntheticConfig, write_task),
    "zoom": (ZoomConfig, write_zoom),
}


def main(argv: list[str] | None = None) -> int:
    from runtime.config import load_config
    from runtime.redact import setup_logging

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m tasks {{{','.join(COMMANDS)}}} [--help | options]", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    cls, run = COMMANDS[argv[0]]
    prog = f"python -m tasks {argv[0]}"
    config = load_config(cls, argv[1:], description=f"{prog}: {cls.__doc__}", prog=prog)
    setup_logging("INFO", "%(levelname)s %(name)s: %(message)s")
    try:
        manifest = run(config)
    except BadInput as exc:
        raise SystemExit(f"error: {exc}") from None
    print(manifest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
