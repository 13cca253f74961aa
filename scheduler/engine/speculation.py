"""Speculative decoding in the scheduler: its flags, and how many draft tokens each decoding sequence gets.

The executor verifies drafts inside the step's UnifiedDecode (UnifiedItem.draft_token_ids): the output is
exactly the one of one token per step, and a step returns the accepted drafts plus one sampled token. Drafts
pay when a decode step is bound by reading the weights (small batches): checking k more positions then costs
little more than one. They cost when the step is already compute bound (large batches), so:
- no drafts at all when the step has more decoding sequences than the measured break-even
  (scheduler/engine/step_cost.py: from the steps' times against their sizes and the drafts' acceptance rate;
  until the steps have been measured, 4; at most 32), or than --speculative-max-batch where one is given;
- per sequence and per draft source (its own n-grams, earlier requests' outputs, the draft model: each its own
  length, cooldown and acceptance rate, so that one source failing never silences another — a copying request
  whose first guess from an earlier answer fails keeps drafting from its prompt), the draft length adapts:
  after a fully accepted draft it grows by one (up to --num-speculative-tokens; a draft from an earlier
  request's output doubles, up to 4x that: a repeated answer tends to go on repeating), after a partly accepted
  one it is the accepted length + 1, and after drafts accepted not at all the source sits out 2, 4, ... 16 steps
  before it drafts again;
- once the step costs are measured, a draft is never longer than what gives the step the most tokens per second
  by them and the sequence's rate (Speculator.length): a copy drafts the full --num-speculative-tokens, a
  sequence whose drafts are cut after a token or two drafts one to three, so a miss costs few rows; a burst asks
  the executor for each sequence's own length;
- a candidate the step's cost rule refuses has its own rate forgotten a little (toward the global one): a
  request whose early drafts failed is tried again later, instead of never drafting again (its rate could only
  change through drafts it is no longer allowed);
- no drafts while a request is short of min_new_tokens (the EOS ban then changes from position to position),
  and never past its max_new_tokens or the model's length (Sequence.draft_room).

Where the executor runs a draft model (capability "draft_model", its --draft-model) and the method is auto or
draft_model, a sequence whose lookups propose nothing asks the executor for model drafts instead
(UnifiedItem.model_draft_tokens): with their own length, cooldown and acceptance rate, and the draft model's
measured time per guessed token (UnifiedDecodeResponse.draft_model_ms) added to their cost in the keep rule.
"""
from __future__ import annotations

import argparse
import weakref
from dataclasses import dataclass
from typing import Protocol

from scheduler.config import METHODS, SpeculativeConfig
from scheduler.engine.draft_proposer import DraftProposer, NgramProposer, NoProposer
from scheduler.engine.response_index import ResponseIndex
from scheduler.engine.step_cost import DraftModelCost, StepCost, worth
from scheduler.engine.suffix_proposer import NGRAM, SUFFIX, SuffixProposer
from scheduler.sequence import Sequence
from scheduler.engine.step_answer import ItemResult
from scheduler.output.step_outcome import StepOutcome, Verified
from tandem import capabilities as caps

_BURST_MAX_NGRAM = 16  # the contract's limit on NgramDrafts.ngram_max
_MAX_COOLDOWN_STEPS = 16
_UNMEASURED_MAX_BATCH = 4  # drafts up to this batch until the step costs are measured
_SUFFIX_MAX_TOKENS = 32  # (the executor's limit) a suffix draft fully accepted doubles, up to 4 x the setting
_SEQ_DECAY = 0.7  # per verification: a sequence's acceptance rate follows its last few drafts
_REFUSED_DECAY = 0.7  # per refusal by the cost rule: what the rate has seen fades (toward the global rate) as fast as
# it follows new drafts, so a refused sequence is offered again within ~10 refusals at most
_PRIOR_TOKENS = 2.0  # a sequence's rate starts at the global one, worth this many draft tokens
_MEASURED_MAX_BATCH = 32  # and never beyond this one (the fit is a line: far from the sizes seen, a guess)
# Drafts guessed by the executor's draft model (UnifiedItem.model_draft_tokens): the method is named as the
# executor's capability that serves it.
DRAFT_MODEL = caps.DRAFT_MODEL


def _accepted(p: float, tokens: int) -> float:
    """Tokens of a `tokens`-long draft accepted on average at a per-token acceptance rate p (< 1):
    p + ... + p^tokens."""
    return p * (1 - p ** tokens) / (1 - p)


def _max_batch(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of requests or 'auto', got {text!r}") from None


def add_arguments(ap: argparse.ArgumentParser) -> None:
    d = SpeculativeConfig()
    g = ap.add_argument_group("speculative decoding (drafts verified inside the batch; output unchanged)")
    g.add_argument("--speculative", choices=METHODS, default=d.method,
                   help="draft tokens for decoding requests: 'ngram' looks the last tokens up in the request's prompt "
                        "and output and proposes what followed (wins when the output copies the input: editing, "
                        "extraction, code changes, RAG); 'suffix' also looks them up in the outputs of earlier "
                        "requests of the same adapter and cache_salt (retries, re-plans, repeated answers); 'auto' "
                        "is 'suffix', and where the executor runs a draft model (its --draft-model) that model guesses "
                        "for requests the lookups find nothing for; 'draft_model': only the draft model. Drafts "
                        "stop at the batch size where the measured step costs say they no longer pay. The executor verifies them in the same step; greedy and seeded outputs are identical "
                        f"to 'off' (default {d.method})")
    g.add_argument("--num-speculative-tokens", type=int, default=d.num_tokens, metavar="N",
                   help=f"most draft tokens per request and step (1..32; default {d.num_tokens})")
    g.add_argument("--ngram-max", type=int, default=d.ngram_max, metavar="N",
                   help=f"longest n-gram matched first (default {d.ngram_max})")
    g.add_argument("--ngram-min", type=int, default=d.ngram_min, metavar="N",
                   help=f"shortest n-gram tried (default {d.ngram_min})")
    g.add_argument("--speculative-max-batch", type=_max_batch, default=d.max_batch, metavar="N|auto",
                   help="no drafts in a step with more decoding requests than this: verification then costs more "
                        "than it saves. 'auto' (the default): the batch size where the measured step times and "
                        "acceptance rate say drafts stop paying (4 until measured, at most 32, never under 1); "
                        "a number fixes it (0 = never draft)")
    g.add_argument("--suffix-cache-tokens", type=int, default=d.suffix_cache_tokens, metavar="N",
                   help="tokens of earlier requests' outputs kept for --speculative suffix/auto (least recently used "
                        f"dropped first; ~0.2 KB each; default {d.suffix_cache_tokens}; 0 = own tokens only)")


def from_args(args: argparse.Namespace) -> SpeculativeConfig:
    return SpeculativeConfig(args.speculative, args.num_speculative_tokens, args.ngram_min, args.ngram_max,
                             args.speculative_max_batch, args.suffix_cache_tokens)


def make_proposer(cfg: SpeculativeConfig) -> DraftProposer:
    if cfg.method == DRAFT_MODEL:
        return NoProposer()
    ngram = NgramProposer(cfg.ngram_min, cfg.ngram_max)
    if cfg.method in ("suffix", "auto"):
        return SuffixProposer(ngram, ResponseIndex(cfg.suffix_cache_tokens))
    return ngram


class _Item(Protocol):  # a planned step's item (planner.StepItem: the planner imports this module)
    count: int  # tokens it computes (1: a decode)
    drafts: tuple[int, ...]


@dataclass
class _DraftLength:
    tokens: int  # draft length for the next step
    misses: int = 0  # drafts in a row accepted not at all
    cooldown: int = 0  # steps to sit out before drafting again
    drafted: float = 0.0  # recent draft tokens verified (exponentially weighted) ...
    accepted: float = 0.0  # ... and accepted: the sequence's own acceptance rate

    def verified(self, drafted: int, accepted: int) -> None:
        self.drafted = self.drafted * _SEQ_DECAY + drafted
        self.accepted = self.accepted * _SEQ_DECAY + accepted

    def refused(self) -> None:
        self.drafted *= _REFUSED_DECAY
        self.accepted *= _REFUSED_DECAY

    def ready(self) -> bool:
        """Whether this source may draft this step (a step of a cooldown passes)."""
        if self.cooldown:
            self.cooldown -= 1
            return False
        return True


class Speculator:
    def __init__(self, cfg: SpeculativeConfig, proposer: DraftProposer | None = None) -> None:
        self.cfg = cfg
        self.proposer = proposer or make_proposer(cfg)
        # Per sequence and draft source (NGRAM, SUFFIX, DRAFT_MODEL): its length, cooldown and acceptance rate.
        # (weak: a sequence that ends without forget() leaves nothing behind)
        self._lengths: weakref.WeakKeyDictionary[Sequence, dict[str, _DraftLength]] = weakref.WeakKeyDictionary()
        self.cost = StepCost()  # the step times, and the own n-grams' global acceptance rate
        self.suffix_rate = StepCost()  # (its acceptance rate only: earlier outputs' drafts, apart from n-grams')
        # The executor runs a draft model (capability "draft_model"; set by the engine from GetInfo): sequences
        # with nothing to copy ask it for drafts, with their own length and acceptance rate for those.
        self.draft_model = False
        self.model_cost = DraftModelCost()

    def _state(self, seq: Sequence, method: str) -> _DraftLength:
        states = self._lengths.get(seq)
        if states is None:
            states = self._lengths[seq] = {}
        state = states.get(method)
        if state is None:
            state = states[method] = _DraftLength(self.cfg.num_tokens)
        return state

    def _global_rate(self, method: str) -> StepCost:
        return {DRAFT_MODEL: self.model_cost.rate, SUFFIX: self.suffix_rate}.get(method, self.cost)

    def max_batch(self) -> float:
        """Decoding sequences up to which a step drafts now. Never under 1 (unless --speculative-max-batch 0):
        a lone sequence may always draft — its own cooldown bounds what failing drafts cost it — so that the
        acceptance rate keeps being measured (a break-even of 0 would otherwise stop drafts for good). A fixed
        --speculative-max-batch overrides the measurement."""
        if self.cfg.max_batch is not None:
            return self.cfg.max_batch
        return _UNMEASURED_MAX_BATCH if self.cost.fit() is None else _MEASURED_MAX_BATCH

    def expected(self, seq: Sequence, tokens: int, model: bool = False, method: str | None = None) -> float:
        """Draft tokens of a `tokens`-long draft of seq's expected to be accepted: with p its acceptance rate
        (its own recent drafts from that source — own n-grams, earlier outputs or the draft model —, starting
        from that source's global rate), p + p^2 + ... + p^tokens (a draft is accepted up to its first miss)."""
        return _accepted(self._rate(seq, method or (DRAFT_MODEL if model else self.method(seq))), tokens)

    def _rate(self, seq: Sequence, method: str) -> float:
        state = self._lengths.get(seq, {}).get(method)
        prior = self._global_rate(method).acceptance
        prior = 0.5 if prior is None else prior
        drafted, accepted = (0.0, 0.0) if state is None else (state.drafted, state.accepted)
        return min(0.999, (accepted + prior * _PRIOR_TOKENS) / (drafted + _PRIOR_TOKENS))

    def length(self, seq: Sequence, method: str, batch: int) -> int:
        """The longest draft worth making for seq from this source (own n-grams, the draft model) in a step of
        `batch` decoding sequences: the d in 1..--num-speculative-tokens that gives the step the most tokens per
        second, (batch + e(d)) / (a + b (batch + d) + d x the draft model's time per guess), by the measured step
        costs and seq's acceptance rate — a copy accepted near 100% drafts long, plain text whose drafts are cut
        after a token or two drafts short, so a miss costs few rows. --num-speculative-tokens while unmeasured."""
        n, fit = self.cfg.num_tokens, self.cost.fit()
        if fit is None:
            return n
        a, b = fit
        making = (self.model_cost.per_token or 0.0) if method == DRAFT_MODEL else 0.0
        p = self._rate(seq, method)
        return max(range(1, n + 1), key=lambda d: (batch + _accepted(p, d)) / (a + b * (batch + d) + making * d))

    def keep(self, batch: int, drafts: list[tuple[Sequence, int, bool]]) -> set[int]:
        """Which of these (sequence, draft tokens, by the draft model) candidates of a step of `batch` decoding
        sequences draft: those whose drafts lower the step's time per token, by the measured step costs, the
        draft model's measured time per draft token (for its drafts) and each one's acceptance rate
        (step_cost.worth); all of them while the costs are unmeasured or --speculative-max-batch is fixed (the
        count rule alone)."""
        return self._keep(batch, [(seq, n, DRAFT_MODEL if model else self.method(seq)) for seq, n, model in drafts])

    def _keep(self, batch: int, drafts: list[tuple[Sequence, int, str]]) -> set[int]:
        """keep() with each candidate's draft source named."""
        fit = self.cost.fit()
        if fit is None or self.cfg.max_batch is not None:
            return set(range(len(drafts)))
        # A request that has not drafted from this source yet drafts once whatever the estimate (its first
        # verification measures it; otherwise a low global rate would keep every new request from ever drafting,
        # a repeat included).
        new = {i for i, (seq, _, method) in enumerate(drafts) if self._unmeasured(seq, method)}
        rest = [i for i in range(len(drafts)) if i not in new]
        per_token = self.model_cost.per_token or 0.0
        chosen = {rest[j] for j in worth(fit, batch, [
            (n, self.expected(seq, n, method=method), n * per_token if method == DRAFT_MODEL else 0.0)
            for seq, n, method in (drafts[i] for i in rest)])}
        for i in rest:
            if i not in chosen:  # its rate fades toward the global one: tried again later
                seq, _, method = drafts[i]
                self._state(seq, method).refused()
        return new | chosen

    def _unmeasured(self, seq: Sequence, method: str) -> bool:
        state = self._lengths.get(seq, {}).get(method)
        return state is None or state.drafted == 0

    def step_allows_drafts(self, decoding: int) -> bool:
        return 0 < decoding <= self.max_batch()

    def method(self, seq: Sequence) -> str:
        """Where seq's latest drafts came from."""
        return self.proposer.method(seq) if isinstance(self.proposer, SuffixProposer) else NGRAM

    def needs_own_step(self, seq: Sequence) -> bool:
        """Whether seq's drafts this step are ones the executor cannot make within a burst (earlier requests'
        outputs): the step then stays single, so that they are verified."""
        return self.method(seq) == SUFFIX

    def observe_step(self, items: list[_Item], steps: int, seconds: float, out: StepOutcome,
                     draft_model_s: float = 0.0) -> None:
        """A call of `steps` steps of these items took `seconds`, draft_model_s of them in the executor's draft
        model: the draft model's time per token it guessed; and if decode-only, the step's size per step
        (tokens, drafts included) against its time without the draft model's, for the break-even."""
        guessed = sum(v.drafted for v in out.verified if v.method == DRAFT_MODEL)
        if guessed:
            self.model_cost.observe(guessed, draft_model_s)
        seconds -= draft_model_s
        if not items or any(item.count != 1 for item in items):
            return
        tokens = sum(1 + len(item.drafts) for item in items) + guessed
        if steps > 1:  # (the executor's drafts within the burst: their tokens per step on average)
            tokens = len(items) + sum(v.drafted for v in out.verified) / steps
        self.cost.step(tokens, seconds / steps)

    def drafts(self, seq: Sequence, limit: int, batch: int = 1) -> tuple[int, ...]:
        """Draft tokens for a decoding sequence this step of `batch` decoding sequences (at most limit: the step's
        token and block room), from its own n-grams (at most length()) or (suffix, auto) earlier requests'
        outputs, each source by its own length and cooldown. None for a constrained sequence (its token mask
        covers one position only)."""
        if not seq.allows_drafts:
            return ()
        room = min(limit, seq.draft_room())
        own = self._state(seq, NGRAM)
        n_own = min(own.tokens, room, self.length(seq, NGRAM, batch)) if own.ready() else 0
        if isinstance(self.proposer, SuffixProposer):
            other = self._state(seq, SUFFIX)
            n_other = min(other.tokens, room) if other.ready() else 0
            if n_own <= 0 and n_other <= 0:
                return ()
            return tuple(self.proposer.propose(seq, max(0, n_own), max(0, n_other)))
        return tuple(self.proposer.propose(seq, n_own)) if n_own > 0 else ()

    def model_drafts(self, seq: Sequence, limit: int, batch: int = 1) -> int:
        """How many draft tokens the executor's draft model is to guess for seq this step (0: none; asked when
        its lookup proposed nothing): the draft model's own length for it, adapted as drafts() adapts, with its
        own cooldown after guesses accepted not at all."""
        if not self.draft_model or self.cfg.method not in ("auto", DRAFT_MODEL) or not seq.allows_drafts:
            return 0
        state = self._state(seq, DRAFT_MODEL)
        if not state.ready():
            return 0
        return max(0, min(state.tokens, limit, seq.draft_room(), self.length(seq, DRAFT_MODEL, batch)))

    def burst_drafting(self, seqs: list[Sequence]) -> dict[Sequence, tuple[int, int, int]]:
        """The sequences of a multi-step burst the executor drafts for within it (DecodeItem.ngram_drafts),
        with (max draft tokens, n-gram min, n-gram max): the same rules as single steps (--speculative-max-batch,
        no constrained sequence, room for a draft; by each one's own n-gram rate, each at its length()) and the
        same n-gram settings; the executor adapts the length step by step itself, up to that maximum."""
        cfg = self.cfg
        ngram_max = min(cfg.ngram_max, _BURST_MAX_NGRAM)
        if not self.step_allows_drafts(len(seqs)) or cfg.ngram_min > ngram_max or cfg.method == DRAFT_MODEL:
            return {}
        may = [(s, self.length(s, NGRAM, len(seqs))) for s in seqs if s.allows_drafts and s.draft_room() > 0]
        chosen = self._keep(len(seqs), [(s, n, NGRAM) for s, n in may])
        return {s: (n, cfg.ngram_min, ngram_max) for i, (s, n) in enumerate(may) if i in chosen}

    def settle(self, out: StepOutcome, seq: Sequence, drafts: tuple[int, ...], res: ItemResult) -> None:
        """Counts what a step verified for seq (the step's metrics, the request's usage): the draft it carried
        (res.tokens = the accepted drafts and the token after them), or those the executor made within a
        burst (res.burst_drafts)."""
        if drafts or res.model_drafted:  # (one or the other: the executor's draft model guessed the second)
            drafted, accepted = len(drafts) or res.model_drafted, max(0, len(res.tokens) - 1)
            method = self.method(seq) if drafts else DRAFT_MODEL
            out.drafts += 1
            out.drafted, out.accepted = out.drafted + drafted, out.accepted + accepted
            out.verified.append(Verified(method, drafted, accepted))
            self.observe(seq, drafted, accepted, model=not drafts)
        steps, drafted, accepted = res.burst_drafts
        if steps:  # (the executor adapted these drafts' length: nothing to learn here but the rate)
            out.drafts += steps
            out.drafted, out.accepted = out.drafted + drafted, out.accepted + accepted
            out.verified.append(Verified("ngram_burst", drafted, accepted, steps))
            seq.drafted_tokens += drafted
            seq.accepted_tokens += accepted
            self.cost.verified(drafted, accepted)
            self._state(seq, NGRAM).verified(drafted, accepted)

    def observe(self, seq: Sequence, drafted: int, accepted: int, model: bool = False) -> None:
        """The executor accepted `accepted` of the `drafted` tokens sent for seq (model: guessed by its draft
        model; else from the source of seq's latest proposal). Each source keeps its own global rate: a draft
        model's, earlier outputs' and own n-grams' rates have their own scales."""
        seq.drafted_tokens += drafted
        seq.accepted_tokens += accepted
        method = DRAFT_MODEL if model else self.method(seq)
        self._global_rate(method).verified(drafted, accepted)
        state = self._lengths.get(seq, {}).get(method)
        if state is None:
            return
        state.verified(drafted, accepted)
        if accepted == drafted:
            if method == SUFFIX:  # an earlier output followed exactly: likely goes on, double
                state.tokens, state.misses = min(_SUFFIX_MAX_TOKENS, 4 * self.cfg.num_tokens, 2 * state.tokens), 0
            else:
                state.tokens, state.misses = min(self.cfg.num_tokens, state.tokens + 1), 0
        elif accepted:
            state.tokens, state.misses = accepted + 1, 0
        else:
            state.tokens, state.misses = 1, state.misses + 1
            state.cooldown = min(2 ** state.misses, _MAX_COOLDOWN_STEPS)

    def forget(self, seq: Sequence) -> None:
        self._lengths.pop(seq, None)
        self.proposer.forget(seq)
