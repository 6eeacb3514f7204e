"""The learner role (`python -m learner`): takes scored rollout groups, trains the policy with GRPO-style
updates under FSDP2, sends each new version's weights to the generators and checkpoints the run; also the
format warm start that runs before RL (`python -m learner.warmstart`)."""
