"""The prompt side of an OpenAI response: `echo` of /v1/completions (the prompt's text before the output, and with
logprobs its tokens with their logprobs — the first one null, as it has nothing before it — in the legacy
`logprobs` object, as OpenAI's legacy API and vLLM's serving_completion.py lay it out), and vLLM's
`prompt_logprobs` extra (completions: per choice; chat: on the response): a list with null first, then per
prompt token {token id: {logprob, rank, decoded_token}} holding the prompt token and the top alternatives.

The values come with a request's first delta (Delta.prompt_logprobs: positions 1 .. len - 1).
"""
from __future__ import annotations

from typing import Callable

from scheduler.http import response_schemas as s
from scheduler.request import TokenLogprob


def vllm_prompt_logprobs(entries: tuple[TokenLogprob, ...], text: Callable[[int], str]) -> s.PromptLogprobsOut:
    """vLLM's prompt_logprobs layout: None for the first prompt token, then {id: Logprob} per later token."""
    out: s.PromptLogprobsOut = [None]
    for t in entries:
        d = {str(t.token_id): s.PromptLogprobOut(logprob=t.logprob, rank=t.rank, decoded_token=text(t.token_id))}
        for rank, (i, lp) in enumerate(t.top, 1):
            d.setdefault(str(i), s.PromptLogprobOut(logprob=lp, rank=rank, decoded_token=text(i)))
        out.append(d)
    return out


def echo_logprobs(out: s.CompletionLogprobs, prompt_ids: tuple[int, ...], entries: tuple[TokenLogprob, ...],
                  top: int, text: Callable[[int], str], offset: int) -> int:
    """Appends the prompt's tokens to a legacy logprobs object: the first with null logprob and alternatives,
    the others with their logprob and `top` alternatives (plus the token itself, as for sampled tokens).
    Returns the text offset after them."""
    for k, token_id in enumerate(prompt_ids):
        piece = text(token_id)
        out.tokens.append(piece)
        out.text_offset.append(offset)
        offset += len(piece)
        t = entries[k - 1] if 0 < k <= len(entries) else None
        if t is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(t.logprob)
        alternatives = {text(i): lp for i, lp in t.top[:top]}
        alternatives.setdefault(piece, t.logprob)
        out.top_logprobs.append(alternatives)
    return offset
