"""native/logits.cpp: the greedy argmax and the bf16 -> fp32 widening a step applies to its logits
are torch's, value for value and index for index (the first largest; NaN above everything), on
every row length (the lanes' tail included). Skipped where the extension is not built."""

import pytest
import torch

from dflash.engine.native import extension
from dflash.engine.sampling import greedy_token, greedy_tokens

pytestmark = pytest.mark.skipif(extension() is None, reason="the native extension is not built")


@pytest.fixture(params=["lanes", "scalar"], autouse=True)
def path(request, monkeypatch):
    """Both of argmax_rows' paths (16 lanes where the CPU has AVX512, else scalar)."""
    if request.param == "scalar":
        monkeypatch.setenv("DFLASH_ARGMAX", "scalar")
    return request.param


@pytest.mark.parametrize("width", [1, 7, 16, 33, 49152])
def test_argmax_rows_is_torch_argmax(width):
    generator = torch.Generator().manual_seed(width)
    rows = torch.randn(6, width, generator=generator)
    rows[1] = rows[1].round()  # many ties: the first of the largest wins
    rows[2] = 1.0  # all equal: index 0
    rows[3, width // 2 :] = float("inf")  # ties at +inf
    rows[4] = float("-inf")
    rows[5, -1] = rows[5].max() + 1  # the largest in the last lane or the tail
    assert torch.equal(extension().argmax_rows(rows), rows.argmax(dim=-1))
    assert all(greedy_token(row) == int(row.argmax()) for row in rows)
    assert torch.equal(greedy_tokens(rows), rows.argmax(dim=-1))


@pytest.mark.parametrize("where", [0, 5, 17, 49151])
def test_argmax_rows_puts_nan_above_everything_as_torch_does(where):
    row = torch.randn(49152)
    row[where] = float("nan")
    row[(where + 100) % 49152] = float("nan")
    row[3] = float("inf")
    assert int(extension().argmax_rows(row)) == int(row.argmax()) == min(where, (where + 100) % 49152)


def test_widen_to_fp32_is_exact_and_keeps_the_shape():
    x = torch.randn(3, 49157).bfloat16()
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])
    widened = extension().widen_to_fp32(x)
    assert widened.dtype == torch.float32 and widened.shape == x.shape
    assert torch.equal(widened.view(torch.int32), x.float().view(torch.int32))


def test_bad_inputs_are_errors_that_say_what():
    with pytest.raises(RuntimeError, match="argmax_rows: expected fp32"):
        extension().argmax_rows(torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="argmax_rows: expected fp32"):
        extension().argmax_rows(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match="widen_to_fp32: expected bf16"):
        extension().widen_to_fp32(torch.zeros(4))
