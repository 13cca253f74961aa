"""vLLM's extra request parameters, checked against vLLM 0.10.1.1's vllm/entrypoints/openai/protocol.py
(ChatCompletionRequest and CompletionRequest: its "sampling-params" and "extra-params" blocks, and StreamOptions).
Clients written for vLLM send them (guidellm sends stream_options.continuous_usage_stats and ignore_eos on every
request), so each one is named in the request schemas: those this server serves are honoured there (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output, skip_special_tokens,
prompt_logprobs, return_tokens_as_token_ids, guided_*, continuous_usage_stats, request_id, cache_salt), and the rest are
accepted at the value that changes nothing (vLLM's default) and otherwise refused here, 400 naming the field and
why it cannot apply — never as an unknown field.

chat_template_kwargs, reasoning_effort and include_reasoning are the reasoning fields' (scheduler/reasoning/).
SGLang's no_stop_trim, separate_reasoning, stream_reasoning and return_hidden_states are accepted the same way: a
router in front (vllm-router 0.1.17) adds them to every chat request at SGLang's defaults.
"""
from __future__ import annotations

from typing import Any, Callable

from scheduler.http.errors import BadParameter
from scheduler.http.request_schemas import ChatCompletionRequest, CompletionRequest, SamplingFields

GUIDED_BACKENDS = ("auto", "guidance", "llguidance")  # this server's structured output is llguidance's

_NO_BEAM = "this server samples one token per step for each sequence and runs no beam search"
_NO_CODE = "this server runs no code named by a request"
# field -> (whether the value changes nothing, why any other value cannot apply)
_BOTH: dict[str, tuple[Callable[[Any, SamplingFields], bool], str]] = {
    "use_beam_search": (lambda v, b: v is False, _NO_BEAM),
    "length_penalty": (lambda v, b: v == 1.0, f"length_penalty only weighs beam search's candidates: {_NO_BEAM}"),
    "spaces_between_special_tokens": (
        lambda v, b: v is True or b.skip_special_tokens is not False,
        "special tokens kept in the text (skip_special_tokens: false) are joined as the tokenizer's own decoder "
        "joins them"),
    "truncate_prompt_tokens": (lambda v, b: False, "prompts are never cut by this server: a prompt longer than the "
                               "model takes is refused (400); shorten it before sending"),
    "allowed_token_ids": (lambda v, b: False, "restricting the vocabulary by token ids is not served: use "
                          "logit_bias, or structured output (guided_choice, guided_regex, response_format)"),
    "guided_decoding_backend": (lambda v, b: v in GUIDED_BACKENDS,
                                f"structured output runs on llguidance only ({', '.join(GUIDED_BACKENDS)})"),
    "guided_whitespace_pattern": (lambda v, b: False, "llguidance's JSON grammar sets the whitespace between "
                                  "tokens itself; a pattern cannot be given"),
    "priority": (lambda v, b: v == 0, "this server schedules requests first come, first served (no priority "
                 "scheduling): only priority 0 is served"),
    "logits_processors": (lambda v, b: not v, _NO_CODE),
    "vllm_xargs": (lambda v, b: not v, "extension arguments for vLLM plugins: this server has no plugins"),
    "kv_transfer_params": (lambda v, b: False, "vLLM's KV-connector parameters are not served: Tandem moves KV "
                           "between executors itself (docs/fleet.md)"),
}
_CHAT: dict[str, tuple[Callable[[Any, SamplingFields], bool], str]] = {
    "best_of": (lambda v, b: v == (b.n or 1), "only best_of equal to n is served (no ranking of extra samples)"),
    "bad_words": (lambda v, b: not v, "bad_words is not served: steer the output with logit_bias or structured "
                  "output"),
    "echo": (lambda v, b: v is False, "echo of the last message (with continue_final_message) is not served"),
    "add_generation_prompt": (lambda v, b: v is True, "the chat template is always rendered with the generation "
                              "prompt, as a new assistant turn"),
    "continue_final_message": (lambda v, b: v is False, "the chat template is always rendered with a new "
                               "assistant turn: continuing the last message is not served"),
    "add_special_tokens": (lambda v, b: v is False, "the chat template writes the special tokens itself"),
    "documents": (lambda v, b: not v, "documents are not passed to the chat template: put them in the messages"),
    "chat_template": (lambda v, b: False, "a request cannot bring a chat template: the scheduler's "
                      "--chat-template FILE replaces the model's"),
    "mm_processor_kwargs": (lambda v, b: not v, "this server serves text only"),
    "structural_tag": (lambda v, b: False, "structural tags are not served: use guided_json, guided_regex, "
                       "guided_grammar or response_format"),
    # SGLang's chat fields, which vllm-router 0.1.17 adds to every chat request it forwards (at SGLang's defaults)
    "no_stop_trim": (lambda v, b: v is False, "a stop string is trimmed from the text unless "
                     "include_stop_str_in_output is true: send that instead"),
    "separate_reasoning": (lambda v, b: v is True, "the reasoning is always split from the answer when the "
                           "scheduler runs a --reasoning-parser; include_reasoning: false leaves it out"),
    "stream_reasoning": (lambda v, b: v is True, "reasoning is streamed as it is written (delta.reasoning_content)"),
    "return_hidden_states": (lambda v, b: v is False, "hidden states are not returned by this server"),
}
_COMPLETION: dict[str, tuple[Callable[[Any, SamplingFields], bool], str]] = {
    "add_special_tokens": (lambda v, b: v is True, "text prompts are encoded with the tokenizer's special tokens "
                           "(e.g. BOS); send token ids for a prompt without them"),
    "prompt_embeds": (lambda v, b: False, "prompts are text or token ids: embeddings as input are not served"),
}


def check(body: ChatCompletionRequest | CompletionRequest) -> None:
    """Refuses (400 naming the field) a vLLM extra this server cannot apply at the value given."""
    table = {**_BOTH, **(_CHAT if isinstance(body, ChatCompletionRequest) else _COMPLETION)}
    for field, (harmless, why) in table.items():
        value = getattr(body, field, None)
        if value is not None and not harmless(value, body):
            raise BadParameter(field, f"{field}={value!r:.60} cannot be served: {why}")
