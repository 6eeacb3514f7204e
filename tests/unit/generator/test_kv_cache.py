"""The generator's KV-cache check (generator/engine.py kv_cache_warning): a cache too small for the configured
concurrency is a warning that says how many responses fit and which setting to change."""

from __future__ import annotations

from generator.engine import kv_cache_warning


def test_a_cache_that_holds_the_configured_concurrency_is_silent():
    assert kv_cache_warning(256 * 512, max_num_seqs=256, max_tokens=512) == ""
    assert kv_cache_warning(0, max_num_seqs=256, max_tokens=512) == ""  # unknown: nothing to say


def test_the_cpu_sized_cache_on_a_gpu_warns_with_the_fix():
    """A measured run: 0.25 GiB of a 3B model's KV cache = 7,280 tokens, 512-token responses."""
    warning = kv_cache_warning(7_280, max_num_seqs=256, max_tokens=512)
    assert "7,280 tokens" in warning and "131,072" in warning
    assert "at most 14 full-length responses" in warning
    assert "--generator.engine.gpu-memory-utilization" in warning
