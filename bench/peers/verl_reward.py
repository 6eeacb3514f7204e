"""verl's custom reward function for the synthetic task: Parallax's own verifier (tasks/synthetic.py).

verl loads this file by path (`reward.custom_reward_function.path`, bench/peers/verl_grpo.py) and calls
`compute_score` once per response.
"""

from __future__ import annotations


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """1.0 if the response's last \\boxed{} holds the ground truth, else 0.0."""
    from tasks.synthetic import verify

    return verify(solution_str, ground_truth)
