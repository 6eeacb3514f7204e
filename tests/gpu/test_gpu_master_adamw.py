"""On the GPU, MasterAdamW's host pipeline (pinned chunks, two copy streams) gives the same update as its
device location and as torch's fp32 AdamW on the master weights."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_host_pipeline_matches_device_and_fp32_reference():
    from learner.optim import MasterAdamW

    torch.manual_seed(0)
    shapes = [(37, 41), (5000,), (3, 999), (1,), (2048, 3)]  # chunk 1000: many chunks, ragged ends
    init = [torch.randn(s, device="cuda") * 0.02 for s in shapes]
    grads = [[torch.randn(s, device="cuda") for s in shapes] for _ in range(4)]

    def run(location):
        params = [torch.nn.Parameter(x.to(torch.bfloat16)) for x in init]
        opt = MasterAdamW(params, lr=1e-3, weight_decay=0.1, location=location, chunk=1000, staging=3)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.to(torch.bfloat16)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return params, opt

    host, host_opt = run("host")
    device, device_opt = run("device")
    assert all(host_opt.state[p]["master"].device.type == "cpu" for p in host)
    assert all(device_opt.state[p]["master"].device.type == "cuda" for p in device)
    ref = [torch.nn.Parameter(x.to(torch.bfloat16).float()) for x in init]
    ref_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.1)
    for step in grads:
        for p, g in zip(ref, step):
            p.grad = g.to(torch.bfloat16).float()
        ref_opt.step()
    for h, d, r in zip(host, device, ref):
        torch.testing.assert_close(host_opt.state[h]["master"], r.detach().cpu(), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(device_opt.state[d]["master"], r.detach(), rtol=1e-5, atol=1e-7)
        # the bf16 parameters are the master weights rounded (one bf16 step from the reference's rounding)
        assert torch.equal(h.detach().cpu(), host_opt.state[h]["master"].to(torch.bfloat16))
        torch.testing.assert_close(h.detach().float(), r.detach().float(), rtol=1 / 128, atol=0)
        torch.testing.assert_close(h.detach(), d.detach(), rtol=1 / 128, atol=0)
