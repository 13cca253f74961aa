"""One request's token state inside the scheduler: its tokens, where its KV cache stands, and the stops it can
see in token ids (EOS, stop token ids, length). What goes back to the client — text, stop strings, deltas —
is the request side's RequestStream (scheduler/output/request_stream.py)."""
from __future__ import annotations

import enum
from typing import Sequence as Seq

from scheduler.structured.constraint import TokenConstraint
from scheduler.request import Finish, FinishReason, GenerateRequest, TokenLogprob
from tandem.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted: its cache was released and it will be recomputed)
    RUNNING = "running"  # admitted: it holds (or is about to get) a cache and takes part in steps
    FINISHED = "finished"


class Sequence:
    def __init__(self, request: GenerateRequest, arrival: int, eos_token_ids: Seq[int], max_seq_len: int,
                 sampling: tuple[SamplingParams, SamplingParams] | None = None) -> None:
        self.request = request
        self.arrival = arrival  # order of submission: smaller = older
        self.status = Status.WAITING
        self.output_ids: list[int] = []
        self.cache_id = ""  # "" until the executor created one
        self.num_cached = 0  # tokens of all_ids written into the cache (or reused from the prefix cache)
        self.prefix_hit = 0  # prompt tokens the executor's prefix cache served at its first admission
        # Looked up in the prefix cache (CreateCache) since it last lost its cache: the shared tokens running
        # requests had written then; -1 = not yet (with prefix caching it is not admitted before).
        self.prefix_looked_up = -1
        self.preemptions = 0  # times its cache was lost (preemption, executor restart) and recomputed
        self.lost_tokens = 0  # tokens its lost caches held, to compute again (counted at its next admission)
        self.drafted_tokens = 0  # speculative decoding: draft tokens sent for verification ...
        self.accepted_tokens = 0  # ... and those the executor accepted
        self.queued_at = 0.0  # when it last entered the waiting queue (the policy's clock)
        self.admitted_at = 0.0  # when it last entered the running batch (the policy's clock)
        # It has been admitted once (it may have streamed tokens): the queue-time bound never ends it after.
        self.started = False
        # The executor's sampling, built once: (normal, before min_new_tokens).
        self.executor_sampling = sampling or (request.sampling, request.sampling)
        # The one of them registered with the current cache (sent on a final item the executor applied).
        self.registered_sampling: SamplingParams | None = None
        stop = request.stopping
        self.eos_token_ids = frozenset(() if stop.ignore_eos else eos_token_ids)  # the EOS ids that stop it
        self._max_len = min(len(request.prompt_ids) + stop.max_new_tokens, max_seq_len)
        # Structured output: the grammar state, advanced with each appended token (None = unconstrained)
        self.constraint = (TokenConstraint(request.constraint, request.constraint_after)
                           if request.constraint is not None else None)
        # Prompt logprobs gathered from the executor (positions 1 ..) until they go out with the first token;
        # a cache lost before that loses them too (the recompute asks again), never after (sent once).
        self.prompt_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs_sent = False

    # ----------------------------------------------------------------- token accounting
    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop] without building all_ids (prompt, then output)."""
        prompt = self.request.prompt_ids
        n = len(prompt)
        if stop <= n:
            return list(prompt[start:stop])
        if start >= n:
            return self.output_ids[start - n:stop - n]
        return list(prompt[start:]) + self.output_ids[:stop - n]

    @property
    def remaining(self) -> int:
        """Tokens still to write before the next token can be sampled (1 for a decoding sequence)."""
        return self.num_tokens - self.num_cached

    @property
    def is_decoding(self) -> bool:
        return self.remaining == 1 and bool(self.output_ids)

    @property
    def prompt_end_sent(self) -> bool:
        """Whether the executor knows where its cache's prompt ends (a final item, which carries prompt_len, was
        applied since the cache was made). Until then the cache may hold outputs the executor counts as prompt —
        a recomputed sequence whose reused prefix covers all but its last token — and a Decode item, which has
        no prompt_len, would leave them out of the presence/frequency penalties."""
        return self.registered_sampling is not None

    @property
    def tokens_left(self) -> int:
        """Tokens it may still sample before max_new_tokens or the model's length ends it (>= 1 while live)."""
        return self._max_len - self.num_tokens

    def draft_room(self) -> int:
        """Draft tokens a decoding step may verify for it: the accepted ones and the token sampled after them
        must fit max_new_tokens and the model's length; none while it is short of min_new_tokens (the EOS ban
        then differs from one position to the next)."""
        if len(self.output_ids) < self.request.stopping.min_new_tokens:
            return 0
        return max(0, self.tokens_left - 1)

    def reset_cache(self) -> None:
        """After preemption (or the executor's loss): the cache is gone; everything will be recomputed
        (outputs stay: they were sent)."""
        self.lost_tokens += self.num_cached
        self.drop_cache()
        self.status = Status.WAITING
        self.preemptions += 1

    def drop_cache(self) -> None:
        """Forgets the cache (released, or gone with its executor)."""
        self.cache_id = ""
        self.num_cached = 0
        self.registered_sampling = None
        self.prefix_looked_up = -1
        if not self.prompt_logprobs_sent:
            self.prompt_logprobs = []

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        """The alternatives to ask the executor for with the prompt's items (and CreateCache); None once sent
        or when the request asked for none."""
        return None if self.prompt_logprobs_sent else self.request.prompt_logprobs

    def written(self, cache_id: str, seq_len: int, prompt_logprobs: Seq[TokenLogprob] = ()) -> None:
        """A step item ran: the cache now holds seq_len tokens; the item's prompt logprobs are kept."""
        self.cache_id, self.num_cached = cache_id, seq_len
        if prompt_logprobs and not self.prompt_logprobs_sent:
            self.prompt_logprobs.extend(prompt_logprobs)

    def take_prompt_logprobs(self) -> tuple[TokenLogprob, ...] | None:
        """The prompt logprobs to send with the first token (None: not asked, or sent already)."""
        if self.request.prompt_logprobs is None or self.prompt_logprobs_sent:
            return None
        self.prompt_logprobs_sent = True
        out, self.prompt_logprobs = tuple(self.prompt_logprobs), []
        return out

    def adopt_prefix(self, cache_id: str, cached_tokens: int, prompt_logprobs: Seq[TokenLogprob] = ()) -> None:
        """A waiting sequence got a cache from CreateCache holding its first cached_tokens tokens (and, when it
        asked, their prompt logprobs)."""
        self.cache_id, self.num_cached = cache_id, cached_tokens
        if not self.prompt_logprobs_sent:
            self.prompt_logprobs = list(prompt_logprobs)
        if not self.preemptions and not self.output_ids:
            self.prefix_hit = cached_tokens

    def sampling_for_next_token(self) -> SamplingParams:
        """The sampling message for the token sampled after this step: EOS and stop tokens are banned
        while fewer than min_new_tokens exist."""
        normal, early = self.executor_sampling
        return early if len(self.output_ids) < self.request.stopping.min_new_tokens else normal

    def sampling_to_send(self, registered: bool) -> SamplingParams | None:
        """The sampling message a final item carries. With an executor that registers sampling with the cache
        (registered=True), None (unset: the registered parameters) unless the cache has none yet or they
        change (the min_new_tokens switch) — so a large logit_bias travels once per cache."""
        want = self.sampling_for_next_token()
        return None if registered and want is self.registered_sampling else want

    @property
    def reuses_prefix(self) -> bool:
        """Whether a cached prefix may start its cache (CreateCache): not for mean pooling, which reads the hidden
        state of every position."""
        return self.request.pooling is None or not self.request.pooling.every_position

    @property
    def allows_drafts(self) -> bool:
        """Whether speculative decoding may propose draft tokens for this sequence: not under a constraint
        (a token mask covers only the token sampled after an item, never drafts)."""
        return self.constraint is None

    # ----------------------------------------------------------------- outputs
    def append(self, token_id: int) -> Finish | None:
        """Adds a sampled token; returns the stop it causes (EOS or a stop token id: STOP; a constraint now
        complete: STOP; the length limit: LENGTH) and finishes the sequence then, else None. A token the
        constraint refuses leaves constraint.error set (the policy fails the request)."""
        self.output_ids.append(token_id)
        stopping = self.request.stopping
        if len(self.output_ids) >= stopping.min_new_tokens and (
                token_id in self.eos_token_ids or token_id in stopping.stop_token_ids):
            self.status = Status.FINISHED
            return Finish(FinishReason.STOP, str(token_id))
        if self.constraint is not None and self.constraint.advance(self.output_ids):
            self.status = Status.FINISHED
            return Finish(FinishReason.STOP)
        if self.num_tokens >= self._max_len:
            self.status = Status.FINISHED
            return Finish(FinishReason.LENGTH)
        return None

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
