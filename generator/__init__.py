"""The generator role (`python -m generator`): a vLLM engine per GPU that turns prompt records into
rollout groups with behaviour logprobs, admits a prompt only on recent enough weights (the staleness
gate) and swaps in each new policy version the learner sends."""
