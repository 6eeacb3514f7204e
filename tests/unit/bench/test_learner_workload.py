"""bench/learner_workload.py: the learner benches' synthetic groups hold exactly the image pads their images
fill, whatever tokenizer draws their random text."""

from types import SimpleNamespace

from bench.learner_workload import GroupMaker


class _Images:
    def put(self, png: bytes) -> str:
        return "ref"


def test_random_text_never_draws_an_added_token(tiny_processor):
    tok = tiny_processor.tokenizer
    cfg = SimpleNamespace(image_side=28, text=40, response=60, group_size=3)
    maker = GroupMaker(_Images(), tiny_processor, cfg, seed=3)
    added = set(tok.get_added_vocab().values())
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert pad in added
    drawn = maker._ids(20_000)  # the local tokenizer's ~1k ids: every one drawn many times over
    assert not added & set(drawn) and max(drawn) < min(added)
    for scored in maker.groups(8, version=0):
        assert scored.group.prompt_token_ids.count(pad) == 1
        assert all(pad not in s.token_ids() for s in scored.group.samples)
