"""Which tool-call syntax the scheduler reads (tool_choice "auto"): named by --tool-call-parser (vLLM's names), or
recognised in the chat template, once at startup. Qwen2.5, Qwen3, Hermes and SmolLM3 all write Hermes' <tool_call>
tags, so they share "hermes" (vLLM serves them with it too); "none" turns "auto" off.
"""
from __future__ import annotations

import logging

from scheduler.tool_parsers.hermes import Hermes
from scheduler.tool_parsers.llama3_json import PYTHON_TAG, Llama3Json
from scheduler.tool_parsers.mistral import TOOL_CALLS, Mistral
from scheduler.tool_parsers.openai_harmony import CHANNEL, MESSAGE, OpenAIHarmony
from scheduler.tool_parsers.syntax import Syntax

log = logging.getLogger(__name__)

SYNTAXES: dict[str, type[Syntax]] = {s.name: s for s in (Hermes, Llama3Json, Mistral, OpenAIHarmony)}
NAMES = (*SYNTAXES, "none")  # --tool-call-parser's choices
# (what a family's chat template says, the syntax), most specific first: a harmony template also mentions tools
_SIGNS = (((CHANNEL, MESSAGE), "openai"), ((TOOL_CALLS,), "mistral"), (("<tool_call>",), "hermes"),
          ((PYTHON_TAG,), "llama3_json"), (("respond with a JSON for a function call",), "llama3_json"))


def from_template(template: str | None) -> str | None:
    """The syntax a chat template teaches its model; None when it shows none of them."""
    for signs, name in _SIGNS:
        if template and all(s in template for s in signs):
            return name
    return None


def choose(flag: str | None, template: str | None) -> Syntax | None:
    """The syntax to read: flag (--tool-call-parser; None = from the chat template; "none" = no parsing)."""
    if flag == "none":
        log.info("tool calls: --tool-call-parser none: tool_choice \"auto\" is refused")
        return None
    name = flag or from_template(template)
    if name is None:
        log.info("tool calls: the chat template shows no known tool-call syntax: tool_choice \"auto\" is refused "
                 "(--tool-call-parser %s names one)", "|".join(SYNTAXES))
        return None
    if name not in SYNTAXES:
        raise ValueError(f"--tool-call-parser {name!r} is not one of {', '.join(NAMES)}")
    log.info("tool calls: tool_choice \"auto\" reads the %s syntax (%s)", name,
             "--tool-call-parser" if flag else "recognised in the chat template")
    return SYNTAXES[name]()
