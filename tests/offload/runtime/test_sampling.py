"""Sampling and stopping (runtime/sampling.py, runtime/stopping.py): seeds, min_new_tokens, repetition
penalties, token history and stop strings, as vanilla generate does them."""

import pytest
import torch

import hf_scatter
from hf_scatter.offload import Policy
from hf_scatter.tiny import tiny_dbrx, tiny_mixtral

from offload_cases import (  # noqa: F401 - the autouse fixture
    BUILDERS, padded, requests, torch_kernels_on_cpu, vanilla_new_tokens,
)


def test_stop_strings_end_a_request(tokenizer):
    model = tiny_mixtral(seed=3)
    text = "The quick brown fox"
    off = hf_scatter.offload_model(model, gpu_memory="1GiB", device="cpu", policy=Policy(1, 1), release_weights=False,
                                   progress=False)
    free = off.generate(prompts=[text], tokenizer=tokenizer, max_new_tokens=12, return_dict=True, progress=False,
                        eos_token_id=[])
    decoded = tokenizer.decode(free.tokens[0][:6])
    stop = decoded[-2:] if decoded[-2:].strip() else decoded[-3:]
    stopped = off.generate(prompts=[text], tokenizer=tokenizer, max_new_tokens=12, return_dict=True,
                           progress=False, eos_token_id=[], stop_strings=[stop])
    n = len(stopped.tokens[0])
    assert n < 12 and stopped.tokens[0] == free.tokens[0][:n]
    assert stop in tokenizer.decode(stopped.tokens[0]) and stop not in tokenizer.decode(stopped.tokens[0][:-1])


# ----------------------------------------------------------------------------- sampling
def test_sampling_is_reproducible_with_a_seed():
    model = tiny_dbrx(seed=1)
    ids, mask = padded(requests())
    off = hf_scatter.offload_model(model, gpu_memory="1GiB", device="cpu", policy=Policy(4, 2), release_weights=False,
                                   progress=False)
    greedy = off.generate(ids, attention_mask=mask, max_new_tokens=12, progress=False, eos_token_id=[])
    sample = lambda **kw: off.generate(ids, attention_mask=mask, max_new_tokens=12, progress=False,  # noqa: E731
                                       eos_token_id=[], do_sample=True, **kw)
    a, b, c = sample(seed=7), sample(seed=7), sample(seed=8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, greedy)
    # processors: top-k 1, or a tiny top-p, leave only the most likely token
    assert torch.equal(sample(seed=3, top_k=1), greedy)
    assert torch.equal(sample(seed=3, top_p=1e-6, temperature=0.7), greedy)
    with pytest.raises(ValueError, match="temperature"):
        sample(seed=1, temperature=0.0)


# ----------------------------------------------------------------------------- model.generate's keywords
@pytest.mark.parametrize("family", ["mixtral", "dbrx"])
def test_min_new_tokens_hold_back_eos_as_vanilla_generate_does(family):
    model = BUILDERS[family]()
    reqs = requests()
    ids, mask = padded(reqs)
    alone = vanilla_new_tokens(model, reqs, 8, eos_token_id=[])
    # EOS = what greedy picks at step 1 for request 0 and at step 0 (the prefill) for request 2: both would end early
    eos = [alone[0][1], alone[2][0]]
    kw = dict(max_new_tokens=8, eos_token_id=eos, pad_token_id=0)
    vanilla = model.generate(ids, attention_mask=mask, do_sample=False, min_new_tokens=5, **kw)
    free = model.generate(ids, attention_mask=mask, do_sample=False, **kw)
    off = hf_scatter.offload_model(model, gpu_memory="1GiB", device="cpu",
                                   policy=Policy(3, 2, weights_gpu_fraction=0.5), release_weights=False, progress=False)
    assert torch.equal(off.generate(ids, attention_mask=mask, min_new_tokens=5, progress=False, **kw), vanilla)
    assert torch.equal(off.generate(ids, attention_mask=mask, progress=False, **kw), free)
    start = ids.shape[1]
    assert free[0, start + 1].item() in eos and free[2, start].item() in eos  # the constraint bites
    assert vanilla[0, start + 1].item() not in eos and vanilla[2, start].item() not in eos


@pytest.mark.parametrize("family", ["mixtral", "dbrx"])
def test_repetition_penalty_and_no_repeat_ngram_equal_vanilla_generate(family, monkeypatch):
    """Each request against transformers generating it alone: the penalty and the n-grams see the request's own
    tokens, never padding (transformers' batched generate leaves left padding out in 5.23; 5.17 penalised it)."""
    from hf_scatter.offload.runtime import cgopipe

    model = BUILDERS[family](seed=4)
    reqs = requests(seed=1)
    ids, mask = padded(reqs)
    off = hf_scatter.offload_model(model, gpu_memory="1GiB", device="cpu", policy=Policy(4, 2), release_weights=False,
                                   progress=False)
    # prefill chunks of part of a micro-batch, and the LM head one row at a time: every slice of the history
    monkeypatch.setattr(off.pipe, "chunk_tokens", 20)
    monkeypatch.setattr(cgopipe, "HEAD_ROWS", 1)
    greedy = vanilla_new_tokens(model, reqs, 12, eos_token_id=[])
    for kw in ({"repetition_penalty": 1.8}, {"repetition_penalty": 0.7}, {"no_repeat_ngram_size": 2},
               {"no_repeat_ngram_size": 1, "repetition_penalty": 1.3, "min_new_tokens": 3}):
        want = vanilla_new_tokens(model, reqs, 12, eos_token_id=[], **kw)
        assert want != greedy, kw  # the option changes what greedy picks
        got = off.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[], return_dict=True,
                           progress=False, **kw)
        assert got.tokens == want, kw


def test_the_token_history_of_a_short_prompt_holds_only_its_own_tokens():
    """A prompt shorter than its micro-batch's longest is padded in the history; the processors must not see that
    padding (here [5, 6, 5] padded with 5s would make (5, 5) a seen bigram and ban 5 after the last 5)."""
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

    from hf_scatter.offload.runtime.sampling import History, Sampling

    prompts = [torch.tensor([9, 9, 8, 9, 7, 9, 7]), torch.tensor([5, 6, 5])]
    history = History.of(prompts, 2, torch.device("cpu"))
    history.record(slice(None), 0, torch.tensor([3, 4]))
    logits = torch.randn(2, 12, generator=torch.Generator().manual_seed(0))
    for sampling, hf in ((Sampling(no_repeat_ngram_size=2), NoRepeatNGramLogitsProcessor(2)),
                         (Sampling(repetition_penalty=1.5), RepetitionPenaltyLogitsProcessor(1.5))):
        for new in (0, 1):  # before the first token (the prompts' own ends) and after it
            got = sampling._process(logits, history.view(slice(None), new))
            for i, p in enumerate(prompts):
                want = hf(torch.cat([p, history.tokens[i, 7:7 + new]])[None], logits[i:i + 1])
                assert torch.equal(got[i:i + 1], want), (sampling, new, i)
