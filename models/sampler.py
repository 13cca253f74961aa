"""Batched next-token sampler: logits [B, V] on any device -> one token per row, plus raw logprobs.

Semantics, per row (a stage runs only when some row in the batch uses it, so an all-greedy batch with no
bias or penalty costs an argmax and a log_softmax):
0. the row's token mask (constrained decoding; tandem/token_mask.py's packed layout), before anything else:
   disallowed tokens' logits become -inf, so no later stage can bring them back. Unpacked on the logits'
   device with bitwise ops ([B, 4W] bytes -> [B, V] bits; on a CPU, where the host is the device, with
   numpy's unpackbits).
1. logit_bias is added to the raw float32 logits.
2. repetition_penalty, as transformers' RepetitionPenaltyLogitsProcessor, over every token in token_ids
   (prompt and output): a negative logit is multiplied by the penalty, any other divided by it.
3. presence/frequency penalties (OpenAI) over the output tokens only (the last num_output_tokens of
   token_ids): logit -= frequency_penalty * count + presence_penalty * (count > 0).
   `Sampler.process_logits` returns the logits at this point.
4. temperature 0 (greedy): the token is the argmax here; no filter or randomness applies. A temperature
   below tandem.sampling_params.GREEDY_TEMPERATURE (1e-5) is greedy too: dividing by a subnormal one
   overflows the logits to inf, and the race would pick the lowest id among them.
5. temperature > 0 divides the logits; then top-k, top-p and min-p each filter what the previous one left
   (set to -inf), as transformers' TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper with
   min_tokens_to_keep=1: top-k keeps every token >= the k-th largest logit (ties with it stay); top-p keeps
   a token iff the probability of the tokens ranked strictly above it is < top_p (TopP's "drop if the
   ascending cumulative probability <= 1 - top_p"), so the most likely token always stays; among tokens
   tied at the cut it keeps as many as TopP, the lowest ids (TopP keeps whichever its unstable sort puts
   last, which varies by device);
   min-p drops tokens whose probability is < min_p * the largest (never the largest itself).
   `Sampler.filtered_logits` returns the result.
6. The token is argmax(filtered - log E_i), E_i = -log(1 - u_i) ~ Exp(1): the exponential race (Gumbel-max
   trick), which picks i with probability softmax(filtered)_i; filtered tokens are -inf and never win.
Zero values mean "off" (top_p 0 or 1 and repetition_penalty 0 or 1 too), as SamplingParams documents.

Randomness: u_i comes from a counter-based hash, not a stateful generator, so a row's draw depends only on
(seed, step_key, vocab id i) and its logits: never on the other rows of the batch, nor on the device (the
hash is exact integer work; only float32 log's last-ulp rounding may differ, i.e. a near-exact tie). The
row key is lowbias32-chained on the host over both 32-bit halves of the seed and of step_key; on the device
h_i = mix32(mix32(i) ^ key) in int64 (every product < 2^63, so no overflow anywhere) and
u_i = (h_i + 0.5) / 2^32. Rows without a seed get a fresh 63-bit seed from the sampler's own source.

Row invariance (`Sampler(..., invariant=True)`, the executor's --deterministic): torch's CPU reductions and
elementwise kernels split a [B, V] tensor by its size and the thread count (a sum over a row may be split
across threads when B is small, a vector loop's scalar tail falls on whichever elements end the flattened
tensor), so a row's logprob could differ in its last bits with its batch. Invariant, each row is sampled
alone, [1, V], on one thread: the same ops on the same shape, whatever the batch or --threads.

Logprobs are log_softmax of the raw float32 logits (before the mask, bias, penalties and temperature), for the chosen
token and for the top-N alternatives (sorted by descending raw logprob). Logits wider than vocab_size (a
padded lm_head) are cut to vocab_size first, so padding columns are never sampled.
"""
from __future__ import annotations

import random
import secrets
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.sampling_params import SamplingParams
from tandem.token_mask import mask_bytes

_M32 = 0xFFFFFFFF
_C1, _C2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers; _C2 >= 2^31 is applied in two parts
_TOP_P_CANDIDATES = 256  # CPU only: top-p first looks at this many tokens (x4 until they cover top_p)


def _mul32(x, c: int):
    """x * c mod 2^32 for x in [0, 2^32), on ints or int64 tensors; c's top bit is applied as a shift
    ((x & 1) << 31 == x * 2^31 mod 2^32) so every product stays < 2^63."""
    y = x * (c & 0x7FFFFFFF)
    if c >> 31:
        y = y + ((x & 1) << 31)
    return y & _M32


def _mix32(x):
    """lowbias32 (C. Wellons' hash prospector): a bijective, well-avalanching 32-bit mix (ints or tensors)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """_mix32 in place on an int64 tensor: the same ops, without a fresh [B, V] buffer per op (on CPU each
    new buffer costs page faults that dominate the arithmetic)."""
    tmp = torch.empty_like(x)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))
    x.mul_(_C1).bitwise_and_(_M32)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 15, out=tmp))
    torch.bitwise_and(x, 1, out=tmp).bitwise_left_shift_(31)
    x.mul_(_C2 & 0x7FFFFFFF).add_(tmp).bitwise_and_(_M32)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))


def row_key(seed: int, step_key: int) -> int:
    """The 32-bit key of one row's draw: both halves of the 64-bit seed and of step_key, chained."""
    k = _mix32((seed & _M32) ^ 0x243F6A88)
    k = _mix32(k ^ ((seed >> 32) & _M32))
    k = _mix32(k ^ (step_key & _M32))
    return _mix32(k ^ ((step_key >> 32) & _M32))


@dataclass
class SamplingRow:
    params: SamplingParams
    token_ids: Sequence[int]  # every token the sequence holds (prompt + output), oldest first
    num_output_tokens: int  # how many trailing token_ids were generated (for presence/frequency)
    step_key: int  # position of the token being sampled (normally len(token_ids)); keys the RNG
    num_top_logprobs: int = 0  # how many top alternatives to report
    allowed_tokens: bytes | None = None  # packed mask of the tokens this row may pick (tandem/token_mask.py); None = any


@dataclass
class SampledToken:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, raw logprob), most likely first


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64, on the logits' device
    logprobs: torch.Tensor  # [B] float32, raw log_softmax at the chosen token
    top_token_ids: torch.Tensor  # [B, N] int64, N = max num_top_logprobs in the batch
    top_logprobs: torch.Tensor  # [B, N] float32
    num_top_logprobs: list[int] = field(default_factory=list)  # per row, to cut each row's top list

    def to_lists(self) -> list[SampledToken]:
        """Per-row python values from one device->host copy: everything packed as float64, which holds
        int64 token ids (< 2^53) and float32 logprobs exactly."""
        n = self.top_token_ids.shape[1]
        packed = torch.cat([self.token_ids[:, None].double(), self.logprobs[:, None].double(),
                            self.top_token_ids.double(), self.top_logprobs.double()], dim=1)  # [B, 2+2N]
        out = []
        for r, vals in enumerate(packed.tolist()):
            k = min(self.num_top_logprobs[r], n) if r < len(self.num_top_logprobs) else n
            out.append(SampledToken(int(vals[0]), vals[1], [(int(vals[2 + j]), vals[2 + n + j]) for j in range(k)]))
        return out

    @staticmethod
    def cat(parts: Sequence["SamplerOutput"]) -> "SamplerOutput":
        """One output of parts' rows in order (top lists padded with zeros to the widest; each row is cut to its
        own count)."""
        n = max(p.top_token_ids.shape[1] for p in parts)
        pad = [(p.top_token_ids, p.top_logprobs, n - p.top_token_ids.shape[1]) for p in parts]
        return SamplerOutput(torch.cat([p.token_ids for p in parts]), torch.cat([p.logprobs for p in parts]),
                             torch.cat([torch.nn.functional.pad(i, (0, k)) for i, _, k in pad]),
                             torch.cat([torch.nn.functional.pad(v, (0, k)) for _, v, k in pad]),
                             [c for p in parts for c in p.num_top_logprobs])


@contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads set to 1 for the block (the calling thread's setting, restored after)."""
    threads = torch.get_num_threads()
    if threads != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads != 1:
            torch.set_num_threads(threads)


class Sampler:
    def __init__(self, vocab_size: int, invariant: bool = False) -> None:
        """invariant: every row sampled alone on one thread (see the module docstring: bit-identical results
        whatever the batch and the thread count, at the cost of a loop over the rows)."""
        self.vocab_size = vocab_size
        self.invariant = invariant
        self._rng = random.Random(secrets.randbits(64))  # seeds for rows that bring none
        self._vocab_hash: dict[tuple[torch.device, int], torch.Tensor] = {}  # mix32(arange(V)) per device
        self._bit_values: dict[torch.device, torch.Tensor] = {}  # 1 << arange(8) as uint8 per device, for masks

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
        if not self.invariant:
            return self._sample(logits, rows)
        with one_thread():
            if len(rows) <= 1:
                return self._sample(logits, rows)
            return SamplerOutput.cat([self._sample(logits[r:r + 1], rows[r:r + 1]) for r in range(len(rows))])

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        raw = logits[:, : self.vocab_size].float()  # [B, V]; no copy when already float32: never mutated
        x = self._penalise(self._constrain(raw, rows), rows)  # [B, V]; `raw` itself with no mask, bias or penalty
        greedy = [row.params.is_greedy for row in rows]  # temperature 0, or below GREEDY_TEMPERATURE
        wanted = [max(0, row.num_top_logprobs) for row in rows]
        if all(greedy) and x is raw and not any(wanted):
            # The hot path (plain greedy, no alternatives): one max pass yields both the token and the
            # max for a stable logsumexp; the chosen logprob is max - logsumexp = -log(sum(exp(raw - max))).
            top, token_ids = raw.max(dim=-1)  # [B] each (first index on ties, like argmax)
            logprobs = -(raw - top[:, None]).exp_().sum(dim=-1).log()  # [B]
            empty = raw.new_empty((len(rows), 0))
            return SamplerOutput(token_ids, logprobs, token_ids.new_empty((len(rows), 0)), empty, wanted)
        if all(greedy):
            token_ids = x.argmax(dim=-1)  # [B]
        else:
            s = self._filter(x, rows)  # [B, V] scaled and filtered, a fresh tensor
            seeds = [row.params.seed if row.params.seed is not None else self._rng.getrandbits(63) for row in rows]
            keys = torch.tensor([row_key(sd, row.step_key) for sd, row in zip(seeds, rows)])  # [B] int64
            s.sub_(self._log_exponentials(keys.to(x.device, non_blocking=True), s.shape[1]))  # [B, V]
            token_ids = s.argmax(dim=-1)  # [B]: the winner of the exponential race
            if any(greedy):
                is_greedy = torch.tensor(greedy).to(x.device, non_blocking=True)  # [B] bool
                token_ids = torch.where(is_greedy, x.argmax(dim=-1), token_ids)  # [B]

        n = min(max(wanted, default=0), raw.shape[1])
        if n > 0:
            lp_all = torch.log_softmax(raw, dim=-1)  # [B, V] raw logprobs
            logprobs = lp_all.gather(1, token_ids[:, None]).squeeze(1)  # [B]
            top_logprobs, top_ids = lp_all.topk(n, dim=-1, sorted=True)  # [B, N] each, descending
        else:
            # Without alternatives, logit - logsumexp avoids writing a [B, V] log_softmax.
            logprobs = raw.gather(1, token_ids[:, None]).squeeze(1) - raw.logsumexp(dim=-1)  # [B]
            top_logprobs, top_ids = raw.new_empty((len(rows), 0)), token_ids.new_empty((len(rows), 0))
        return SamplerOutput(token_ids, logprobs, top_ids, top_logprobs, wanted)

    def process_logits(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The float32 logits after the mask, bias and penalties, just before temperature: [B, V]."""
        return self._penalise(self._constrain(logits[:, : self.vocab_size].float(), rows), rows)

    def _constrain(self, x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Step 0: disallowed tokens of each row's mask to -inf; out of place (x may be the caller's logits),
        x itself when no row carries a mask."""
        if all(row.allowed_tokens is None for row in rows):
            return x
        b, v = x.shape
        every = b"\xff" * mask_bytes(self.vocab_size)  # rows without a mask allow every token
        packed = b"".join(every if row.allowed_tokens is None else row.allowed_tokens for row in rows)
        # Little-endian words read byte by byte: bit j of byte k is token 8k + j, whatever the host's order.
        u8 = np.frombuffer(packed, dtype=np.uint8).reshape(b, -1)  # [B, 4W]
        if _on_host(x):  # numpy's unpackbits: ~40x faster than torch's elementwise bit ops on a CPU
            allowed = torch.from_numpy(np.unpackbits(u8, axis=1, bitorder="little").view(np.bool_))  # [B, 32W]
        else:  # unpacked on the device: only the packed bytes cross the bus
            bit = self._bit_values.get(x.device)
            if bit is None:
                bit = self._bit_values[x.device] = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8,
                                                                device=x.device)  # [8]
            dev_u8 = torch.from_numpy(u8.copy()).to(x.device, non_blocking=True)  # [B, 4W] (copy: writable)
            allowed = torch.bitwise_and(dev_u8[:, :, None], bit).view(b, -1) != 0  # [B, 32W]
        return torch.where(allowed[:, :v], x, x.new_full((), float("-inf")))  # [B, V]

    def filtered_logits(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """What the race runs on: after temperature, top-k, top-p and min-p, [B, V]. Greedy rows are reported
        at temperature 1 with no filter (their argmax is taken before this stage)."""
        return self._filter(self.process_logits(logits, rows), rows)

    def _penalise(self, x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Steps 1-3; out of place, since x may be the caller's logits."""
        b, v = x.shape
        dev = x.device
        bias = [(r, t, val) for r, row in enumerate(rows) for t, val in row.params.logit_bias.items() if 0 <= t < v]
        if bias:
            r_idx, t_idx, vals = zip(*bias)
            idx = torch.tensor([r_idx, t_idx]).to(dev, non_blocking=True)  # [2, n] int64
            vals_t = torch.tensor(vals, dtype=torch.float32).to(dev, non_blocking=True)  # [n]
            x = x.index_put((idx[0], idx[1]), vals_t, accumulate=True)  # [B, V]

        rep = [r for r, row in enumerate(rows) if row.params.repetition_penalty not in (0.0, 1.0)]
        if rep:
            seen = torch.zeros((b, v), dtype=torch.bool, device=dev)  # [B, V]
            seen[_flat_ids(rows, rep, output_only=False, vocab=v, device=dev)] = True
            pen = _column([row.params.repetition_penalty if r in rep else 1.0 for r, row in enumerate(rows)], dev)
            x = torch.where(seen, torch.where(x < 0, x * pen, x / pen), x)  # [B, V]; pen: [B, 1]

        pf = [r for r, row in enumerate(rows)
              if row.params.presence_penalty != 0.0 or row.params.frequency_penalty != 0.0]
        if pf:
            r_idx, t_idx = _flat_ids(rows, pf, output_only=True, vocab=v, device=dev)  # [n] each
            counts = torch.zeros((b, v), dtype=torch.float32, device=dev)  # [B, V]
            # Integer counts: exact whatever order the device accumulates in.
            counts.index_put_((r_idx, t_idx), torch.ones((), device=dev).expand(r_idx.shape[0]), accumulate=True)
            freq = _column([row.params.frequency_penalty for row in rows], dev)  # [B, 1]
            pres = _column([row.params.presence_penalty for row in rows], dev)  # [B, 1]
            x = x - (freq * counts + pres * (counts > 0))  # [B, V]; rows with both 0 are unchanged
        return x

    def _filter(self, x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Step 5 on every row with per-row parameters; returns a fresh [B, V] tensor in vocab order. Each
        filter becomes a per-row threshold, so no row needs its own code path."""
        dev, v, neg_inf = x.device, x.shape[1], float("-inf")
        ps = [SamplingParams(temperature=1.0) if row.params.is_greedy else row.params for row in rows]
        s = x / _column([p.temperature for p in ps], dev)  # [B, V]; greedy rows at 1 (their result is unused)
        if any(p.top_k > 0 for p in ps):
            k = [min(p.top_k, v) if p.top_k > 0 else 0 for p in ps]
            top_vals = s.topk(max(k), dim=-1).values  # [B, kmax] descending
            kth = top_vals.gather(1, torch.tensor([max(kk, 1) - 1 for kk in k])[:, None].to(dev, non_blocking=True))
            kth.masked_fill_(_column([kk == 0 for kk in k], dev, torch.bool), neg_inf)  # [B, 1]; off: keep all
            s.masked_fill_(s < kth, neg_inf)
        top_p = [p.top_p if 0.0 < p.top_p < 1.0 else 1.0 for p in ps]
        if any(p < 1.0 for p in top_p):
            thr, n_keep = self._top_p_cutoff(s, top_p)  # [B, 1] each
            keep = s >= thr  # [B, V]
            # More tokens tied at the cut than top-p keeps: keep the lowest ids of them. On CPU the check is
            # free and the fix rarely needed; on the device it always runs rather than sync on the check.
            if not _on_host(s) or bool((keep.sum(dim=-1, keepdim=True) > n_keep).any()):
                tied = s == thr  # [B, V]
                room = n_keep - (s > thr).sum(dim=-1, keepdim=True)  # [B, 1] >= 1
                keep &= (tied.cumsum(dim=-1) <= room) | tied.logical_not_()  # cumsum before the in-place not
            s.masked_fill_(keep.logical_not_(), neg_inf)
        if any(p.min_p > 0.0 for p in ps):
            probs = s.softmax(dim=-1)  # [B, V], as MinPLogitsWarper computes it
            # min_p <= 1, so the largest probability always passes (MinP's keep-at-least-one is a no-op).
            s.masked_fill_(probs < _column([p.min_p for p in ps], dev) * probs.amax(dim=-1, keepdim=True), neg_inf)
        return s

    @staticmethod
    def _top_p_cutoff(s: torch.Tensor, top_p: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the logit of the last token top-p keeps in descending order and how many it keeps, [B, 1]
        each (-inf and V where top_p is 1 = off). Needs the rows sorted: on the device one full sort. On CPU,
        where torch's sort is slow and a data-dependent check costs no device sync, the top candidates come
        from topk, widened until their mass covers top_p (every token outside is then dropped anyway)."""
        b, v = s.shape
        p = _column(top_p, s.device)  # [B, 1]
        lse = s.logsumexp(dim=-1, keepdim=True)  # [B, 1]
        c = min(v, _TOP_P_CANDIDATES) if _on_host(s) else v
        while True:
            cand = s.topk(c, dim=-1).values if c < v else s.sort(dim=-1, descending=True).values  # [B, C]
            cum = (cand - lse).exp_().cumsum_(dim=-1)  # [B, C] mass of each candidate and all above it
            if c == v or bool(((cum[:, -1:] >= p) | (p >= 1.0) | cand[:, -1:].isneginf()).all()):
                break
            c = min(v, 4 * c)
        above = torch.nn.functional.pad(cum[:, :-1], (1, 0))  # [B, C] mass strictly above each candidate
        n_keep = (above < p).sum(dim=-1, keepdim=True)  # [B, 1] >= 1: nothing is above the first
        off = p >= 1.0  # [B, 1]
        return cand.gather(1, n_keep - 1).masked_fill_(off, float("-inf")), n_keep.masked_fill_(off, v)

    def _log_exponentials(self, keys: torch.Tensor, v: int) -> torch.Tensor:
        """log E for E ~ Exp(1), per (row, vocab id), from the counter hash: keys [B] int64 -> [B, V]."""
        dev = keys.device
        vh = self._vocab_hash.get((dev, v))
        if vh is None:
            vh = self._vocab_hash[(dev, v)] = _mix32(torch.arange(v, dtype=torch.long, device=dev))  # [V]
        h = _mix32_(vh[None, :] ^ keys[:, None])  # [B, V] in [0, 2^32)
        # u in (0, 1): exact for small h, where the race is decided; the clamp only stops a rounding to 1.
        u = h.float().add_(0.5).mul_(2.0**-32).clamp_(max=1.0 - 2.0**-24)  # [B, V]
        return u.neg_().log1p_().neg_().log_()  # [B, V] log(-log(1 - u))


def _on_host(t: torch.Tensor) -> bool:
    """Whether reading a value of t back is free (no device sync), so a data-dependent shortcut pays."""
    return t.device.type == "cpu"


def _column(values: list, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-row parameters as a [B, 1] column on the device (one small copy)."""
    return torch.tensor(values, dtype=dtype)[:, None].to(device, non_blocking=True)


def _flat_ids(rows: Sequence[SamplingRow], which: list[int], *, output_only: bool, vocab: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs, [n] int64 each on the device, for rows `which`: all their token ids, or
    only the trailing num_output_tokens. Ids outside [0, vocab) are dropped, as transformers does."""
    parts, lens = [], []
    for r in which:
        ids = rows[r].token_ids
        if output_only:
            n = rows[r].num_output_tokens
            ids = ids[len(ids) - n:] if n > 0 else ()
        parts.append(torch.as_tensor(ids, dtype=torch.long).reshape(-1).cpu())  # [L]
        lens.append(parts[-1].numel())
    tok = torch.cat(parts)  # [n]
    row = torch.repeat_interleave(torch.tensor(which, dtype=torch.long), torch.tensor(lens))  # [n]
    ok = (tok >= 0) & (tok < vocab)
    return row[ok].to(device, non_blocking=True), tok[ok].to(device, non_blocking=True)
