"""The launcher's GPU layout decisions: which GPUs each role gets, whether the learner's memory fits
beside vLLM, how large its training packs can be, and CUDA MPS on a shared GPU with its GEMM check.

indices.py checks the GPU lists, estimate.py estimates the memory, packs.py fits the training packs;
layout.py combines them into `plan_gpus` (-> `GpuPlan`). mps.py runs the MPS control daemon
(`python -m deploy.gpus.mps`), cap_check.py the GEMM check under a generator cap
(`python -m deploy.gpus.cap_check`).
"""
