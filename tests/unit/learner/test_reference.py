"""The KL reference model in host memory (learner/reference.py): FSDP2's CPU offload around the same model
gives the same logprobs, and where each location is built."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist

from learner.reference import SLAB_ALIGN, into_host_slab, offload_to_host, reference_location
from policy.forward import PackedPolicy
from policy.packing import pack


@pytest.fixture
def one_rank_group():
    from broker.redis_server import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_offloaded_reference_scores_like_the_plain_model(one_rank_group, tiny_processor, tiny_model):
    from tests.fixtures.models import make_samples

    pad = tiny_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    batch = pack(make_samples(tiny_processor, (1, 0, 1), seed=5), pad)
    plain = PackedPolicy(copy.deepcopy(tiny_model).eval(), chunk_size=16)
    ref = offload_to_host(copy.deepcopy(tiny_model).requires_grad_(False), torch.device("cpu"), chunk_size=16)
    with torch.no_grad():
        want, _ = plain(batch)
        got, _ = ref(batch)
        again, _ = ref(batch)  # blocks resharded after the first forward are gathered again
    assert type(next(ref.parameters())).__name__ == "DTensor"  # FSDP2 manages every weight
    assert want.shape == got.shape and want.numel() > 10
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(again, want, rtol=0, atol=0)


def test_offloaded_reference_compiled_elementwise_scores_like_the_eager_model(
    one_rank_group, tiny_processor, tiny_model
):
    """The learner's default `parallel.compile = "elementwise"`: the offloaded reference's norms and SiLU
    products are compiled beneath FSDP2's hooks, and its logprobs agree with the eager plain model's."""
    from tests.fixtures.models import make_samples

    pad = tiny_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    batch = pack(make_samples(tiny_processor, (1, 0, 1), seed=5), pad)
    plain = PackedPolicy(copy.deepcopy(tiny_model).eval(), chunk_size=16)
    model = copy.deepcopy(tiny_model).requires_grad_(False)
    ref = offload_to_host(model, torch.device("cpu"), chunk_size=16, compile_mode="elementwise")
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all(m._compiled_call_impl is not None for m in norms)
    assert ref.compile_logprobs
    with torch.no_grad():
        want, _ = plain(batch)
        got, _ = ref(batch)
        again, _ = ref(batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, got, rtol=0, atol=0)
    with pytest.raises(ValueError, match="elementwise or not at all"):
        offload_to_host(
            copy.deepcopy(tiny_model).requires_grad_(False), torch.device("cpu"), compile_mode="blocks"
        )


def test_offload_without_a_process_group_says_so(tiny_model):
    with pytest.raises(RuntimeError, match="needs a process group"):
        offload_to_host(copy.deepcopy(tiny_model), torch.device("cpu"))


def test_where_the_reference_is_built():
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert reference_location("host", gpu) == "host"
    assert reference_location("device", gpu) == "device"
    assert reference_location("auto", gpu) == "device"  # a learner started without a launcher's layout
    assert reference_location("host", cpu) == "device"  # on CPU the model is in host memory anyway


def test_the_offloaded_weights_live_in_the_slab_and_fsdp_reads_them_there(
    one_rank_group, tiny_processor, tiny_model
):
    """FSDP2 streams each block from the slab itself: every shard's storage is the slab's, and zeroing the
    slab zeroes the model (every logit 0: every token equally likely)."""
    from tests.fixtures.models import make_samples

    pad = tiny_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    batch = pack(make_samples(tiny_processor, (1, 0, 1), seed=5), pad)
    ref = offload_to_host(copy.deepcopy(tiny_model).requires_grad_(False), torch.device("cpu"), chunk_size=16)
    slab = next(ref.parameters()).to_local().untyped_storage()
    n_bytes = sum(p.to_local().nbytes for p in ref.parameters())
    assert n_bytes <= slab.nbytes() < n_bytes + SLAB_ALIGN * len(list(ref.parameters())) + 4096
    for param in ref.parameters():
        assert param.to_local().untyped_storage().data_ptr() == slab.data_ptr()
    with torch.no_grad():
        before, _ = ref(batch)
        torch.empty(0, dtype=torch.uint8).set_(slab).zero_()
        after, _ = ref(batch)
    vocab = tiny_model.lm_head.weight.shape[0]
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, torch.full_like(after, after[0].item()))  # every token equally likely
    assert abs(after[0].item() + math.log(vocab)) < 0.01  # over the vocabulary (less any ids it masks)


def test_a_plain_model_moves_into_the_slab_with_its_values():
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.LayerNorm(3)).requires_grad_(False)
    want = {name: p.clone() for name, p in model.named_parameters()}
    slab = into_host_slab(model)
    assert slab.numel() % 4096 == 0 and slab.numel() >= 4 * SLAB_ALIGN  # four shards, each aligned
    for name, param in model.named_parameters():
        assert param.untyped_storage().data_ptr() == slab.data_ptr()
        torch.testing.assert_close(param, want[name], rtol=0, atol=0)
