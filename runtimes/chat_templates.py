"""The chat templates tunepack knows, as the Hugging Face Jinja of each family's published model.

Read by the tiny model generator (so tests can compare transformers' rendering with the
trainer's, token by token), by serving (vLLM's ``--chat-template``) and by the docs. Written from
the published files named beside each, without the tool-call branches (docs/trainer.md, "Chat
format"); never taken from user input. Which format a family's published model uses is its
record's ``chat_format`` (``runtimes/families.py``).

Which formats a model may train in, and the checks of the arguments that choose one
(``check_chat_template``, ``check_system_prompt``), are here too: the argument vocabulary
(``tunepack.runtimes.args``) calls them wherever it runs, the initializer images included; the
trainer's layout of each format is ``trainers/data/prompt_format.py``."""

from __future__ import annotations

import re

from tunepack.core.errors import BadValueError, ConflictError
from tunepack.runtimes.families import FAMILIES

# meta-llama/Llama-2-7b-chat-hf (Code Llama 7B/13B Instruct prompt in the same [INST] layout;
# the 70B publishes another template, see OWN_TEMPLATE_DIFFERS).
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)

# mistralai/Mistral-7B-Instruct-v0.1: the template with an optional system message that
# Mistral-7B-Instruct-v0.2 publishes (Mistral's V1 layout: " [INST] ... [/INST] reply</s>").
MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('After the optional system message, conversation roles must "
    "alternate user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {%- if loop.first and system_message is defined %}\n"
    "            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n"
    "        {%- else %}\n"
    "            {{- ' [INST] ' + message['content'] + ' [/INST]' }}\n"
    "        {%- endif %}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {{- ' ' + message['content'] + eos_token}}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('Only user and assistant roles are supported, with the "
    "exception of an initial optional system message!') }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)

# meta-llama/Meta-Llama-3-8B-Instruct (and -70B-Instruct).
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

# meta-llama/Llama-3.1-8B-Instruct (3.1 and 3.3; Llama 3.2's is the same with today's date in
# place of the fixed one when the renderer provides strftime_now). Tool branches left out.
LLAMA3_1 = (
    "{{- bos_token }}\n"
    "{%- if not date_string is defined %}\n"
    '    {%- set date_string = "26 Jul 2024" %}\n'
    "{%- endif %}\n\n"
    "{#- This block extracts the system message, so we can slot it into the right place. #}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    '    {%- set system_message = "" %}\n'
    "{%- endif %}\n\n"
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n'
    '{{- "Cutting Knowledge Date: December 2023\\n" }}\n'
    '{{- "Today Date: " + date_string + "\\n\\n" }}\n'
    "{{- system_message }}\n"
    '{{- "<|eot_id|>" }}\n\n'
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

# meta-llama/Llama-3.2-1B-Instruct (and 3B): Llama 3.1's, dated today where the renderer offers
# strftime_now (transformers and vLLM do), else the same fixed date.
LLAMA3_2 = LLAMA3_1.replace(
    '    {%- set date_string = "26 Jul 2024" %}\n',
    "    {%- if strftime_now is defined %}\n"
    '        {%- set date_string = strftime_now("%d %b %Y") %}\n'
    "    {%- else %}\n"
    '        {%- set date_string = "26 Jul 2024" %}\n'
    "    {%- endif %}\n",
)
assert LLAMA3_2 != LLAMA3_1

# meta-llama/Llama-3.2-11B-Vision-Instruct (and 90B), written from memory of the published
# file (no network here; tool branches left out): a conversation with an image has no system
# turn (a system message is refused), one without images gets Llama 3.1's dated system turn;
# content parts render in order, an image as <|image|>, text untrimmed.
LLAMA3_2_VISION = (
    "{{- bos_token }}\n"
    "{%- if not date_string is defined %}\n"
    "    {%- if strftime_now is defined %}\n"
    '        {%- set date_string = strftime_now("%d %b %Y") %}\n'
    "    {%- else %}\n"
    '        {%- set date_string = "26 Jul 2024" %}\n'
    "    {%- endif %}\n"
    "{%- endif %}\n\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- if messages[0]['content'] is string %}\n"
    "        {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- else %}\n"
    "        {%- set system_message = messages[0]['content'][0]['text']|trim %}\n"
    "    {%- endif %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    '    {%- set system_message = "" %}\n'
    "{%- endif %}\n\n"
    "{%- set image_ns = namespace(has_images=false) %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['content'] is not string %}\n"
    "        {%- for content in message['content'] %}\n"
    "            {%- if content['type'] == 'image' %}\n"
    "                {%- set image_ns.has_images = true %}\n"
    "            {%- endif %}\n"
    "        {%- endfor %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n\n"
    '{%- if image_ns.has_images and not system_message == "" %}\n'
    '    {{- raise_exception("Prompting with images is incompatible with system messages.") }}\n'
    "{%- endif %}\n\n"
    "{%- if not image_ns.has_images %}\n"
    '    {{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n'
    '    {{- "Cutting Knowledge Date: December 2023\\n" }}\n'
    '    {{- "Today Date: " + date_string + "\\n\\n" }}\n'
    "    {{- system_message }}\n"
    '    {{- "<|eot_id|>" }}\n'
    "{%- endif %}\n\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "    {%- if message['content'] is string %}\n"
    "        {{- message['content'] }}\n"
    "    {%- else %}\n"
    "        {%- for content in message['content'] %}\n"
    "            {%- if content['type'] == 'image' %}\n"
    "                {{- '<|image|>' }}\n"
    "            {%- elif content['type'] == 'text' %}\n"
    "                {{- content['text'] }}\n"
    "            {%- endif %}\n"
    "        {%- endfor %}\n"
    "    {%- endif %}\n"
    "    {{- '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

# google/gemma-2b-it, gemma-7b-it and the Gemma 2 -it models: no system role.
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

# google/gemma-3-1b-it (and the 4B/12B/27B -it models, whose template also renders images): a
# system message is folded into the first user turn, its text untrimmed and followed by a blank
# line. Written from memory of the published file (no network here); the image branch is left
# out, as tunepack trains text conversations.
GEMMA3 = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate '
    'user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {{- message['content'] | trim -}}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)

# microsoft/Phi-3-mini-4k-instruct (the template of its July 2024 update).
PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

# microsoft/phi-4.
PHI4 = (
    "{% for message in messages %}{% if (message['role'] == 'system') %}"
    "{{'<|im_start|>system<|im_sep|>' + message['content'] + '<|im_end|>'}}"
    "{% elif (message['role'] == 'user') %}"
    "{{'<|im_start|>user<|im_sep|>' + message['content'] + '<|im_end|>'}}"
    "{% elif (message['role'] == 'assistant') %}"
    "{{'<|im_start|>assistant<|im_sep|>' + message['content'] + '<|im_end|>'}}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_sep|>' }}{% endif %}"
)

# Qwen/Qwen2-7B-Instruct (and the 0.5B/1.5B Instruct models).
QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

QWEN2_5_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# Qwen/Qwen2.5-7B-Instruct (every Qwen 2.5 Instruct size). Tool branches left out.
QWEN2_5 = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\n" + QWEN2_5_SYSTEM + "<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant") %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
    "'\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# Qwen/Qwen3-8B (every Qwen 3 dense size): hybrid thinking. The assistant turns after the last
# user message carry a <think> block (empty when the message has no reasoning); the generation
# prompt opens one only when enable_thinking is false. Tool branches left out.
QWEN3 = (
    "{%- if messages[0].role == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    '    {%- if ns.multi_step_tool and message.role == "user" and message.content is string '
    "and not(message.content.startswith('<tool_response>') and "
    "message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n"
    "    {%- else %}\n"
    "        {%- set content = '' %}\n"
    "    {%- endif %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n"
    "        {%- else %}\n"
    "            {%- if '</think>' in content %}\n"
    "                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}\n"
    "                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "            {%- endif %}\n"
    "        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + "
    "reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "            {%- endif %}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
)

# Format name -> the published Jinja.
TEMPLATES: dict[str, str] = {
    "llama2": LLAMA2,
    "mistral": MISTRAL,
    "llama3": LLAMA3,
    "llama3.1": LLAMA3_1,
    "llama3.2": LLAMA3_2,
    "llama3.2-vision": LLAMA3_2_VISION,
    "gemma": GEMMA,
    "gemma3": GEMMA3,
    "phi3": PHI3,
    "phi4": PHI4,
    "qwen2": QWEN2,
    "qwen2.5": QWEN2_5,
    "qwen3": QWEN3,
}

# Catalog models whose published template is not their family's format. tunepack trains them in
# the family's format, so a server must be given that format's template, never the model's own:
# CodeLlama-70b-Instruct-hf publishes "<s>Source: user\n\n {text} <step> Source: assistant\n
# Destination: user\n\n ", unlike the [INST] layout of the smaller Code Llama Instruct models.
OWN_TEMPLATE_DIFFERS: frozenset[str] = frozenset({"meta-llama/CodeLlama-70b-Instruct-hf"})

# Formats that share a family's special tokens, so a run may pick another one of its group with
# chat_template= (a format's markers must be single tokens of the model's vocabulary).
GROUPS: tuple[tuple[str, ...], ...] = (
    ("llama2", "mistral"),
    ("llama3", "llama3.1", "llama3.2"),
    # Images need <|image|>, which only the vision models' embeddings hold.
    ("llama3.2-vision",),
    ("gemma", "gemma3"),
    ("phi3",),
    ("phi4",),
    ("qwen2", "qwen2.5", "qwen3"),
)


def formats_for(family: str) -> tuple[str, ...]:
    """The chat formats a model of ``family`` can train in: its own first, then its group's."""
    own = FAMILIES[family].chat_format
    group = next(g for g in GROUPS if own in g)
    return (own, *(name for name in group if name != own))


# Formats that have no system role.
NO_SYSTEM = ("gemma",)


def check_chat_template(family: str, chat_template: str | None) -> str:
    """The format a model of ``family`` trains in for ``chat_template`` (None or ``model``: the
    family's own); a format of another group is refused in one line."""
    allowed = formats_for(family)
    if chat_template in (None, "", "model"):
        return FAMILIES[family].chat_format
    if chat_template not in allowed:
        raise BadValueError(
            f"chat_template={chat_template!r} is not valid for this model: expected model (its "
            f"own, {allowed[0]}) or one of {', '.join(allowed)}"
        )
    return chat_template


SYSTEM_PROMPT_MAX = 4000
# Markup that would let a system prompt open or close turns: every format's special tokens look
# like one of these.
_MARKUP = re.compile(
    r"<\|[^<>|\s]*\|>|</?s>|\[/?INST\]|<</?SYS>>|<(?:start|end)_of_turn>|</?think>"
)


def check_system_prompt(text: str, chat_template: str) -> str:
    """A default system message for ``chat_template``, refused in one line where unusable."""
    if not text.strip():
        raise BadValueError(
            f"system_prompt={text!r} is not valid: expected the text of a system message"
        )
    if len(text) > SYSTEM_PROMPT_MAX:
        raise BadValueError(
            f"system_prompt is {len(text)} characters long: expected at most {SYSTEM_PROMPT_MAX}"
        )
    if chat_template in NO_SYSTEM:
        raise ConflictError(
            f"system_prompt={text[:40]!r}: the {chat_template} chat format has no system role "
            "(the model's published template refuses one); leave system_prompt out"
        )
    if found := _MARKUP.search(text):
        raise BadValueError(
            f"system_prompt must not contain the special token {found.group(0)}: it would open "
            "or close a turn of the chat format; give plain text"
        )
    if any(ord(c) < 32 and c not in "\n\t" for c in text):
        raise BadValueError("system_prompt must not contain control characters: give plain text")
    return text


def serving_template(
    fmt: str, family: str, system_prompt: str | None = None, hub_id: str | None = None
) -> str | None:
    """The Jinja a server must apply to prompt a model the way it was trained, or None where
    the model's own template (its tokenizer_config.json) already does.

    - another format than the family's own, or a model (``hub_id``) whose own template is not
      its family's format: that format's template;
    - a default system prompt: set as the first message where a conversation has none;
    - Qwen 3: tunepack trains its replies after an empty thinking block, so thinking is off
      unless a request asks for it (``chat_template_kwargs: {"enable_thinking": true}``).
    """
    import json

    prefix = ""
    if fmt == "qwen3":
        prefix += "{%- if enable_thinking is not defined %}{%- set enable_thinking = false %}"
        prefix += "{%- endif %}\n"
    if system_prompt:
        # A JSON string is a valid Jinja string literal (same escapes).
        message = "{'role': 'system', 'content': " + json.dumps(system_prompt) + "}"
        prefix += (
            "{%- if not messages or messages[0]['role'] != 'system' %}"
            "{%- set messages = [" + message + "] + messages %}{%- endif %}\n"
        )
    if not prefix and fmt == FAMILIES[family].chat_format and hub_id not in OWN_TEMPLATE_DIFFERS:
        return None
    return prefix + TEMPLATES[fmt]
