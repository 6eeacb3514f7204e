"""GeneratorConfig.validate's derived engine.max_num_seqs: every sequence of a generate call at once."""

from __future__ import annotations

import logging

import pytest

from generator.config import MIN_SEQS, EngineConfig, GeneratorConfig, SamplingConfig


def test_max_num_seqs_0_runs_a_whole_generate_call_at_once():
    """The end-to-end bench's call: 128 prompts x 5 samples = 640 sequences (256 ran them in three waves)."""
    cfg = GeneratorConfig(batch_prompts=128, sampling=SamplingConfig(n=5))
    cfg.validate()
    assert cfg.engine.max_num_seqs == 640
    continuous = GeneratorConfig(
        continuous=True, batch_prompts=8, max_inflight_prompts=200, sampling=SamplingConfig(n=4)
    )
    continuous.validate()
    assert continuous.engine.max_num_seqs == 800  # what may be in flight, not one admission
    small = GeneratorConfig(batch_prompts=8, sampling=SamplingConfig(n=2))
    small.validate()
    assert small.engine.max_num_seqs == MIN_SEQS


def test_an_explicit_max_num_seqs_is_kept_and_a_call_it_splits_is_named(caplog):
    cfg = GeneratorConfig(
        batch_prompts=64, sampling=SamplingConfig(n=5), engine=EngineConfig(max_num_seqs=256)
    )
    with caplog.at_level(logging.WARNING, logger="generator.config"):
        cfg.validate()
    assert cfg.engine.max_num_seqs == 256
    assert "below the 320 sequences of one generate call" in caplog.text and "2 waves" in caplog.text
    with pytest.raises(ValueError, match="max_num_seqs"):
        GeneratorConfig(engine=EngineConfig(max_num_seqs=-1)).validate()
