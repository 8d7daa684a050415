"""Tool calls read from model output (serving/tools.py): each family's parser, the forced-call
grammars, and the streaming split of content and tool-call deltas."""

import json

import jsonschema
import pytest

from serving import tools
from serving.errors import APIError

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                                                "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def args(call):
    return json.loads(call["function"]["arguments"])


@pytest.mark.parametrize("parser,text,content,calls", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Oslo"})]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>\n<tool_call>'
               '{"name": "get_time", "arguments": {}}</tool_call>', None,
     [("get_weather", {"city": "A"}), ("get_time", {})]),
    ("hermes", "No tools needed: it is sunny.", "No tools needed: it is sunny.", []),
    ("hermes", "<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "c"}}', None,
     [("get_weather", {"city": "Rome", "unit": "c"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": '
                    '{"city": "B"}}', None, [("get_time", {}), ("get_weather", {"city": "B"})]),
    ("llama3_json", "The answer is 4.", "The answer is 4.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
     [("get_weather", {"city": "Paris"})]),
    ("mistral", '[{"name": "get_time", "arguments": {}}]', None, [("get_time", {})]),
    ("mistral", "Bonjour.", "Bonjour.", []),
])
def test_parsers(parser, text, content, calls):
    got_content, got = tools.parse(text, parser)
    assert got_content == content
    assert [(c["function"]["name"], args(c)) for c in got] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got)


def test_check_tools_and_choice():
    assert tools.check(None, None) == ([], None)
    tl, choice = tools.check([WEATHER, TIME], None)
    assert choice == "auto" and [t["function"]["name"] for t in tl] == ["get_weather", "get_time"]
    assert tools.check([WEATHER], "none")[1] is None
    assert tools.check([WEATHER], {"type": "function", "function": {"name": "get_weather"}})[1] == "get_weather"
    for bad, param in (([{"type": "function"}], "tools[0]"),
                       ([{"type": "function", "function": {"name": "bad name"}}], "tools[0].function.name"),
                       ([WEATHER, WEATHER], "tools[1].function.name")):
        with pytest.raises(APIError) as e:
            tools.check(bad, None)
        assert e.value.param == param
    for choice in ("required", "auto"):
        with pytest.raises(APIError, match="needs tools"):
            tools.check([], choice)
    with pytest.raises(APIError, match="not among the tools"):
        tools.check([WEATHER], {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(APIError, match="invalid"):
        tools.check([WEATHER], "always")


def test_forced_grammars_are_the_schemas_of_the_calls():
    tl, _ = tools.check([WEATHER, TIME], None)
    named = tools.grammar(tl, "get_weather", None)
    assert named.json == WEATHER["function"]["parameters"]
    req = tools.grammar(tl, "required", None).json
    call = [{"name": "get_weather", "parameters": {"city": "X"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(call, req)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], req)  # city is required
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], req)
    assert tools.grammar(tl, "required", False).json["maxItems"] == 1
    assert tools.grammar(tl, "auto", None) is None
    calls = tools.forced_calls(json.dumps(call), "required")
    assert [(c["function"]["name"], args(c)) for c in calls] == [("get_weather", {"city": "X"}), ("get_time", {})]
    assert tools.forced_calls('[{"name": "get_w', "required") == []  # cut by max_tokens


def feed_all(stream, pieces):
    content, deltas = "", []
    for p in pieces:
        c, d = stream.feed(p)
        content += c
        deltas += d
    c, d = stream.end()
    return content + c, deltas + d


def merged(deltas):
    """OpenAI client-side merge of streamed tool-call deltas: by index, name once, arguments joined."""
    calls = {}
    for d in deltas:
        c = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
        c["id"] = d.get("id", c["id"])
        fn = d.get("function", {})
        c["name"] = fn.get("name", c["name"])
        c["arguments"] += fn.get("arguments", "")
    return [calls[k] for k in sorted(calls)]


def test_streaming_split():
    text = 'Checking <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    s = tools.Stream("auto", "hermes")
    content, deltas = feed_all(s, pieces)
    assert content == "Checking " and s.has_calls
    assert [(c["name"], json.loads(c["arguments"])) for c in merged(deltas)] == [("get_time", {})]
    assert deltas[0]["id"].startswith("call_") and "name" in deltas[0]["function"]  # name first
    s = tools.Stream("auto", "hermes")  # content with a '<' that is not a call
    assert feed_all(s, ["a <b", "> c"]) == ("a <b> c", []) and not s.has_calls
    s = tools.Stream("auto", "llama3_json")
    content, deltas = feed_all(s, [" {", '"name": "get_weather", ', '"parameters": {"city": "Z"}}'])
    assert content == "" and merged(deltas)[0]["name"] == "get_weather"
    s = tools.Stream("get_weather", "hermes")  # named: arguments stream as generated
    first, d1 = s.feed('{"city": ')
    assert first == "" and d1[0]["function"] == {"name": "get_weather", "arguments": ""}
    content, deltas = feed_all(s, ['"Q"}'])
    assert json.loads(merged(d1 + deltas)[0]["arguments"]) == {"city": "Q"}
    s = tools.Stream("required", "mistral")
    content, deltas = feed_all(s, ['[{"name": "get_time", ', '"parameters": {}}]'])
    assert content == "" and merged(deltas)[0]["name"] == "get_time"


def test_finish_reason_and_message():
    msg, calls = tools.message('{"city": "A"}', "get_weather", "hermes")
    assert calls and msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "get_weather"
    assert tools.finish_reason("stop", "get_weather", True) == "stop"
    assert tools.finish_reason("stop", "required", True) == "tool_calls"
    assert tools.finish_reason("length", "required", False) == "length"
    msg, calls = tools.message("plain", "auto", "hermes")
    assert msg == {"role": "assistant", "content": "plain"} and not calls
    assert tools.default_parser("LlamaForCausalLM") == "llama3_json"
    assert tools.default_parser("MistralForCausalLM") == "mistral"
    assert tools.default_parser("Qwen2ForCausalLM") == "hermes"


def test_template_messages_turn_arguments_into_objects():
    m = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"}]
    out = tools.template_messages(m)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1} and out[1] == m[1]


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_required_calls_stream_one_by_one(step):
    """Each call's id and name once its name is complete, then its arguments in fragments that
    join to the whole arguments, braces and quotes inside strings included."""
    calls = [{"name": "get_weather", "parameters": {"city": "a \"}{[\" \\\\ b", "unit": "c"}},
             {"name": "get_time", "parameters": {}},
             {"name": "get_weather", "parameters": {"city": "x", "n": {"deep": [1, {"k": "]"}]}}}]
    text = json.dumps(calls)
    s = tools.Stream("required", "hermes")
    deltas = []
    for i in range(0, len(text), step):
        content, d = s.feed(text[i:i + step])
        assert content == ""
        deltas += d
    deltas += s.end()[1]
    got = merged(deltas)
    assert [c["name"] for c in got] == ["get_weather", "get_time", "get_weather"]
    assert [json.loads(c["arguments"]) for c in got] == [c["parameters"] for c in calls]
    assert len({c["id"] for c in got}) == 3 and s.has_calls
    if step < 10:
        assert sum(1 for d in deltas if d["index"] == 0 and "name" not in d["function"]) > 2  # fragments
    cut = tools.Stream("required", "hermes")  # cut by max_tokens inside the second call's arguments
    d = cut.feed(text[:text.index('"x"')])[1] + cut.end()[1]
    assert [c["name"] for c in merged(d)] == ["get_weather", "get_time", "get_weather"]


@pytest.mark.parametrize("parser,text,content", [
    ("hermes", 'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "O\\"}slo"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me look. "),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "O\\"}slo"}}; '
                    '{"name" : "get_time" , "parameters" : {}}', ""),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "O\\"}slo"}}, '
                '{"name": "get_time", "arguments": {}}]', ""),
])
def test_auto_calls_stream_as_generated(parser, text, content):
    """auto: a call's id and name go out once its head is complete, its arguments before the output
    ends (fragments), and the deltas join to what the non-streamed answer parses."""
    s = tools.Stream("auto", parser)
    got_content, deltas, before_end = "", [], None
    for i in range(0, len(text), 4):
        c, d = s.feed(text[i:i + 4])
        got_content += c
        deltas += d
    before_end = list(deltas)
    c, d = s.end()
    got_content += c
    deltas += d
    assert got_content == content and s.has_calls
    want = tools.parse(text, parser)[1]
    got = merged(deltas)
    assert [c["name"] for c in got] == [w["function"]["name"] for w in want] == ["get_weather", "get_time"]
    assert [json.loads(c["arguments"]) for c in got] == [json.loads(w["function"]["arguments"]) for w in want]
    # streamed: the first call was complete (name and arguments) before the output ended
    first = merged([d for d in before_end if d["index"] == 0])
    assert first and json.loads(first[0]["arguments"]) == {"city": 'O"}slo'}
    assert sum(1 for d in before_end if d["index"] == 0 and "name" not in d["function"]) > 1


def test_auto_call_with_arguments_first_is_sent_whole_at_the_end():
    s = tools.Stream("auto", "llama3_json")
    content, deltas = feed_all(s, ['{"parameters": {"city": "Z"}, ', '"name": "get_weather"}'])
    assert content == "" and s.has_calls
    assert [(c["name"], json.loads(c["arguments"])) for c in merged(deltas)] == [("get_weather", {"city": "Z"})]
