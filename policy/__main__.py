"""Command line of the policy package.

python -m policy build --preset tiny --out DIR [--seed 0]
python -m policy build --preset small            # into the cache; prints the directory
python -m policy build --preset qwen2.5-vl-7b --out DIR --device cuda   # published shapes, bf16
"""

from __future__ import annotations

import argparse
import logging
import sys

from policy.builder import build_checkpoint
from policy.presets import PRESETS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m policy")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build a random-weight Qwen2.5-VL checkpoint (HF format)")
    build.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--out", default=None, help="write exactly here (default: the cache directory)")
    build.add_argument("--cache-dir", default=None, help="cache root (default: ~/.cache/parallax/models)")
    build.add_argument(
        "--device", default="cpu", help="where to build the weights (cuda for the large presets)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    path = build_checkpoint(
        args.preset, seed=args.seed, cache_dir=args.cache_dir, out=args.out, device=args.device
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
