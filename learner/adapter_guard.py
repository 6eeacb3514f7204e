"""The guard against LoRA's silent failure: training on samples that no published adapter generated.

With LoRA a generator can go on sampling an old adapter (or none: the base model) while it reports the
new version: verl's rollouts sampled the initial policy for two months because the adapter never reached
separate rollout GPUs. Versions alone cannot show that, so samples carry the content digest of the adapter
vLLM sampled them with (`Rollout.adapter`, weights/adapter.py `adapter_digest`; "" = no adapter), and the
learner records the digest of every adapter it publishes:

    guard = AdapterGuard(initial_version=0)              # version 0 is the base model: digest ""
    guard.publish(version, digest)                        # after every sync (the digest of what was sent)
    kept, refused = guard.check(groups)                   # a group whose samples' digests differ is refused

A refused group is logged with what it should have been sampled with and counted
(`adapter_mismatch` in the step's metrics); a step whose every group is refused raises, since the
generators then serve nothing the learner published. The digests of the last versions go into checkpoints
(`state()`), so groups sampled before a restart are still checked.
"""

from __future__ import annotations

import logging

from broker.schemas import ScoredGroup

log = logging.getLogger(__name__)

KEEP = 64
"""Versions whose digests are remembered (far beyond any staleness bound)."""
STATE_KEY = "adapter_digests"
"""Key of the remembered digests in a checkpoint's trainer state `extra`."""


class AdapterMismatch(RuntimeError):
    """Every group of a step was sampled with an adapter the learner did not publish for its version."""


class AdapterGuard:
    """See the module docstring."""

    def __init__(self, initial_version: int = 0, saved: dict | None = None):
        self.published: dict[int, str] = {initial_version: ""}
        for version, digest in (saved or {}).items():
            self.published[int(version)] = digest

    def publish(self, version: int, digest: str) -> None:
        """`version` was published with the adapter of `digest`."""
        self.published[version] = digest
        for old in sorted(self.published)[:-KEEP]:
            del self.published[old]

    def state(self) -> dict[str, str]:
        """The remembered digests, for a checkpoint (JSON keys are strings)."""
        return {str(v): d for v, d in sorted(self.published.items())}

    def problem(self, group: ScoredGroup) -> str | None:
        """Why the group's samples cannot be trained on (None when each carries its version's adapter)."""
        for sample in group.group.samples:
            expected = self.published.get(sample.version_start)
            if expected is None and sample.version_start < max(self.published):
                continue  # forgotten, or lost to a crash: the staleness filter judges it
            if expected is None:
                return f"version {sample.version_start} is newer than any this learner published"
            if sample.adapter != expected:
                got = sample.adapter or "no adapter (the base model)"
                want = expected or "no adapter (the base model)"
                return f"version {sample.version_start} sampled with adapter {got}, published {want}"
        return None

    def check(self, groups: list[ScoredGroup]) -> tuple[list[ScoredGroup], int]:
        """(groups to train on, how many were refused); raises AdapterMismatch when none is left."""
        kept = []
        for group in groups:
            problem = self.problem(group)
            if problem is None:
                kept.append(group)
                continue
            log.error(
                "group %s from generator %s refused: %s",
                group.group.group_id,
                group.group.generator_id,
                problem,
            )
        if groups and not kept:
            raise AdapterMismatch(
                f"all {len(groups)} groups of the step were sampled with adapters this learner did not "
                "publish "
                "for their versions: the generators are not serving the synced adapters"
            )
        return kept, len(groups) - len(kept)
