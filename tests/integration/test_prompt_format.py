"""The training format is the model's Hugging Face chat template, token for token, per family.

Each family's tiny model carries its published model's chat template (tokenizer_config.json,
runtimes/chat_templates.py). transformers renders a conversation with it (``apply_chat_template``)
and tokenizes it with the model's HF tokenizer; the trainer renders the same conversation with
``trainers/data/prompt_format.py`` and tokenizes it with the family's torchtune tokenizer. The ids
must be equal, for whole conversations (training) and for generation prompts (``generate()``),
and the loss must cover exactly the assistant's replies and their end-of-turn markers.
"""

from __future__ import annotations

import json
import shutil

import pytest
from omegaconf import OmegaConf
from torchtune import config as tt_config
from torchtune.data import Message

from tunepack import tiny
from tunepack.core.errors import BadDatasetError, BadValueError, ConflictError
from tunepack.runtimes import catalog
from tunepack.runtimes.args import parse_trainer_args
from tunepack.runtimes.chat_templates import GROUPS, QWEN2_5_SYSTEM, TEMPLATES
from tunepack.trainers.config import tokenizer_config
from tunepack.trainers.data.prompt_format import FORMATS

ENTRIES = list(catalog.TINY.values())
SYSTEM = {"role": "system", "content": "Answer in one short line."}
CONVERSATION = [
    {"role": "user", "content": "What is the capital of Iceland?"},
    {"role": "assistant", "content": "Reykjavik is the capital."},
    # Surrounding spaces: templates that trim and templates that keep them differ here.
    {"role": "user", "content": " Reverse the letters of this word: zebra. "},
    {"role": "assistant", "content": "arbez"},
]
# What transformers' chat templates take besides the messages: Llama 3.2's would otherwise
# print today's date; Qwen 3's generation prompt as tunepack trains it (no thinking).
# The token that ends an assistant turn, per format: the model learns to stop on it.
END_OF_TURN = ("<|eot_id|>", "</s>", "<end_of_turn>", "<|end|>", "<|im_end|>")
TEMPLATE_KWARGS = {"date_string": "26 Jul 2024", "enable_thinking": False}


pytestmark = pytest.mark.usefixtures("no_tiktoken_cache")


@pytest.fixture(scope="module", params=ENTRIES, ids=lambda entry: entry.name)
def family(request, tmp_path_factory):
    """(entry, model dir, HF tokenizer) for each family's tiny model."""
    from transformers import AutoTokenizer

    entry = request.param
    model_dir = tiny.write_tiny_model(tmp_path_factory.mktemp("formats") / entry.name, entry)
    hf_dir = model_dir
    if entry.family.name == "phi3":
        # The tiny Phi-3 keeps its chat tokens in a tokenizer.json holding only added_tokens
        # (what torchtune reads; the real repository's file is a whole tokenizer), which
        # transformers cannot load: it gets the SentencePiece model and the same tokens here.
        hf_dir = tmp_path_factory.mktemp("phi3-hf")
        shutil.copy(model_dir / "tokenizer.model", hf_dir / "tokenizer.model")
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        added = json.loads((model_dir / "tokenizer.json").read_text())["added_tokens"]
        config["added_tokens_decoder"] = {str(t["id"]): t for t in added}
        (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
    hf = AutoTokenizer.from_pretrained(hf_dir)
    assert hf.chat_template == TEMPLATES[entry.family.chat_format]
    return entry, model_dir, hf


def _tunepack_tokenizer(entry, model_dir, **args):
    """The tokenizer node the trainer's config gets, instantiated as the recipe does."""
    given = [f"{k}={v}" for k, v in args.items()]
    node = tokenizer_config(entry, model_dir, None, parse_trainer_args(given, entry))
    return tt_config.instantiate(OmegaConf.create(node))


def _messages(conversation: list[dict]) -> list[Message]:
    return [Message(m["role"], m["content"], masked=m["role"] != "assistant") for m in conversation]


def _hf_ids(hf, conversation: list[dict], **kwargs) -> list[int]:
    rendered = hf.apply_chat_template(
        conversation, tokenize=True, return_dict=True, **TEMPLATE_KWARGS, **kwargs
    )
    return list(rendered["input_ids"])


def _conversations(entry) -> list[list[dict]]:
    if entry.family.chat_format == "gemma":  # no system role in Gemma's template
        return [CONVERSATION, CONVERSATION[:2]]
    return [[SYSTEM, *CONVERSATION], CONVERSATION, CONVERSATION[:2]]


def test_training_tokens_equal_the_hf_chat_template(family):
    entry, model_dir, hf = family
    tokenizer = _tunepack_tokenizer(entry, model_dir)
    for conversation in _conversations(entry):
        ids, mask = tokenizer.tokenize_messages(_messages(conversation))
        assert ids == _hf_ids(hf, conversation), [m["role"] for m in conversation]
        # The loss covers the assistant's turns, each with the marker that ends it, nothing else.
        trained_ids = [i for i, masked in zip(ids, mask, strict=True) if not masked]
        trained = hf.decode(trained_ids)
        replies = [m["content"] for m in conversation if m["role"] == "assistant"]
        for reply in replies:
            assert reply in trained
        assert "Iceland" not in trained and "zebra" not in trained and "user" not in trained
        ends = [t for t in hf.convert_ids_to_tokens(trained_ids) if t in END_OF_TURN]
        assert len(ends) == len(replies), ends


def test_generation_prompt_equals_the_hf_chat_template(family):
    entry, model_dir, hf = family
    tokenizer = _tunepack_tokenizer(entry, model_dir)
    for conversation in _conversations(entry):
        prompt = conversation[:-1]
        ids, _ = tokenizer.tokenize_messages(
            [*_messages(prompt), Message("assistant", "")], add_end_tokens=False
        )
        expected = _hf_ids(hf, prompt, add_generation_prompt=True)
        assert ids == expected
        # ... and the whole conversation continues it: the reply follows the prompt.
        full, _ = tokenizer.tokenize_messages(_messages(conversation))
        assert full[: len(ids)] == ids


def test_a_sampled_answer_ends_where_the_assistants_turn_ends(family):
    """GRPO stops an answer at the format's end-of-turn token (trainers/objectives/grpo.py): the
    special token that closes an assistant's reply, as the HF template writes the reply."""
    entry, model_dir, hf = family
    tokenizer = _tunepack_tokenizer(entry, model_dir)
    ends = tokenizer.turn_end_ids()
    assert len(ends) == 1
    reply = _hf_ids(hf, CONVERSATION[:2])
    (end,) = ends
    # Phi-3's template writes a newline and its end of text after <|end|>.
    assert end in reply[-4:], hf.convert_ids_to_tokens(reply[-4:])
    assert hf.convert_ids_to_tokens(end) in END_OF_TURN


def test_system_prompt_is_the_first_turn(family):
    entry, model_dir, hf = family
    if entry.family.chat_format == "gemma":
        with pytest.raises(ConflictError) as err:
            parse_trainer_args(["system_prompt=Be terse."], entry)
        assert str(err.value) == (
            "system_prompt='Be terse.': the gemma chat format has no system role (the model's "
            "published template refuses one); leave system_prompt out"
        )
        return
    tokenizer = _tunepack_tokenizer(entry, model_dir, system_prompt="Answer in one short line.")
    ids, _ = tokenizer.tokenize_messages(_messages(CONVERSATION))
    assert ids == _hf_ids(hf, [SYSTEM, *CONVERSATION])
    # A conversation's own system message wins over the default.
    own = [{"role": "system", "content": "Be precise."}, *CONVERSATION]
    ids, _ = tokenizer.tokenize_messages(_messages(own))
    assert ids == _hf_ids(hf, own)


def test_every_family_has_a_published_template_and_a_format():
    assert {f.chat_format for f in catalog.FAMILIES.values()} <= set(TEMPLATES)
    assert set(TEMPLATES) == set(FORMATS)
    assert sorted(n for group in GROUPS for n in group) == sorted(FORMATS)


# A prompt (system, a turn with surrounding spaces and newlines, the next question) rendered with
# add_generation_prompt=True by the published template each format was checked against, as
# transformers renders it, with the family's BOS/EOS (docs/trainer.md, "Chat format"): Llama 2 by
# meta-llama/Llama-2-13b-chat-hf's (as quoted in EricLBuehler/mistral.rs's template tests),
# Mistral by Mistral-7B-Instruct-v0.2's optional-system template (v0.1's since 2024), Phi-4 by
# microsoft/phi-4's (as quoted in ShishirPatil/gorilla), Qwen 2 by Qwen2-72B-Instruct's; the
# others by the copies huggingface/trl 1.16.0 keeps of each model's template
# (trl/chat_templates/*.jinja, checked weekly against the Hub): Meta-Llama-3-8B-Instruct,
# Llama-3.1-8B-Instruct (Llama-3.3-70B-Instruct's is the same text), Llama-3.2-1B-Instruct,
# gemma-7b-it / gemma-2-2b-it, Phi-3-mini-4k-instruct, Qwen2.5-32B-Instruct, Qwen3-8B.
PUBLISHED_PROMPT = [
    {"role": "system", "content": " Be brief.\n"},
    {"role": "user", "content": "\nName a colour. "},
    {"role": "assistant", "content": " Teal.\n"},
    {"role": "user", "content": "Another?"},
]
PUBLISHED_RENDERS = {
    "llama2": "<s>[INST] <<SYS>>\n Be brief.\n\n<</SYS>>\n\n\nName a colour. [/INST] Teal. </s>"
    "<s>[INST] Another? [/INST]",
    "mistral": "<s> [INST]  Be brief.\n\n\n\nName a colour.  [/INST]  Teal.\n</s> [INST] Another? "
    "[/INST]",
    "llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nName a colour.<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nTeal.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nAnother?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "llama3.1": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nName a colour.<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nTeal.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nAnother?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    # Gemma has no system role: the same prompt without its system message.
    "gemma": "<bos><start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\nTeal."
    "<end_of_turn>\n<start_of_turn>user\nAnother?<end_of_turn>\n<start_of_turn>model\n",
    "phi3": "<|system|>\n Be brief.\n<|end|>\n<|user|>\n\nName a colour. <|end|>\n<|assistant|>\n"
    " Teal.\n<|end|>\n<|user|>\nAnother?<|end|>\n<|assistant|>\n",
    "phi4": "<|im_start|>system<|im_sep|> Be brief.\n<|im_end|><|im_start|>user<|im_sep|>\n"
    "Name a colour. <|im_end|><|im_start|>assistant<|im_sep|> Teal.\n<|im_end|>"
    "<|im_start|>user<|im_sep|>Another?<|im_end|><|im_start|>assistant<|im_sep|>",
    "qwen2": "<|im_start|>system\n Be brief.\n<|im_end|>\n<|im_start|>user\n\nName a colour. "
    "<|im_end|>\n<|im_start|>assistant\n Teal.\n<|im_end|>\n<|im_start|>user\nAnother?"
    "<|im_end|>\n<|im_start|>assistant\n",
    "qwen3": "<|im_start|>system\n Be brief.\n<|im_end|>\n<|im_start|>user\n\nName a colour. "
    "<|im_end|>\n<|im_start|>assistant\n Teal.\n<|im_end|>\n<|im_start|>user\nAnother?"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
}
PUBLISHED_RENDERS["llama3.2"] = PUBLISHED_RENDERS["llama3.1"]  # with the date it is given
PUBLISHED_RENDERS["qwen2.5"] = PUBLISHED_RENDERS["qwen2"]  # the default system prompts differ
BOS_EOS = {
    "llama2": ("<s>", "</s>"), "mistral": ("<s>", "</s>"),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>"), "llama3.1": ("<|begin_of_text|>", "<|eot_id|>"),
    "llama3.2": ("<|begin_of_text|>", "<|eot_id|>"), "gemma": ("<bos>", "<eos>"),
    "phi3": ("<s>", "<|endoftext|>"), "phi4": ("<|endoftext|>", "<|im_end|>"),
    "qwen2": (None, "<|im_end|>"), "qwen2.5": (None, "<|im_end|>"), "qwen3": (None, "<|im_end|>"),
}  # fmt: skip


@pytest.mark.parametrize("fmt", sorted(PUBLISHED_RENDERS))
def test_each_format_prompts_as_the_published_template_it_was_checked_against(fmt):
    from transformers.utils.chat_template_utils import render_jinja_template

    from tunepack.trainers.data import prompt_format

    conversation = PUBLISHED_PROMPT[1:] if fmt == "gemma" else PUBLISHED_PROMPT
    bos, eos = BOS_EOS[fmt]
    rendered, _ = render_jinja_template(
        [conversation], chat_template=TEMPLATES[fmt], add_generation_prompt=True,
        bos_token=bos, eos_token=eos, **TEMPLATE_KWARGS,
    )  # fmt: skip
    assert rendered[0] == PUBLISHED_RENDERS[fmt]
    # The trainer's twin of the template lays the prompt out the same way.
    turns = [prompt_format.Turn(m["role"], m["content"]) for m in conversation]
    pieces = prompt_format.render(fmt, turns, generation=True)
    marker = {prompt_format.BOS: bos or "", prompt_format.EOS: eos}
    text = "".join(marker.get(p.text, p.text) if p.special else p.text for p in pieces)
    assert text == PUBLISHED_RENDERS[fmt]


def test_a_qwen_prompt_without_a_system_message_gets_the_templates_default():
    from transformers.utils.chat_template_utils import render_jinja_template

    for fmt, default in (("qwen2", "You are a helpful assistant."), ("qwen2.5", QWEN2_5_SYSTEM)):
        rendered, _ = render_jinja_template(
            [PUBLISHED_PROMPT[3:]], chat_template=TEMPLATES[fmt], add_generation_prompt=True
        )
        assert rendered[0] == (
            f"<|im_start|>system\n{default}<|im_end|>\n<|im_start|>user\nAnother?<|im_end|>\n"
            "<|im_start|>assistant\n"
        )


def test_gemma_refuses_a_conversation_with_a_system_message(tmp_path):
    entry = catalog.TINY["gemma"]
    model_dir = tiny.write_tiny_model(tmp_path / "gemma", entry)
    tokenizer = _tunepack_tokenizer(entry, model_dir)
    with pytest.raises(BadDatasetError) as err:
        tokenizer.tokenize_messages(_messages([SYSTEM, *CONVERSATION]))
    assert str(err.value) == (
        "the gemma chat format has no system role (Gemma's published template refuses it), but "
        "a conversation starts with a system message: drop it, or fold it into the first user "
        "message"
    )


def test_another_format_of_the_same_tokens_is_the_hf_template_of_that_format(tmp_path):
    """chat_template=qwen2.5 on Qwen 3: the run trains as Qwen 2.5's template renders."""
    from transformers import AutoTokenizer

    entry = catalog.TINY["qwen3"]
    model_dir = tiny.write_tiny_model(tmp_path / "qwen3", entry)
    tokenizer = _tunepack_tokenizer(entry, model_dir, chat_template="qwen2.5")
    hf = AutoTokenizer.from_pretrained(model_dir)
    ids, _ = tokenizer.tokenize_messages(_messages(CONVERSATION))
    expected = hf.apply_chat_template(
        CONVERSATION, chat_template=TEMPLATES["qwen2.5"], tokenize=True, return_dict=True
    )["input_ids"]
    assert ids == list(expected)


@pytest.mark.parametrize(
    ("model", "arg", "message"),
    [
        ("tiny-llama3", "chat_template=chatml", "chat_template='chatml' is not valid for this "
         "model: expected model (its own, llama3) or one of llama3, llama3.1, llama3.2"),
        ("tiny-llama3", "chat_template=qwen2.5", "chat_template='qwen2.5' is not valid"),
        ("tiny-llama3", "chat_template={{ 7*7 }}", "is not valid for this model"),
        ("tiny-llama3", "system_prompt=", "system_prompt='' is not valid: expected"),
        ("tiny-llama3", "system_prompt=<|eot_id|>hi", "system_prompt must not contain the special "
         "token <|eot_id|>"),
        ("tiny-llama3", "system_prompt=" + "x" * 5000, "system_prompt is 5000 characters long"),
    ],
)  # fmt: skip
def test_bad_chat_arguments_are_refused_in_one_line(model, arg, message):
    with pytest.raises(BadValueError) as caught:
        parse_trainer_args([arg], catalog.get(model))
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_chat_run_records_its_format_and_generate_asks_in_it(initialized_workspace, tmp_path):
    """Chat data, trained in another format of the model's tokens with a default system prompt:
    the loss falls, result.json records the format, and the result's generation prompt is the
    HF template's (the one vLLM applies with --chat-template), which is also how every
    training row begins."""
    from transformers import AutoTokenizer

    from tests.helpers import run_program, setup_recipe
    from tunepack.tiny import tiny_dataset_rows
    from tunepack.types import Result

    entry = catalog.get("tiny-llama3")
    rows = tiny_dataset_rows(32)
    source = tmp_path / "chat.jsonl"
    source.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": r["instruction"]},
                        {"role": "assistant", "content": r["output"]},
                    ]
                }
            )
            + "\n"
            for r in rows
        )
    )
    workspace = tmp_path / "ws"
    shutil.copytree(initialized_workspace / "model", workspace / "model")
    done = run_program(
        "tunepack.initializers.dataset",
        {"TUNEPACK_WORKSPACE": str(workspace), "STORAGE_URI": str(source)},
    )
    assert done.returncode == 0, done.stderr
    system = "Answer with the result only."
    recipe = setup_recipe(
        entry,
        ["epochs=4", "warmup_steps=0", "batch_size=8", "chat_template=llama3.1",
         f"system_prompt={system}"],
        model_dir=workspace / "model",
        dataset_dir=workspace / "dataset",
        output=workspace / "output",
    )  # fmt: skip
    recipe.train()
    recipe.save()
    info = json.loads((workspace / "output" / "result.json").read_text())
    assert info["final_loss"] < info["first_loss"]
    assert (info["chat_template"], info["system_prompt"]) == ("llama3.1", system)

    result = Result(
        job="chat",
        path=info["artifact"],
        base_model=str(workspace / "model"),
        method="lora",
        chat_template=info["chat_template"],
        system_prompt=info["system_prompt"],
    )
    hf = AutoTokenizer.from_pretrained(workspace / "model")
    asked = [
        {"role": "system", "content": system},
        {"role": "user", "content": rows[0]["instruction"]},
    ]
    expected = hf.apply_chat_template(
        asked, chat_template=TEMPLATES["llama3.1"], add_generation_prompt=True, tokenize=True,
        return_dict=True,
    )["input_ids"]  # fmt: skip
    prompt = result.prompt_ids(rows[0]["instruction"])
    assert prompt == list(expected)
    # The first row as the trainer tokenized it: this prompt, then the answer and end of turn.
    trained = recipe.dataloader.dataset[0]["tokens"]
    assert trained[: len(prompt)] == prompt
    answer = hf.decode(trained[len(prompt) :])
    assert answer == rows[0]["output"].strip() + "<|eot_id|>"
    assert isinstance(result.generate(rows[0]["instruction"], max_new_tokens=4), str)


def _served(capsys, runtime: str, *argv: str) -> tuple[list[str], str | None]:
    """vLLM's arguments and the chat template it is given, from `tunepack render serving`."""
    import yaml

    from tunepack.cli import main

    code = main(["render", "serving", "--runtime", runtime, "--name", "my-job", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    objects = [o for o in yaml.safe_load_all(out) if o]
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    maps = [o for o in objects if o["kind"] == "ConfigMap"]
    template = maps[0]["data"]["chat_template.jinja"] if maps else None
    flag = [a for a in args if a.startswith("--chat-template")]
    assert bool(flag) == bool(template)
    if template:  # mounted where the flag points
        pod = deployment["spec"]["template"]["spec"]
        assert {"name": "chat-template", "configMap": {"name": maps[0]["metadata"]["name"]}} in (
            pod["volumes"]
        )
        mounts = pod["containers"][0]["volumeMounts"]
        mount = next(m for m in mounts if m["name"] == "chat-template")
        assert flag[0] == f"--chat-template={mount['mountPath']}/chat_template.jinja"
    return args, template


def test_a_run_in_the_models_own_format_is_served_with_the_models_own_template(capsys):
    args, template = _served(capsys, "tunepack-llama3.1-8b", "lora_rank=8")
    assert template is None and not any("chat-template" in a for a in args)


def test_the_served_template_prompts_as_the_run_was_trained(capsys, tmp_path):
    """A run with another format and a system prompt (with quotes and accents, which must
    survive the Jinja string): vLLM's template renders the prompts the trainer's format does."""
    from transformers import AutoTokenizer

    system = 'Say "done" when finished — café\\n'
    argv = ["chat_template=llama3.1", f"system_prompt={system}"]
    _, template = _served(capsys, "tunepack-tiny-llama3", *argv)
    entry = catalog.get("tiny-llama3")
    model_dir = tiny.write_tiny_model(tmp_path / "m", entry)
    hf = AutoTokenizer.from_pretrained(model_dir)
    tokenizer = _tunepack_tokenizer(
        entry, model_dir, chat_template="llama3.1", system_prompt=system
    )
    for asked in (CONVERSATION[:1], [{"role": "system", "content": "Own."}, *CONVERSATION[:3]]):
        ids, _ = tokenizer.tokenize_messages(
            [*_messages(asked), Message("assistant", "")], add_end_tokens=False
        )
        served = hf.apply_chat_template(
            asked, chat_template=template, add_generation_prompt=True, tokenize=True,
            return_dict=True,
        )["input_ids"]  # fmt: skip
        assert ids == list(served)
        # The run's system prompt where the request has none, the request's own otherwise.
        assert (system.strip() in hf.decode(ids)) == (asked[0]["role"] != "system")


def test_code_llama_70b_is_served_in_the_llama2_format_it_was_trained_in(capsys):
    """CodeLlama-70b-Instruct-hf publishes its own template ("Source: user ... <step>"), not Llama
    2's: a run trained in the family's format must hand vLLM that format, the 7B its own."""
    _, template = _served(capsys, "tunepack-code-llama2-70b", "lora_rank=8")
    assert template == TEMPLATES["llama2"]
    _, template = _served(capsys, "tunepack-code-llama2-7b", "lora_rank=8")
    assert template is None


def test_qwen3_is_served_without_thinking_as_it_was_trained(capsys, tmp_path):
    from transformers import AutoTokenizer

    _, template = _served(capsys, "tunepack-qwen3-0.6b")
    entry = catalog.TINY["qwen3"]
    model_dir = tiny.write_tiny_model(tmp_path / "q", entry)
    hf = AutoTokenizer.from_pretrained(model_dir)
    tokenizer = _tunepack_tokenizer(entry, model_dir)
    ids, _ = tokenizer.tokenize_messages(
        [*_messages(CONVERSATION[:1]), Message("assistant", "")], add_end_tokens=False
    )
    served = hf.apply_chat_template(  # no enable_thinking: the served template turns it off
        CONVERSATION[:1], chat_template=template, add_generation_prompt=True, tokenize=True,
        return_dict=True,
    )["input_ids"]  # fmt: skip
    assert ids == list(served)
    assert "<think>\n\n</think>" in hf.decode(ids)
    # A request may still turn thinking on.
    thinking = hf.apply_chat_template(
        CONVERSATION[:1], chat_template=template, add_generation_prompt=True,
        enable_thinking=True, tokenize=False,
    )  # fmt: skip
    assert thinking.endswith("<|im_start|>assistant\n")


def test_torchtune_alone_lays_out_no_family_as_its_published_template(family):
    """Why the wrapper exists: torchtune 0.6.1's own tokenizers (their default prompt templates)
    render a conversation differently from every family's published template (docs/trainer.md,
    "Chat format", says how)."""
    entry, model_dir, hf = family
    files = {kw: str(model_dir / rel) for kw, rel in entry.tokenizer.files.items()}
    own = tt_config.instantiate(
        OmegaConf.create({"_component_": entry.tokenizer.component, **files})
    )
    ids, _ = own.tokenize_messages(_messages(CONVERSATION[:2]))
    assert ids != _hf_ids(hf, CONVERSATION[:2])
    assert _tunepack_tokenizer(entry, model_dir).tokenize_messages(_messages(CONVERSATION[:2]))[
        0
    ] == _hf_ids(hf, CONVERSATION[:2])


def test_a_gemma_run_on_conversations_with_a_system_message_is_refused_before_the_model_loads(
    tmp_path,
):
    """The trainer checks a chat dataset against the format while it builds its configuration:
    one line naming the file and row, before any model or torchrun starts."""
    from tests.helpers import run_program
    from tunepack.trainers.config import build_config

    entry = catalog.TINY["gemma"]
    workspace = tmp_path / "ws"
    tiny.write_tiny_model(workspace / "model", entry)
    source = tmp_path / "chat.jsonl"
    good = {"messages": CONVERSATION[:2]}
    bad = {"messages": [SYSTEM, *CONVERSATION[:2]]}
    source.write_text("".join(json.dumps(row) + "\n" for row in (good, good, bad, good)))
    done = run_program(
        "tunepack.initializers.dataset",
        {"TUNEPACK_WORKSPACE": str(workspace), "STORAGE_URI": str(source)},
    )
    assert done.returncode == 0, done.stderr
    with pytest.raises(BadDatasetError) as caught:
        build_config(
            entry,
            parse_trainer_args(["max_steps=1"], entry),
            model_dir=workspace / "model",
            dataset_dir=workspace / "dataset",
            output_dir=workspace / "output",
            cache_dir=workspace / "cache",
        )
    assert str(caught.value).startswith(
        "train.jsonl row 3: the gemma chat format has no system role"
    )
    assert "\n" not in str(caught.value)
    assert not (workspace / "output").exists()


@pytest.mark.parametrize("name", ["tiny-llama2", "tiny-mistral", "tiny-llama3.1", "tiny-qwen2.5"])
def test_train_on_input_trains_every_turn_but_not_the_framing(name, tmp_path):
    entry = catalog.get(name) if name in catalog.CATALOG else catalog.TINY[_family_of(name)]
    model_dir = tiny.write_tiny_model(tmp_path / name, entry)
    tokenizer = _tunepack_tokenizer(entry, model_dir)
    messages = [Message(m["role"], m["content"], masked=False) for m in [SYSTEM, *CONVERSATION]]
    ids, mask = tokenizer.tokenize_messages(messages)
    trained = tokenizer.decode([i for i, masked in zip(ids, mask, strict=True) if not masked])
    assert "Iceland" in trained and "zebra" in trained and "one short line" in trained
    # BOS and a template's own default system prompt belong to no turn.
    assert not any(i == tokenizer.bos_id for i, masked in zip(ids, mask, strict=True) if not masked)
    if name == "tiny-qwen2.5":
        ids, mask = tokenizer.tokenize_messages(messages[1:])  # no system message of its own
        trained = tokenizer.decode([i for i, masked in zip(ids, mask, strict=True) if not masked])
        assert "Iceland" in trained and "Alibaba" not in trained


def _family_of(name: str) -> str:
    return next(f for f, e in catalog.TINY.items() if e.name == name)


def test_turns_out_of_order_are_refused_with_the_formats_rule(tmp_path):
    entry = catalog.TINY["llama2"]
    tokenizer = _tunepack_tokenizer(entry, tiny.write_tiny_model(tmp_path / "l2", entry))
    with pytest.raises(BadDatasetError) as caught:
        tokenizer.tokenize_messages(_messages([CONVERSATION[1], CONVERSATION[0]]))
    assert str(caught.value) == (
        "the llama2 chat format needs turns alternating user/assistant after an optional system "
        "message, but a conversation has assistant/user"
    )


def test_max_seq_len_cuts_the_conversation_and_its_mask_together(tmp_path):
    entry = catalog.TINY["qwen2_5"]
    model_dir = tiny.write_tiny_model(tmp_path / "q", entry)
    full, full_mask = _tunepack_tokenizer(entry, model_dir).tokenize_messages(
        _messages(CONVERSATION)
    )
    node = tokenizer_config(entry, model_dir, 20)
    cut, cut_mask = tt_config.instantiate(OmegaConf.create(node)).tokenize_messages(
        _messages(CONVERSATION)
    )
    assert len(full) > 20 and (cut, cut_mask) == (full[:20], full_mask[:20])
