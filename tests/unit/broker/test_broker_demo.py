"""broker.demo: the realistic workload and one short producer -> consumer run in real processes."""

from __future__ import annotations

from broker import codec
from broker.demo import format_table, image_png, realistic_group, run_pipeline
from broker.schemas import ImageRef


def test_realistic_group_has_the_benchmark_shape():
    group = realistic_group(3, ImageRef(sha256="ab" * 32))
    assert len(group.samples) == 8
    assert all(s.num_tokens == len(s.logprobs()) == 512 for s in group.samples)
    assert len(group.images) == 1
    assert 40_000 < len(codec.encode(group)) < 100_000  # 8 x 512 x (4 + 4) packed bytes + text
    assert 90_000 < len(image_png()) < 120_000


def test_short_typed_run_delivers_every_group(redis_server):
    result = run_pipeline(redis_server.url, "redis", "typed", groups=40, batch=16, max_len=8)
    assert result.groups == 40
    assert result.groups_per_s > 0
    assert "redis" in format_table([result])
