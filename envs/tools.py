"""Qwen's tool-call format: find the calls in a model turn, each one parsed or with what was wrong.

Qwen2.5 and Qwen3 models call a tool by writing, in their turn,

    <tool_call>
    {"name": "crop", "arguments": {"bbox": [x1, y1, x2, y2]}}
    </tool_call>

`parse_calls(text)` returns one `Call` per `<tool_call>` block, in order: its name and arguments, or the
reason it cannot be run ("malformed": not JSON, not an object with a string "name" and an object
"arguments", or a block never closed). Text outside the blocks is the model's own.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(" + re.escape(CLOSE) + r"|$)", re.DOTALL)
MAX_CALL_CHARS = 4096
"""A call longer than this is malformed (nothing the model writes makes the parser slow)."""


@dataclass
class Call:
    """One tool call of a model turn."""

    name: str = ""
    arguments: dict = field(default_factory=dict)
    error: str = ""
    """Why the call cannot run ("" when it parsed); `detail` says it in words."""
    detail: str = ""


def parse_calls(text: str) -> list[Call]:
    """Every `<tool_call>` block of `text`, in order (see module docstring)."""
    calls = []
    for match in _BLOCK.finditer(text):
        body, closed = match.group(1).strip(), bool(match.group(2))
        calls.append(_parse(body, closed))
    return calls


def _parse(body: str, closed: bool) -> Call:
    if not closed:
        return Call(error="malformed", detail=f"the tool call is not closed with {CLOSE}")
    if len(body) > MAX_CALL_CHARS:
        return Call(error="malformed", detail=f"the tool call is longer than {MAX_CALL_CHARS} characters")
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as exc:
        return Call(error="malformed", detail=f"the tool call is not valid JSON ({str(exc)[:80]})")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return Call(error="malformed", detail='the tool call must be a JSON object with a string "name"')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return Call(name=value["name"], error="malformed", detail='"arguments" must be a JSON object')
    return Call(name=value["name"], arguments=arguments)
