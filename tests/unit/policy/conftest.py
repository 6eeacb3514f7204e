"""Fixtures of the packed-forward tests, per model family (tests/fixtures/models.py `family_*`)."""

import copy

import pytest

from tests.fixtures.models import sharpen


@pytest.fixture(scope="module")
def sharp_model(family_model):
    """A copy of the family's tiny model whose logits depend strongly on positions and context."""
    return sharpen(copy.deepcopy(family_model)).eval()


@pytest.fixture(scope="module")
def ids(family_processor):
    """(pad token id, image pad token id) of the family's tokenizer."""
    tok = family_processor.tokenizer
    return tok.pad_token_id, tok.convert_tokens_to_ids("<|image_pad|>")
