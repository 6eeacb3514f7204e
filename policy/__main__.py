"""Command line of the policy package.

python -m policy build --preset tiny --out DIR [--seed 0]
python -m policy build --preset small            # into the cache; prints the directory
"""

from __future__ import annotations

import argparse
import logging
import sys

from policy.builder import PRESETS, build_tiny_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m policy")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build a random-weight Qwen2.5-VL checkpoint (HF format)")
    build.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--out", default=None, help="write exactly here (default: the cache directory)")
    build.add_argument("--cache-dir", default=None, help="cache root (default: ~/.cache/parallax/models)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    path = build_tiny_model(args.preset, seed=args.seed, cache_dir=args.cache_dir, out=args.out)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
