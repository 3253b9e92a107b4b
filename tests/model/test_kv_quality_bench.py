"""bench/kv_quality.py's simulated cache formats: the rounding they claim, and that a forward stores
through them (a bench that quietly measured the unquantized cache would report a format as free)."""

from __future__ import annotations

import torch

from bench.kv_quality import SimulatedCache, hadamard, perplexity, round_trip
from tests.model.tiny import ours_from_hf, tiny_hf_model


def test_the_hadamard_turn_is_its_own_inverse_and_keeps_dot_products():
    turn = hadamard(32)
    assert torch.allclose(turn @ turn, torch.eye(32), atol=1e-6)
    x, y = torch.randn(5, 32), torch.randn(5, 32)
    assert torch.allclose(((x @ turn) * (y @ turn)).sum(-1), (x * y).sum(-1), atol=1e-5)


def test_a_simulated_row_is_its_codes_times_one_scale():
    x = torch.randn(7, 2, 32)
    back = round_trip(x, (4, False), hadamard(32))
    scale = x.abs().amax(-1, keepdim=True) / 7
    codes = back / scale
    assert torch.allclose(codes, codes.round(), atol=1e-4) and codes.abs().max() <= 7 + 1e-4
    assert ((back - x).abs() <= scale / 2 + 1e-6).all()
    turned = round_trip(x, (4, True), hadamard(32))  # rounded in the turned basis, turned back
    assert not torch.allclose(turned, back) and (turned - x).norm() < x.norm()
    assert round_trip(x, "bf16", hadamard(32)) is x


def test_every_layer_of_a_forward_stores_through_the_simulated_format():
    model = ours_from_hf(tiny_hf_model("qwen3"))
    windows = [[(3 * i + 1) % 128 for i in range(40)], [(5 * i + 2) % 128 for i in range(40)]]
    exact = perplexity(model, model.new_kv_cache(48), windows)
    unquantized = SimulatedCache(model, 48, "bf16", "bf16")
    assert perplexity(model, unquantized, windows) == exact
    assert unquantized.writes == model.args.num_layers * len(windows)
    narrow = SimulatedCache(model, 48, (2, False), (2, False))
    assert perplexity(model, narrow, windows) != exact
