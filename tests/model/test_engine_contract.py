"""The real engine and the fake one the server tests run on keep the same contract
(dflash/engine/contract.py): every member of every Protocol exists on both, methods with
compatible signatures, attributes with values of the declared types."""

import inspect
import typing
from types import UnionType

import pytest

from dflash.engine import contract
from dflash.engine.generate import Engine
from dflash.engine.grammar import GrammarTokenizer
from dflash.sampling_params import SamplingParams
from dflash.scheduler import LogprobRecorder
from tests.model.tiny import ours_from_hf, tiny_hf_model
from tests.unit.fakes import FakeEngine

PROMPT = [5, 9, 33, 2, 7]
SELF_AND_REST = slice(1, None)


def protocol_members(protocol: type) -> tuple[list[str], list[str]]:
    """(attributes, methods) the Protocol itself declares."""
    methods = [name for name, value in vars(protocol).items()
               if inspect.isfunction(value) and not name.startswith("_")]
    return list(vars(protocol).get("__annotations__", {})), methods


def contract_problems(protocol: type, implementation: object, where: str | None = None) -> list[str]:
    """What `implementation` (an instance, or a class when the Protocol has no attributes) lacks."""
    attributes, methods = protocol_members(protocol)
    cls = implementation if isinstance(implementation, type) else type(implementation)
    where = where or cls.__name__
    problems = []
    hints = typing.get_type_hints(protocol, vars(contract))
    for name in attributes:
        if not hasattr(implementation, name):
            problems.append(f"{where}.{name} is missing")
        else:
            problems += fit_problems(f"{where}.{name}", getattr(implementation, name), hints[name])
    for name in methods:
        method = getattr(cls, name, None)
        if not callable(method):
            problems.append(f"{where}.{name}() is missing")
        else:
            problems += signature_problems(f"{where}.{name}", inspect.signature(getattr(protocol, name)),
                                           inspect.signature(method))
    return problems


def fit_problems(where: str, value: object, hint: object) -> list[str]:
    if isinstance(hint, type) and getattr(hint, "_is_protocol", False):
        return contract_problems(hint, value, where)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, UnionType):
        fitting = [fit_problems(where, value, option) for option in typing.get_args(hint)]
        return [] if any(not problems for problems in fitting) else fitting[0]
    if origin is typing.Literal:
        return [] if value in typing.get_args(hint) else [f"{where} is {value!r}, not one of {typing.get_args(hint)}"]
    expected = origin or hint
    if expected is float:
        expected = (int, float)
    if hint is type(None):
        return [] if value is None else [f"{where} is {value!r}, not None"]
    return [] if isinstance(value, expected) else [f"{where} is {value!r}, not {hint}"]


def signature_problems(where: str, wanted: inspect.Signature, got: inspect.Signature) -> list[str]:
    """`got` accepts every call `wanted` allows: the same positional parameters in order, the same
    keyword names, defaults where the contract has them, and nothing more that is required."""
    wanted_params = list(wanted.parameters.values())[SELF_AND_REST]
    got_params = list(got.parameters.values())[SELF_AND_REST]
    got_by_name = {param.name: param for param in got_params}
    problems = []
    positional = [param for param in wanted_params if param.kind is param.POSITIONAL_OR_KEYWORD]
    for index, param in enumerate(positional):
        if index >= len(got_params) or got_params[index].name != param.name:
            problems.append(f"{where}: positional parameter {index + 1} must be {param.name!r}")
    for param in wanted_params:
        other = got_by_name.get(param.name)
        if other is None:
            problems.append(f"{where}: parameter {param.name!r} is missing")
            continue
        if param.kind is param.KEYWORD_ONLY and other.kind not in (other.KEYWORD_ONLY, other.POSITIONAL_OR_KEYWORD):
            problems.append(f"{where}: {param.name!r} must be accepted as a keyword")
        if param.default is not param.empty and other.default is other.empty:
            problems.append(f"{where}: {param.name!r} needs a default")
    wanted_names = {param.name for param in wanted_params}
    for other in got_params:
        if other.name not in wanted_names and other.default is other.empty \
                and other.kind not in (other.VAR_POSITIONAL, other.VAR_KEYWORD):
            problems.append(f"{where}: extra parameter {other.name!r} is required")
    return problems


def real_engine():
    return Engine(ours_from_hf(tiny_hf_model("llama")), max_ctx=64, prefill_chunk=4), GrammarTokenizer


def fake_engine():
    engine = FakeEngine(prefill_chunk=4)
    return engine, engine.grammar_tokenizer()


@pytest.mark.parametrize("make", [real_engine, fake_engine], ids=["real", "fake"])
def test_engine_generation_and_steps_follow_the_contract(make):
    engine, grammar_checker = make()
    assert contract_problems(contract.Engine, engine) == []
    assert contract_problems(contract.GrammarChecker, grammar_checker) == []
    generation = engine.start(PROMPT, SamplingParams(), 3, snapshot_at=(2,))
    assert contract_problems(contract.Generation, generation) == []
    generation.sampler = LogprobRecorder(generation.sampler, 2)  # as the scheduler does for logprobs
    while (step := generation.step()).finished is None:
        assert contract_problems(contract.Step, step) == []
    assert contract_problems(contract.Step, step) == []
    generation.close()
    engine.close()


def test_the_check_finds_a_drifted_signature_and_a_missing_attribute():
    class Drifted:
        sampler = None

        def step(self, budget):
            return None

    problems = contract_problems(contract.Generation, Drifted())
    assert "Drifted.stats is missing" in problems
    assert "Drifted.close() is missing" in problems
    assert "Drifted.step: extra parameter 'budget' is required" in problems
    assert "Drifted.sampler.params is missing" in problems
