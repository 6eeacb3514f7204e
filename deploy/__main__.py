"""All-in-one local launcher: `python -m deploy` (what `./run demo` runs).

Until every role has landed it runs the broker demo (rollout groups through Redis Streams and
ZeroMQ, with throughput); then it starts the whole pipeline (see deploy/launcher.py).
"""

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from broker.__main__ import main as broker_main

    return broker_main(["demo", *argv])


if __name__ == "__main__":
    sys.exit(main())
