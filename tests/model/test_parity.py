"""Our decoder's logits equal transformers' for every supported architecture (fp32, 1e-4)."""

import pytest
import torch

from dflash.engine.model import UnsupportedArchitecture, ModelArgs
from tests.model.tiny import ARCHITECTURES, ours_from_hf, tiny_hf_model

ATOL = 1e-4


def hf_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(params=sorted(ARCHITECTURES))
def pair(request):
    hf = tiny_hf_model(request.param)
    return hf, ours_from_hf(hf)


def test_prefill_logits_match(pair):
    hf, ours = pair
    ids = [3, 17, 99, 5, 64, 2, 41, 8, 120, 77]
    kv = ours.new_kv_cache(64)
    logits, _ = ours(torch.tensor(ids), 0, kv, logits_positions=None)
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=ATOL, rtol=0)
    assert kv.length == len(ids)


def test_incremental_decode_and_multi_token_append_match(pair):
    hf, ours = pair
    ids = [3, 17, 99, 5, 64, 2, 41, 8, 120, 77, 11, 12]
    reference = hf_logits(hf, ids)
    kv = ours.new_kv_cache(64)
    ours(torch.tensor(ids[:4]), 0, kv)
    for position in range(4, 7):  # one token at a time
        logits, _ = ours(torch.tensor([ids[position]]), position, kv)
        torch.testing.assert_close(logits[0], reference[position], atol=ATOL, rtol=0)
    logits, _ = ours(torch.tensor(ids[7:]), 7, kv, logits_positions=None)  # several at once
    torch.testing.assert_close(logits, reference[7:], atol=ATOL, rtol=0)


def test_rollback_then_redecode_matches(pair):
    hf, ours = pair
    kv = ours.new_kv_cache(64)
    ours(torch.tensor([3, 17, 99, 5, 64, 2]), 0, kv)
    kv.crop(3)  # reject the last three tokens
    logits, _ = ours(torch.tensor([50, 51]), 3, kv, logits_positions=None)
    torch.testing.assert_close(logits, hf_logits(hf, [3, 17, 99, 50, 51])[3:], atol=ATOL, rtol=0)


def test_explicit_attention_mask_branches_like_separate_sequences():
    hf = tiny_hf_model("llama")
    ours = ours_from_hf(hf)
    kv = ours.new_kv_cache(64)
    ours(torch.tensor([3, 17, 99]), 0, kv)
    # Two sibling candidates for position 3 and 4: token 60 and token 61 each see only the prefix.
    mask = torch.tensor([[True, True, True, True, False], [True, True, True, False, True]])
    logits, _ = ours(torch.tensor([60, 61]), 3, kv, attention_mask=mask, logits_positions=None)
    torch.testing.assert_close(logits[0], hf_logits(hf, [3, 17, 99, 60])[3], atol=ATOL, rtol=0)
    # Position of the second sibling is 4 in RoPE terms; compare against the model seeing it at 4.
    kv2 = ours.new_kv_cache(64)
    ours(torch.tensor([3, 17, 99]), 0, kv2)
    kv2.length = 4  # a hole at position 3 that the mask hides
    alone, _ = ours(torch.tensor([61]), 4, kv2, attention_mask=torch.tensor([[True, True, True, False, True]]))
    torch.testing.assert_close(logits[1], alone[0], atol=ATOL, rtol=0)


def test_captured_hidden_states_equal_transformers_layer_outputs():
    hf = tiny_hf_model("qwen3")
    ours = ours_from_hf(hf)
    ids = [3, 17, 99, 5]
    kv = ours.new_kv_cache(64)
    _, captured = ours(torch.tensor(ids), 0, kv, capture_layers=(1, 0))
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(captured[0], states[2][0], atol=ATOL, rtol=0)
    torch.testing.assert_close(captured[1], states[1][0], atol=ATOL, rtol=0)


def test_snapshot_restore_gives_bit_identical_logits():
    ours = ours_from_hf(tiny_hf_model("qwen2"))
    kv = ours.new_kv_cache(64)
    ours(torch.tensor([3, 17, 99, 5, 64]), 0, kv)
    snap = kv.snapshot()
    assert snap.keys.shape[2] == 5  # right-sized: only [:length] is copied
    expected, _ = ours(torch.tensor([9]), 5, kv)
    ours(torch.tensor([1, 2, 3, 4]), 6, kv)  # move on and dirty the cache
    kv.restore(snap)
    again, _ = ours(torch.tensor([9]), 5, kv)
    assert torch.equal(expected, again)


def test_unsupported_architecture_names_it_and_the_supported_ones():
    with pytest.raises(UnsupportedArchitecture, match="GPTNeoXForCausalLM.*LlamaForCausalLM"):
        ModelArgs.from_hf_config({"architectures": ["GPTNeoXForCausalLM"]})
