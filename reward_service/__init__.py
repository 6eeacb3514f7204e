"""Parallax reward service: scores rollout groups, never hangs, scales out.

    python -m reward_service --workers N --broker.url redis://... --broker.namespace RUN   (see __main__.py)

Layout:
  rewards/    one reward function per module (math: mathruler accuracy + think-then-boxed format,
              EasyR1/veRL geo3k semantics; synthetic: the visual task's verifier), chosen per data
              source by the registry in rewards/__init__.py.
  grader.py   the grader process that runs reward functions (framed msgpack over pipes, memory cap).
  pool.py     SafeGrader: per-answer hard timeout, kill + warm spare, cache of identical items.
  scoring.py  GroupScorer: RolloutGroup -> one Score per sample, metrics per data source.
  dedupe.py   OnceGate: a group id is published once, whoever (re)delivers it.
  outbox.py   publish-once-then-ack, on its own thread so grading overlaps broker round trips.
  worker.py   one worker process's consume/score/publish/ack loop; __main__.py runs N of them.
"""
