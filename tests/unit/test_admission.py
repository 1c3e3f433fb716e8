"""The admission policy (``tunepack.tools.admission``): generated from the vocabulary and the
catalog, committed, shipped in the base and installed by ``tunepack install``.

What the API server does with it is proven on the real control plane
(``tests/cluster/test_admission.py``); here: the committed file is the generator's output and
its messages are the vocabulary's own words. That the kustomizations carry it where they
should: tests/integration/test_admission.py.
"""

from __future__ import annotations

import re

import pytest
import yaml

from tests import REPO
from tunepack.runtimes import args as vocab
from tunepack.runtimes import catalog
from tunepack.tools import admission, install

ROOT = REPO


def test_the_committed_policy_is_the_generators_output():
    assert admission.MANIFEST.read_text(encoding="utf-8") == admission.manifest_text(), (
        "manifests/components/admission/policy.yaml is stale: run python -m "
        "tunepack.tools.admission"
    )
    assert list(yaml.safe_load_all(admission.MANIFEST.read_text())) == admission.policy_objects()


def test_check_mode_fails_on_a_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "policy.yaml"
    stale.write_text(admission.manifest_text().replace("lora_rank", "lora_rnak", 1))
    monkeypatch.setattr(admission, "MANIFEST", stale)
    assert admission.main(["--check"]) == 1
    assert "is stale: run python -m tunepack.tools.admission" in capsys.readouterr().err
    assert admission.main([]) == 0
    assert admission.main(["--check"]) == 0


def test_tunepack_install_applies_the_policy_cluster_wide_only():
    objects = install.admission_objects()
    assert [o["kind"] for o in objects] == [admission.POLICY_KIND, admission.BINDING_KIND]
    assert objects[1]["spec"]["policyName"] == objects[0]["metadata"]["name"]
    assert objects[1]["spec"]["validationActions"] == ["Deny"]
    assert install.admission_objects("ml-team") == []
    assert [install.describe(o) for o in objects] == [
        "validatingadmissionpolicy.admissionregistration.k8s.io/tunepack-trainjob-arguments",
        "validatingadmissionpolicybinding.admissionregistration.k8s.io/tunepack-trainjob-arguments",
    ]


def test_every_argument_with_a_rule_is_checked_and_only_model_dependent_ones_are_not():
    validations = admission.policy_objects()[0]["spec"]["validations"]
    checked = {
        key
        for v in validations
        for key in re.findall(r"variables\.kv\.all\(p, !\(p\[0\] == '(\w+)'\)", v["expression"])
    }
    model_dependent = {a.name for a in vocab.VOCABULARY if a.rule.kind == "model"}
    assert model_dependent == {"chat_template", "system_prompt"}
    assert checked == {a.name for a in vocab.VOCABULARY} - model_dependent


def test_the_per_model_facts_cover_the_catalog():
    variables = {
        v["name"]: v["expression"] for v in admission.policy_objects()[0]["spec"]["variables"]
    }
    for entry in catalog.CATALOG.values():
        assert f"'{entry.runtime_name}': {entry.shape.max_seq_len}" in variables["contextWindow"]
    unavailable = variables["unavailable"]
    tiny = catalog.get("tiny-llama3")
    assert "qlora" not in vocab.available_methods(tiny)
    assert admission.q(vocab.unavailable_method_message(tiny, "qlora")) in unavailable


# --- the messages: CEL concatenations of the vocabulary's words --------------------------------
_LITERAL = re.compile(r"'((?:[^'\\]|\\.)*)'")


def _concat(expression: str) -> str:
    """Evaluate a CEL expression made of string literals joined by ``+`` (what cel_message
    writes when every place is a literal)."""
    out, rest = [], expression.strip()
    while rest:
        match = _LITERAL.match(rest)
        assert match, f"not a string literal at {rest[:40]!r}"
        out.append(re.sub(r"\\(.)", r"\1", match.group(1)))
        rest = rest[match.end() :].strip()
        if rest:
            assert rest.startswith("+"), rest[:40]
            rest = rest[1:].strip()
    return "".join(out)


@pytest.mark.parametrize(
    ("message", "values"),
    [
        (vocab.malformed_message, ["epochs"]),
        (vocab.given_twice_message, ["epochs"]),
        (vocab.config_override_message, ["model._component_"]),
        (vocab.unknown_key_message, ["unknown_key"]),
        (lambda given: vocab.lora_with_full_message(given, 1), ["lora_rank=8"]),
        (lambda given: vocab.lora_with_full_message(given, 2), ["lora_rank=8, lora_alpha=16"]),
        (vocab.merge_with_full_message, ["merge=true"]),
        (vocab.context_window_message, ["100000", "tiny-llama3", "512"]),
        (vocab.sliding_window_message, ["8192", "mistral-7b", "4096", "Mistral"]),
        (vocab.no_packing_message, ["gemma2-2b", "it's 'quoted'"]),
        (vocab.method_only_message, ["beta=0.2", "beta", "dpo", "lora"]),
        (vocab.unused_tracker_uri_message, ["none"]),
        (vocab.no_projector_message, ["lora_projector=yes", "tiny-llama3"]),
        (catalog.expert_dropout_message, ["lora_dropout=0.050"]),
        (lambda raw: vocab.invalid_value_message("lora_rank", raw, "an integer"), ["-1"]),
    ],
)
def test_cel_messages_say_what_the_python_message_says(message, values):
    expression = admission.cel_message(message, *(admission.q(v) for v in values))
    assert _concat(expression) == message(*values)


def test_a_message_that_drops_a_value_is_refused():
    with pytest.raises(ValueError, match="does not use its argument"):
        admission.cel_message(lambda a, b: f"only {a}", "'x'", "'y'")
