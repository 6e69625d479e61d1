"""Every flag of every `vllm-neuron` command has help and shows one default; groups follow vLLM's topics."""
from __future__ import annotations

import argparse
import re

import pytest

from vllm_neuron.config.arg_utils import GROUPS, arg_group
from vllm_neuron.entrypoints.cli.main import _parser, main


def _subparsers(parser: argparse.ArgumentParser, path: str = "vllm-neuron"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, f"{path} {name}")


ALL = list(_subparsers(_parser()))


def _flag_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    fmt = parser._get_formatter()
    fmt.add_argument(action)
    return fmt.format_help()


@pytest.mark.parametrize("path, parser", ALL, ids=[p for p, _ in ALL])
def test_every_flag_has_help_and_one_default(path, parser):
    problems = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = "/".join(action.option_strings) or action.dest
        if not action.help or action.help == argparse.SUPPRESS:
            problems.append(f"{name}: no help")
            continue
        if not action.option_strings:
            continue  # positionals state their default in the text when they have one
        text = " ".join(_flag_help(parser, action).split())
        shown = len(re.findall(r"\(default", text, re.IGNORECASE))
        if shown != 1:
            problems.append(f"{name}: {shown} defaults shown: {text!r}")
        if "_FLAG" in text:
            problems.append(f"{name}: internal metavar in {text!r}")
        if "(default: None)" in text:
            problems.append(f"{name}: says 'default: None' instead of what None means")
    assert not problems, f"{path}: " + "; ".join(problems)


def test_serve_groups_by_topic():
    serve = dict(ALL)["vllm-neuron serve"]
    titles = [g.title for g in serve._action_groups]
    for topic in GROUPS:
        assert GROUPS[topic] in titles, topic
    where = {a.dest: g.title for g in serve._action_groups for a in g._group_actions}
    assert where["block_size"] == GROUPS["cache"] and where["max_num_seqs"] == GROUPS["scheduler"]
    assert where["tensor_parallel_size"] == GROUPS["parallel"] and where["port"] == GROUPS["server"]
    assert where["enforce_eager"] == GROUPS["compilation"] and where["chat_template"] == GROUPS["frontend"]


def test_arg_group_reuses_and_refuses_unknown_topics():
    p = argparse.ArgumentParser()
    assert arg_group(p, "cache") is arg_group(p, "cache")
    with pytest.raises(ValueError, match="valid groups"):
        arg_group(p, "caches")


def test_generate_help_is_true_to_it():
    gen = dict(ALL)["vllm-neuron generate"]
    dests = {a.dest for a in gen._actions}
    assert "served_model_name" not in dests and "host" not in dests
    model = next(a for a in gen._actions if a.dest == "model_flag")
    assert "positional" not in model.help and model.metavar == "MODEL"
    # Sampling flags left unset take the generation config's defaults.
    args = gen.parse_args(["hi"])
    assert (args.temperature, args.top_p, args.top_k, args.max_tokens) == (None, None, None, None)


@pytest.mark.parametrize("argv, usage, hint", [
    (["serve", "--max-model-length", "4096"], "usage: vllm-neuron serve", "did you mean --max-model-len?"),
    (["generate", "--temprature", "0", "hi"], "usage: vllm-neuron generate", "did you mean --temperature?"),
    (["bench", "serve", "--max-concurency", "4"], "usage: vllm-neuron bench serve", "did you mean --max-concurrency?"),
])
def test_flag_typo_gets_the_command_usage_and_a_suggestion(argv, usage, hint, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert usage in err and hint in err, err
    assert "{serve,generate" not in err, "the top-level usage instead of the command's"
    assert len(err.splitlines()) <= 3, err  # the short usage, not ~100 flags


def test_unknown_flag_without_a_near_one_has_no_suggestion(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--zzzz"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzz" in err and "did you mean" not in err


def _help(dest: str) -> str:
    serve = dict(ALL)["vllm-neuron serve"]
    action = next(a for a in serve._actions if a.dest == dest)
    return " ".join(_flag_help(serve, action).split())


def test_help_lists_what_the_engine_accepts():
    """Help texts name every value the engine accepts (and no stale "only ..."), for the options whose
    values are lists in the code."""
    from vllm_neuron.config.engine_args import KV_CACHE_DTYPES, EngineArgs
    from vllm_neuron.config.neuron_config import QUANTIZATIONS
    from vllm_neuron.config.speculative import SPECULATIVE_METHODS

    kv = _help("kv_cache_dtype")
    assert "only" not in kv and all(v in kv for v in KV_CACHE_DTYPES)
    for v in KV_CACHE_DTYPES:
        EngineArgs.from_kwargs(kv_cache_dtype=v)
    spec = _help("speculative_config")
    assert "only ngram" not in spec and all(m in spec for m in SPECULATIVE_METHODS)
    quant = _help("quantization")
    assert all(q in quant for q in QUANTIZATIONS)
    # Refusals the help announces are what the engine does.
    assert "refused for a dense model" in _help("enable_expert_parallel")
    assert "-1: the whole vocabulary" in _help("max_logprobs")
    EngineArgs.from_kwargs(max_logprobs=-1)
    assert "not with an audio model" in _help("tensor_parallel_size")
    assert "tensor-parallel-size 1 only" not in _help("speculative_config")
    EngineArgs.from_kwargs(device="cpu", tensor_parallel_size=2,
                           speculative_config={"method": "ngram", "num_speculative_tokens": 2})
