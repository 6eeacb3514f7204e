"""Every stream, group and key name Parallax uses, in one place.

All names live under a namespace (default "parallax", one per run or test) so that several
runs can share one broker. Nothing else builds these strings by hand.
"""

from __future__ import annotations

from dataclasses import dataclass


def group_id(prompt_id: str, prompt_entry_id: str) -> str:
    """The rollout group id of one delivery of a prompt: the prompt's id and its entry id in the
    prompts stream. The feeder knows the entry ids it published, so it knows which groups to
    expect; a prompt published twice (a retried publish) gives two distinct group ids."""
    return f"{prompt_id}@{prompt_entry_id}"


@dataclass(frozen=True)
class Names:
    """Names under one namespace."""

    namespace: str = "parallax"

    # streams
    @property
    def prompts(self) -> str:
        """PromptRecords from the learner's feeder to the generators (one shared group)."""
        return f"{self.namespace}:prompts"

    @property
    def rollouts(self) -> str:
        """RolloutGroups from generators to reward workers."""
        return f"{self.namespace}:rollouts"

    @property
    def scored(self) -> str:
        """ScoredGroups from reward workers to the learner."""
        return f"{self.namespace}:scored"

    @staticmethod
    def dead(stream: str) -> str:
        """Dead-letter stream of `stream`."""
        return f"{stream}:dead"

    # consumer groups
    GENERATORS = "generators"
    REWARD = "reward"
    LEARNER = "learner"

    # blobs and values
    def blob(self, sha256: str) -> str:
        return f"{self.namespace}:blob:{sha256}"

    @property
    def learner_version(self) -> str:
        """Latest WeightVersion published by the learner."""
        return f"{self.namespace}:version:learner"

    def generator_version(self, generator_id: str) -> str:
        """Latest WeightVersion served by one generator."""
        return f"{self.namespace}:version:gen:{generator_id}"

    @property
    def feeder_cursor(self) -> str:
        """The learner's prompt feeder cursor (JSON), updated after every publish."""
        return f"{self.namespace}:feeder:cursor"

    def feeder_publish(self, position: int) -> str:
        """Idempotency key of the feeder's `position`-th training prompt publish (0-based, over the run)."""
        return f"{self.namespace}:feeder:publish:{position}"

    def reward_scored(self, group_id: str) -> str:
        """Publish-once state of one group in the reward service (claim / done / free)."""
        return f"{self.namespace}:reward:scored:{group_id}"

    @property
    def learner_lease(self) -> str:
        """The run's learner lease (broker/lease.py): one learner per run; `<it>:epoch` counts its takers."""
        return f"{self.namespace}:learner:lease"

    @property
    def weight_sync_address(self) -> str:
        """Where the learner's weight-sync rendezvous listens ("host:port")."""
        return f"{self.namespace}:weights:address"
