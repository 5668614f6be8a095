"""Tool calling's test functions, history and calls (test_tools')."""
from __future__ import annotations

import json

from quickdraft.structured.tools import Function

WEATHER = Function("get_weather", {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}, "The weather in a city")
TIME = Function("get_time", {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                             "required": ["zone"], "additionalProperties": False})
# pydantic's shape for a nested model: references into the function's own $defs
NESTED = Function("book", {"$defs": {"Guest": {"type": "object", "properties": {"name": {"type": "string",
                                                                                          "maxLength": 8}},
                                               "required": ["name"], "additionalProperties": False}},
                           "type": "object", "properties": {"guests": {"type": "array", "maxItems": 2,
                                                                       "items": {"$ref": "#/$defs/Guest"}}},
                           "required": ["guests"], "additionalProperties": False})
FUNCTIONS = (WEATHER, TIME, NESTED)


def call_json(name: str, arguments: dict) -> str:
    return json.dumps({"name": name, "arguments": arguments})


HISTORY = [{"role": "user", "content": "Weather in Oslo?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "-3 and snow"}]


OSLO = ("get_weather", {"city": "Oslo", "unit": "c"})
UTC = ("get_time", {"zone": "UTC"})
