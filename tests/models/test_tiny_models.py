"""The shared tiny-model builders: offline, seeded, and matching the byte-level tokenizer."""

import pytest
import torch

from hf_scatter.tiny import TINY_BUILDERS, tiny_bert


def test_tokenizer_round_trips_any_text(tokenizer):
    text = "Ünïcödé, emoji 🙂 and tabs\t all encode at the byte level"
    ids = tokenizer(text).input_ids
    assert max(ids) < len(tokenizer)
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("family", sorted(TINY_BUILDERS))
def test_builders_are_seeded_and_run(family, tokenizer):
    a, b, c = TINY_BUILDERS[family](seed=1), TINY_BUILDERS[family](seed=1), TINY_BUILDERS[family](seed=2)
    for (name, pa), (_, pb), (_, pc) in zip(a.state_dict().items(), b.state_dict().items(), c.state_dict().items()):
        assert torch.equal(pa, pb), name
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))
    ids = tokenizer("a small batch of text", return_tensors="pt").input_ids
    out = a(ids)
    assert torch.isfinite(out[0]).all()


def test_odd_sizes():
    from hf_scatter.tiny import tiny_mixtral

    model = tiny_mixtral(hidden=72, experts=6, top_k=3, intermediate=100, heads=6, kv_heads=3)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (6, 200, 72)


def test_unknown_bert_head_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown head"):
        tiny_bert(head="qa")
