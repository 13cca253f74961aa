"""A Qwen2.5-style chat template (ChatML with Hermes tool calls: the tools listed in <tools>, calls in
<tool_call> tags, results in <tool_response>), for the tiny checkpoints whose tokenizer is ChatML: the tests of
tool_choice "auto" render and parse through it as with Qwen2.5 / Qwen3."""

HERMES_TEMPLATE = """\
{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{% for m in messages %}
{% if m.role == 'assistant' %}
<|im_start|>assistant
{% if m.content %}{{ m.content }}{% endif %}
{% for c in m.tool_calls or [] %}
{% if m.content or not loop.first %}

{% endif %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{% endfor %}
<|im_end|>
{% elif m.role == 'tool' %}
<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role != 'system' %}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""
