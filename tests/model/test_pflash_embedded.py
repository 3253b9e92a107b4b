"""Speculative prefill on the embedded model: a needle in a long prompt survives compression to a
fifth of the prompt and is answered (the completion form bench/niah.py uses)."""

import sysconfig
from pathlib import Path

import pytest

from dflash.engine.loading import load_model
from dflash.engine.pflash import CompressionSettings
from dflash.engine.sampling import SamplingParams

LENGTH = 1600


@pytest.fixture(scope="module")
def loaded():
    return load_model(max_ctx=2048, threads=2, reuse_live_state=False,
                      compression=CompressionSettings(mode="always", keep_ratio=0.2))


@pytest.mark.parametrize("depth", [0.2, 0.7])
def test_a_needle_survives_compression_and_is_answered(loaded, depth):
    tokenizer = loaded.tokenizer
    source = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
    needle = tokenizer("\n# Remember: the value of cedar-onyx is 4817203.\n")["input_ids"]
    question = tokenizer("\n# Question: what is the value of cedar-onyx?\n# Answer: the value of cedar-onyx is")["input_ids"]
    filler = tokenizer(source)["input_ids"][: LENGTH - len(needle) - len(question)]
    at = int(depth * len(filler))
    prompt = filler[:at] + needle + filler[at:] + question
    generation = loaded.engine.start(prompt, SamplingParams(), max_tokens=8,
                                     protected=[(0, 1), (len(prompt) - len(question), len(prompt))])
    answer = tokenizer.decode(generation.run())
    assert set(range(at, at + len(needle))) <= set(generation.kept_positions)
    assert generation.stats.prefilled_tokens <= 0.2 * LENGTH
    assert "4817203" in answer, answer
