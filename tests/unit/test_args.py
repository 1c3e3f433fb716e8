"""The trainer argument vocabulary: defaults, validation and the messages a user sees."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from tests import REPO
from tunepack.core.errors import (
    EXIT_BAD_INPUT,
    BadValueError,
    ConflictError,
    UnknownKeyError,
    UnsupportedError,
)
from tunepack.runtimes import args as args_module
from tunepack.runtimes import catalog, methods
from tunepack.runtimes.args import (
    VOCABULARY,
    TrainArgs,
    available_methods,
    builder_for,
    parse_trainer_args,
)
from tunepack.runtimes.args_docs import markdown_table, replace_block, train_args_fields

TINY = catalog.get("tiny-llama3")
LLAMA_8B = catalog.get("tunepack-llama3.1-8b")


def test_defaults_come_from_catalog_and_method():
    args = parse_trainer_args([], TINY)
    assert args.method == "lora"
    assert args.lora_rank == TINY.defaults["lora_rank"]
    assert args.max_seq_len == TINY.defaults["max_seq_len"]
    assert args.lr == 3e-3  # the tiny entry's own default beats the method's
    assert parse_trainer_args([], LLAMA_8B).lr == 3e-4
    assert parse_trainer_args(["method=full"], LLAMA_8B).lr == 2e-5
    assert parse_trainer_args(["method=full", "lr=1e-4"], LLAMA_8B).lr == 1e-4


def test_given_values_are_parsed_and_recorded():
    args = parse_trainer_args(
        ["lora_rank=4", "epochs=2", "lora_attn_modules=q_proj,v_proj", "lora_mlp=false"], TINY
    )
    assert (args.lora_rank, args.epochs, args.lora_mlp) == (4, 2, False)
    assert args.lora_attn_modules == ("q_proj", "v_proj")
    assert args.given == {
        "lora_rank": "4",
        "epochs": "2",
        "lora_attn_modules": "q_proj,v_proj",
        "lora_mlp": "false",
    }


KEYS = ", ".join(arg.name for arg in args_module.VOCABULARY)


@pytest.mark.parametrize(
    ("argv", "kind", "message"),
    [
        (
            ["lora_rank=abc"],
            BadValueError,
            "lora_rank='abc' is not valid: expected an integer from 1 to 1024",
        ),
        (
            ["lora_rank=0"],
            BadValueError,
            "lora_rank='0' is not valid: expected an integer from 1 to 1024",
        ),
        (["lr=-1"], BadValueError, "lr='-1' is not valid: expected a number > 0.0 and < 1.0"),
        (
            ["lora_rnk=8"],
            UnknownKeyError,
            "unknown trainer argument 'lora_rnk'; did you mean 'lora_rank'?",
        ),
        (
            ["model._component_=os.system"],
            UnknownKeyError,
            "trainer argument 'model._component_' is not part of tunepack's vocabulary: tunepack "
            f"does not take torchtune config overrides; use the documented keys ({KEYS})",
        ),
        (["epochs"], BadValueError, "trainer argument 'epochs' is not of the form key=value"),
        (["epochs=1", "epochs=2"], UnknownKeyError, "trainer argument 'epochs' is given twice"),
        (
            ["method=ia3"],
            BadValueError,
            "method='ia3' is not valid: expected one of lora, qlora, dora, full, dpo, orpo, kto, "
            "grpo, grpo_full",
        ),
        (
            ["compile=maybe"],
            BadValueError,
            "compile='maybe' is not valid: expected auto, true or false",
        ),
        (
            ["activation_checkpointing=on"],
            BadValueError,
            "activation_checkpointing='on' is not valid: expected auto, true or false",
        ),
        (
            ["loss_chunk=0"],
            BadValueError,
            "loss_chunk='0' is not valid: expected auto or an integer >= 1",
        ),
        (
            ["loss_chunk=all"],
            BadValueError,
            "loss_chunk='all' is not valid: expected auto or an integer >= 1",
        ),
        (
            ["keep_checkpoints=0"],
            BadValueError,
            "keep_checkpoints='0' is not valid: expected an integer from 1 to 100",
        ),
        (
            ["checkpoint_every_minutes=-1"],
            BadValueError,
            "checkpoint_every_minutes='-1' is not valid: expected a number >= 0.0",
        ),
        (
            ["lora_mlp=maybe"],
            BadValueError,
            "lora_mlp='maybe' is not valid: expected true or false",
        ),
        (
            ["lora_attn_modules=q_proj,up"],
            BadValueError,
            "lora_attn_modules='q_proj,up' is not valid: expected a comma-separated subset of "
            "q_proj,k_proj,v_proj,output_proj",
        ),
        (
            ["max_seq_len=100000"],
            BadValueError,
            "max_seq_len=100000 is larger than tiny-llama3's context window of 512 tokens",
        ),
        (
            ["method=full", "lora_rank=8", "lora_mlp=false"],
            ConflictError,
            "lora_rank=8, lora_mlp=false set LoRA adapters, but method=full trains every weight "
            "and has none; leave them out, or use method=lora",
        ),
        (
            ["method=full", "merge=Yes"],
            ConflictError,
            "merge=Yes merges a LoRA adapter into the base, but method=full trains every weight "
            "and has none (output/model/ is the whole model already); leave it out, or use "
            "method=lora",
        ),
    ],
)
def test_bad_arguments_name_the_value_and_the_expectation(argv, kind, message):
    with pytest.raises(kind) as err:
        parse_trainer_args(argv, TINY)
    assert type(err.value) is kind
    assert str(err.value) == message
    assert err.value.exit_code == EXIT_BAD_INPUT


@pytest.mark.parametrize(
    ("key", "meant"),
    [
        ("learning_rate", "lr"),
        ("num_train_epochs", "epochs"),
        ("per_device_train_batch_size", "batch_size"),
        ("gradient_accumulation_steps", "grad_accum"),
        ("lora_r", "lora_rank"),
        ("max_length", "max_seq_len"),
        ("sequence_len", "max_seq_len"),
        ("Learning-Rate", "lr"),
        ("use_dora", "method=dora"),
        ("Epochs", "epochs"),
    ],
)
def test_names_from_other_tools_are_answered_with_tunepack_s_key(key, meant):
    """Hugging Face/TRL/Axolotl names: one line naming the tunepack key, not the whole list."""
    with pytest.raises(UnknownKeyError) as err:
        parse_trainer_args([f"{key}=2"], TINY)
    assert str(err.value) == f"unknown trainer argument {key!r}; did you mean {meant!r}?"


def test_an_unknown_key_with_no_likely_meaning_lists_the_known_ones():
    with pytest.raises(UnknownKeyError) as err:
        parse_trainer_args(["frobnicate=2"], TINY)
    assert str(err.value).startswith(
        "unknown trainer argument 'frobnicate'; the known arguments are method, epochs, "
    )


def test_every_foreign_name_means_a_key_and_value_of_the_vocabulary():
    by_name = {arg.name: arg for arg in VOCABULARY}
    for foreign, (key, value) in args_module.FOREIGN_NAMES.items():
        assert foreign not in by_name, foreign
        if value is not None:
            by_name[key].parse(key, value)  # raises if the implied value is not valid
        else:
            assert key in by_name, foreign


def test_sequences_stay_within_a_window_torchtune_does_not_implement():
    """HF's Mistral v0.1 and Phi-3 Mini attend over a sliding window; torchtune's over everything.
    They agree only on sequences no longer than the window (Gemma 2's window is implemented)."""
    mistral, phi3 = catalog.get("mistral-7b"), catalog.get("phi3-mini")
    assert (mistral.window_limit, phi3.window_limit, catalog.get("gemma2-2b").window_limit) == (
        4096,
        2047,
        None,
    )
    assert parse_trainer_args([], phi3).max_seq_len == 2047  # the default respects it
    assert parse_trainer_args(["max_seq_len=4096"], mistral).max_seq_len == 4096
    with pytest.raises(BadValueError) as err:
        parse_trainer_args(["max_seq_len=8192"], mistral)
    assert str(err.value) == (
        "max_seq_len=8192 is longer than mistral-7b's sliding attention window of 4096 tokens, "
        "which torchtune's Mistral does not implement, so longer sequences would train a "
        "different model than the checkpoint; use max_seq_len<=4096"
    )


def test_gemma2_refuses_packing_and_says_why():
    """On a GPU torchtune packs with flex-attention block masks, which its Gemma 2 rejects."""
    gemma2 = catalog.get("gemma2-9b")
    with pytest.raises(UnsupportedError) as err:
        parse_trainer_args(["packed=true"], gemma2)
    assert str(err.value) == (
        "packed=true is not available for gemma2-9b: torchtune 0.6.1's Gemma 2 attention cannot "
        "take the block masks packing uses on a GPU; set packed=false"
    )
    assert not parse_trainer_args(["packed=false"], gemma2).packed
    assert parse_trainer_args(["packed=true"], catalog.get("gemma-7b")).packed


def test_lora_variants_are_available_where_lora_is():
    for method in ("qlora", "dora"):
        args = parse_trainer_args([f"method={method}"], LLAMA_8B)
        assert args.method == method and args.lr == 3e-4
        assert args.method_record is methods.get(method)
        assert builder_for(LLAMA_8B, args.method_record) == LLAMA_8B.builders["lora"]
    assert available_methods(LLAMA_8B) == (
        "lora",
        "qlora",
        "dora",
        "full",
        "dpo",
        "orpo",
        "kto",
        "grpo",
        "grpo_full",
    )
    only_full = dataclasses.replace(LLAMA_8B, builders={"full": LLAMA_8B.builders["full"]})
    assert available_methods(only_full) == ("full", "grpo_full")
    with pytest.raises(UnsupportedError) as err:
        parse_trainer_args(["method=dora"], only_full)
    assert str(err.value) == (
        "method='dora' is not available for llama3.1-8b: expected one of full, grpo_full"
    )


def test_tri_state_and_checkpoint_arguments():
    args = parse_trainer_args([], TINY)
    assert args.activation_checkpointing == "auto"
    assert (args.checkpoint_every_steps, args.checkpoint_every_minutes) == (0, 10.0)
    assert (args.keep_checkpoints, args.resume, args.merge) == (2, True, False)
    args = parse_trainer_args(["activation_checkpointing=false", "resume=false"], TINY)
    assert args.activation_checkpointing is False and args.resume is False


def test_deterministic_is_an_opt_in_boolean():
    assert parse_trainer_args([], TINY).deterministic is False
    assert parse_trainer_args(["deterministic=true"], TINY).deterministic is True
    with pytest.raises(BadValueError):
        parse_trainer_args(["deterministic=sometimes"], TINY)


def test_every_vocabulary_key_has_help():
    assert all(arg.help for arg in VOCABULARY)
    assert len({arg.name for arg in VOCABULARY}) == len(VOCABULARY)


def test_docs_list_every_argument_in_the_generated_table():
    doc = (REPO / "docs" / "trainer.md").read_text()
    block = doc.split("<!-- vocabulary:begin -->\n")[1].split("<!-- vocabulary:end -->")[0]
    assert block == markdown_table(), (
        "docs/trainer.md is stale: run python -m tunepack.runtimes.args_docs"
    )
    for arg in VOCABULARY:
        assert f"| `{arg.name}` |" in block


def test_train_args_fields_are_generated_from_the_vocabulary():
    source = Path(args_module.__file__).read_text()
    assert replace_block(source, "tunepack.runtimes.args_docs", train_args_fields()) == source, (
        "runtimes/args.py's TrainArgs fields are stale: "
        "run python -m tunepack.runtimes.args_docs --write"
    )
    names = [f.name for f in dataclasses.fields(TrainArgs)]
    assert names == [arg.name for arg in VOCABULARY] + ["given", "method_record"]
    hints = typing.get_type_hints(TrainArgs)
    assert hints["lora_attn_modules"] == tuple[str, ...]
    assert hints["max_steps"] == int | None and hints["compile"] == str | bool


def test_a_stale_block_is_rewritten_and_a_missing_one_named():
    source = (
        "class A:\n"
        "    # generated from VOCABULARY by `python -m x --write`: begin\n"
        "    old: int\n"
        "    # generated from VOCABULARY: end\n"
        "    kept: str\n"
    )
    assert replace_block(source, "x", ["new: str", "", "more: int"]) == (
        "class A:\n"
        "    # generated from VOCABULARY by `python -m x --write`: begin\n"
        "    new: str\n"
        "\n"
        "    more: int\n"
        "    # generated from VOCABULARY: end\n"
        "    kept: str\n"
    )
    with pytest.raises(ValueError, match="no block between '# generated from VOCABULARY by `py"):
        replace_block(source, "y", [])
