"""The reasoning parsers by name (--reasoning-parser, vLLM's names), and the one choice of a parser for a
model: the flag's, else by family — the architecture and the chat template's markers — else none. A parser
whose markers are not single tokens of the vocabulary cannot tell where the answer starts: the flag's is
refused at startup, a guessed one is left off (logged)."""
from __future__ import annotations

import logging
from typing import Callable

from scheduler.reasoning.gpt_oss import GptOssParser
from scheduler.reasoning.parser import Encode, ReasoningParser
from scheduler.reasoning.think_tags import DeepSeekR1Parser, Qwen3Parser, SmolLM3Parser

log = logging.getLogger("tandem.scheduler")

PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (Qwen3Parser, DeepSeekR1Parser, SmolLM3Parser,
                                                                  GptOssParser)}
AUTO, NONE = "auto", "none"
CHOICES = (AUTO, NONE, *PARSERS)


def guess(architecture: str, chat_template: str | None) -> str | None:
    """The family's parser name, from the architecture and the chat template; None: the model does not think."""
    template = chat_template or ""
    if architecture.startswith("GptOss") or "<|channel|>" in template:
        return "gpt_oss"
    if "<think>" not in template:
        return None
    if "/no_think" in template:
        return "smollm3"
    if "Assistant｜>" in template or architecture.startswith("DeepseekV3"):
        return "deepseek_r1"
    return "qwen3"  # any other template that writes think tags (Qwen3, QwQ-like): opened by the model or the prompt


def single_tokens(parser: type[ReasoningParser], encode: Encode) -> str | None:
    """Why the parser cannot run on this vocabulary (a marker that is not one token), or None."""
    for marker in parser.markers:
        ids = list(encode(marker))
        if len(ids) != 1:
            return f"{marker!r} is not one token of the vocabulary (it encodes to {len(ids)})"
    return None


def choose(flag: str, architecture: str, chat_template: str | None, encode: Encode,
           error: Callable[[str], Exception] = ValueError) -> ReasoningParser | None:
    """The parser to run: flag (a name, "none", or "auto" = by family). A named parser that cannot run raises
    error(message)."""
    if flag == NONE:
        return None
    name = guess(architecture, chat_template) if flag == AUTO else flag
    if name is None:
        return None
    if name not in PARSERS:
        raise error(f"--reasoning-parser {name!r} is not known; choose one of {', '.join(CHOICES)}")
    why = single_tokens(PARSERS[name], encode)
    if why is not None:
        if flag == AUTO:
            log.info("reasoning parser %s (guessed from the model) left off: %s", name, why)
            return None
        raise error(f"--reasoning-parser {name}: {why}; this model cannot use it (--reasoning-parser none)")
    log.info("reasoning parser: %s%s", name, " (guessed from the model)" if flag == AUTO else "")
    return PARSERS[name](encode)
