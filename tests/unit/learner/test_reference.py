"""The KL reference model in host memory (learner/reference.py): FSDP2's CPU offload around the same model
gives the same logprobs, and where each location is built."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from learner.reference import offload_to_host, page_spans, reference_location
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


def test_offload_without_a_process_group_says_so(tiny_model):
    with pytest.raises(RuntimeError, match="needs a process group"):
        offload_to_host(copy.deepcopy(tiny_model), torch.device("cpu"))


def test_where_the_reference_is_built():
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert reference_location("host", gpu) == "host"
    assert reference_location("device", gpu) == "device"
    assert reference_location("auto", gpu) == "device"  # a learner started without a launcher's layout
    assert reference_location("host", cpu) == "device"  # on CPU the model is in host memory anyway


def test_page_spans_cover_every_block_and_register_each_page_once():
    page = 4096
    blocks = [(10 * page + 100, 50), (10 * page + 200, page), (20 * page, 2 * page), (30 * page - 8, 16)]
    spans = page_spans(blocks, page)
    assert spans == [(10 * page, 2 * page), (20 * page, 2 * page), (29 * page, 2 * page)]
    for addr, size in blocks:  # each block lies inside one span
        assert any(lo <= addr and addr + size <= lo + n for lo, n in spans)
    assert page_spans([], page) == []
