"""Command line of the tasks package.

python -m tasks geometry3k --input train.parquet --out data/geo3k [--split train] [--model DIR]
python -m tasks synthetic --out data/shapes [--task colour] [--train 2000] [--test 64]
"""

from __future__ import annotations

import logging
import sys

import tyro

from tasks.geometry3k import Geo3kConfig, preprocess
from tasks.synthetic import SyntheticConfig, write_task


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = tyro.extras.subcommand_cli_from_dict(
        {"geometry3k": Geo3kConfig, "synthetic": SyntheticConfig},
        args=argv,
        description="Write Parallax prompt records for a task.",
    )
    manifest = preprocess(config) if isinstance(config, Geo3kConfig) else write_task(config)
    print(manifest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
