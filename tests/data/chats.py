"""Conversations and templates the chat-template and chat fine-tuning tests share."""

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
CONVERSATIONS = {
    "system and user": [{"role": "system", "content": "You are a helpful assistant."},
                        {"role": "user", "content": "What is the weather in Paris?"}],
    "multi-turn": [{"role": "system", "content": "Answer in JSON."},
                   {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! <b>&</b>"},
                   {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "You are welcome."}],
    "tool calls": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny, 21"},
        {"role": "tool", "tool_call_id": "b", "content": "rain, 14"},
        {"role": "assistant", "content": "Paris is sunny; Rome is rainy."},
        {"role": "user", "content": "And tomorrow?"}],
}

LOOPS_AND_FILTERS = """\
{%- if messages[0].role == 'system' %}{% set system = messages[0].content | trim %}{% set rest = messages[1:] %}
{%- else %}{% set system = 'You are dsv3. Today is ' + today + '.' %}{% set rest = messages %}{% endif -%}
{{ bos_token }}<|system|>
{{ system }}
{% if tools %}
# Tools
{% for tool in tools %}
{{ loop.index }}. {{ tool.function | tojson }}
{% endfor %}
{% endif %}
{% set ns = namespace(turns=0) %}
{% for m in rest %}
    {% if m.role == 'system' %}{{ raise_exception('a system message must come first') }}{% endif %}
    {% if m.role == 'tool' %}
<|tool|>{{ m.content }}
        {% continue %}
    {% endif %}
<|{{ m.role }}|>
{{ (m.content | default('', true) | upper) if m.role == 'user' else m.content | default('', true) }}
    {% for call in m.tool_calls | default([]) %}
<call>{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson(indent=1) }}</call>
    {% endfor %}
    {% if m.role == 'assistant' %}{{ eos_token }}{% endif %}
    {% set ns.turns = ns.turns + 1 %}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>
{% endif %}"""
