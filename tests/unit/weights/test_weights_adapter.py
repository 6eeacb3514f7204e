"""The adapter payload: a LoRA-adapted model syncs its adapter alone, bit-exact, under PEFT's names, with
a manifest of kind "adapter"; digests name the content on both sides; a PEFT directory written from a
received version loads in peft."""

from __future__ import annotations

import json

import pytest
import torch
from weights_procs import announced_config, wait_until

import weights
from learner.lora import add_adapter
from learner.lora_config import LoraConfig
from policy.loading import load_model
from weights.adapter import (
    AdapterTensors,
    adapter_digest,
    adapter_params,
    is_adapted,
    peft_name,
    write_peft_dir,
)
from weights.config import BroadcastTransport, WeightSenderConfig


@pytest.fixture
def adapted(tiny_model_dir):
    model = load_model(tiny_model_dir)
    add_adapter(model, LoraConfig(rank=4, alpha=8.0), base_path=str(tiny_model_dir))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    return model


def test_adapter_round_trip_is_bit_exact_and_carries_its_config(adapted, tiny_model_dir, tmp_path):
    assert is_adapted(adapted) and not is_adapted(load_model(tiny_model_dir))
    sender = weights.sender(WeightSenderConfig(transport=BroadcastTransport(bucket_mb=0.01), timeout_s=10.0))
    sender.start()
    receiver = weights.receiver(announced_config(sender.announcement), "gen").start()
    try:
        wait_until(lambda: sender.members(), what="the receiver to join")
        report = sender.sync(adapted, version=1, step=1)
        expected = {peft_name(n): p for n, p in adapter_params(adapted)}
        assert report.num_bytes < sum(p.numel() * 4 for p in adapted.parameters()) / 5  # the adapter alone
        received = wait_until(receiver.poll, what="version 1")
        assert received.manifest.kind == "adapter" and len(received.manifest.bucket_nbytes) > 1
        pairs = list(received.named_tensors())
        assert {n for n, _ in pairs} == set(expected)
        for name, tensor in pairs:
            assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
        config = json.loads(received.manifest.adapter_config)
        assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
        assert adapter_digest(pairs) == AdapterTensors(adapted, "auto").digest()
        written = write_peft_dir(tmp_path / "v1", pairs, received.manifest.adapter_config)
        receiver.mark_served(1)
    finally:
        receiver.close()
        sender.close()
    from peft import PeftModel

    ids = torch.tensor([[5, 17, 300, 42, 7]])
    adapted.eval()
    with torch.no_grad():
        loaded = PeftModel.from_pretrained(load_model(tiny_model_dir), str(written)).eval()
        assert torch.equal(loaded(input_ids=ids).logits, adapted(input_ids=ids).logits)


def test_digest_changes_with_any_value_and_the_wire_dtype(adapted):
    wire = AdapterTensors(adapted, "keep")
    before = wire.digest()
    assert AdapterTensors(adapted, "bfloat16").digest() != before
    name, param = adapter_params(adapted)[-1]
    with torch.no_grad():
        param.view(-1)[3] += 1e-6
    assert wire.digest() != before
