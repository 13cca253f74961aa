"""One packed forward for a validated batch: reserve KV, run the model, record the tokens, sample, keep the
accepted draft tokens (speculative decoding). A failure at any point after the reservation (model, sampler,
device out of memory) puts every cache back as it was.

Draft tokens (UnifiedItem.draft_token_ids) run in the same forward as the item's own tokens: the item gets a
logit row at its last token and at each draft, each sampled exactly as if the tokens before it had come one
step at a time (its own history for the penalties, its own position for the RNG key). Draft i is accepted
while it equals the token sampled at its position (models/speculative.py says why that is the exact
speculative-sampling rule); the cache keeps the accepted drafts and is rolled back past them here.

Prompt logprobs (UnifiedItem.prompt_logprobs): the forward keeps the final hidden state of every position of
such an item, and executor_service/prompt_logprobs.py scores them in slices; the cache keeps its last
position's state for the next item."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from executor_service.kv.cache_table import CacheSnapshot, CacheState
from models.decode.step import DecodeStep
from executor_service.prompt_logprobs import LogprobRows, extend_trail, score
from executor_service.step.pooling import kept_rows, pool
from executor_service.types import SequenceOutput, TokenOutput, UnifiedItem
from executor_service.vision.embedding_cache import ImageEmbeddings
from executor_service.vision.merge_rows import merge_rows
from executor_service.vision.mrope import batch_positions, item_positions, record_grids
from models.attention.paged import AttentionMetadata, ItemLayout
from models.kv.paged_cache import PagedKvCache
from models.lora.weights import LoraWeights
from models.lora.batch import LoraBatch, LoraStacks
from models.sampler import Sampler, SamplingRow
from models.speculative import accepted_lengths
from models.transformer import DecoderModel
from tandem.errors import DeviceOutOfMemory
from tandem.sampling_params import SamplingParams


@dataclass(frozen=True)
class PlannedItem:
    """One item of a call, checked against the cache table (executor_service/request_validation.py) and then run
    in the batch: the one type an item has between the codec and the model."""

    item: UnifiedItem
    state: CacheState | None  # None until the call runs: a new cache (the batch run always has one)
    sampling: SamplingParams  # the item's own, else those registered with its cache (greedy for a new cache)


class BatchRunner:
    def __init__(self, model: DecoderModel, kv: PagedKvCache, max_attention_elements: int | None = None,
                 decode_step: DecodeStep | None = None,
                 attention: Callable[[Sequence[ItemLayout]], AttentionMetadata] | None = None) -> None:
        self.model = model
        # All-decode batches without LoRA (or drafts, unless it takes them) run it (executor_service/
        # executor_service/step/decode_choice.py); None: eager.
        self.decode_step = decode_step
        self.kv = kv
        self.device = model.lm_head.weight.device
        self.group = model.config.num_heads // model.config.num_kv_heads
        self.sampler = Sampler(model.config.vocab_size)
        self.lora_stacks = LoraStacks()  # the executor clears it whenever adapters load, unload or move
        self.max_attention_elements = max_attention_elements  # see models/attention/paged.py (None: no split)
        # Builds a batch's attention metadata (models/attention/backend.py); None: the gathered path.
        self.attention = attention
        # A vision-language model's image embeddings (executor_service/vision/; the executor sets it): items
        # with images merge their rows into the prompt's embeddings. None: a text-only model.
        self.images: ImageEmbeddings | None = None

    def run(self, batch: list[PlannedItem], all_positions: bool = False,
            adapters: Callable[[], dict[str, LoraWeights]] | None = None
            ) -> tuple[list[list[SequenceOutput] | None], list[list[TokenOutput]], list[torch.Tensor | None]]:
        """Per item: None for a non-final chunk or a pooled item, else one SequenceOutput per position asked for
        (the last position, or every position of the item when all_positions); per item its prompt logprobs
        (empty when it asked for none); and per item its pooled values (a pooled item's final chunk, else
        None: executor_service/step/pooling.py). adapters: called once the KV is
        reserved (a refused batch moves no adapter), returns the device weights of the items' adapters.
        Raises KvCapacityExceeded before touching anything, DeviceOutOfMemory for a device OOM; on that or
        any other error every cache is as it was (blocks, length, tokens, prompt end)."""
        snapshots = [b.state.snapshot() for b in batch]
        self.kv.reserve([(b.state.table, b.state.table.length + len(b.item.token_ids) + len(b.item.draft_token_ids))
                         for b in batch])
        try:
            logits, rows_per_item, hiddens = self._forward(batch, all_positions, adapters() if adapters else {})
            scored = [self._score(b, h) for b, h in zip(batch, hiddens)]
            self._commit(batch)  # before sampling: penalties and the RNG key read the new tokens
            for b in batch:  # (M-RoPE: the images' grids shift the positions after them)
                record_grids(b.state, b.item.images)
            self._keep_hidden(batch, hiddens, scored)
            pooled = [pool(self.model, b.item, b.state, h) for b, h in zip(batch, hiddens)]
            return (self._outputs(batch, logits, rows_per_item),
                    [rows.outputs(rows.top) if rows is not None else [] for rows in scored], pooled)
        except torch.cuda.OutOfMemoryError as exc:  # = torch.OutOfMemoryError (torch >= 2.5), on any device
            self._restore(snapshots)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # hand the failed call's cached blocks back before the next call
            tokens = sum(len(b.item.token_ids) for b in batch)
            raise DeviceOutOfMemory(
                f"the device ran out of memory running a call of {len(batch)} items and {tokens} tokens; nothing "
                "was written: send fewer items or tokens per call (or start the executor with a lower "
                "--max-batch-tokens or --max-attention-elements)") from exc
        except BaseException:
            self._restore(snapshots)
            raise

    def _restore(self, snapshots: list[CacheSnapshot]) -> None:
        for snap in snapshots:  # gives back what reserve took; each cache is as it was
            snap.restore(self.kv)

    @staticmethod
    def _commit(batch: list[PlannedItem]) -> None:
        """Records every written token, drafts included (rejected ones are rolled back after sampling)."""
        for b in batch:
            b.state.table.length += len(b.item.token_ids)
            b.state.tokens.extend(b.item.token_ids)
            if b.item.is_final_chunk and b.state.prompt_len is None:
                given = b.item.prompt_len
                b.state.prompt_len = b.state.table.length if given is None else given
            b.state.table.length += len(b.item.draft_token_ids)
            b.state.tokens.extend(b.item.draft_token_ids)
            known = {s[0] for s in b.state.images}
            b.state.images.extend((im.offset, im.length, im.content_hash) for im in b.item.images
                                  if im.offset not in known)

    @torch.inference_mode()
    def _score(self, b: PlannedItem, hidden: torch.Tensor | None) -> LogprobRows | None:
        """The item's prompt logprobs (None when it asked for none): its tokens after the sequence's first,
        each scored from the hidden state of the position before it (hidden: [n, hidden_size], its rows)."""
        if hidden is None or b.item.prompt_logprobs is None:  # (a pooled item's rows are not scored)
            return None
        pos, tokens = b.item.pos_offset, b.item.token_ids
        rows = hidden[:-1] if not pos else torch.cat([b.state.plp_hidden[None].to(hidden.dtype), hidden[:-1]])
        targets = torch.tensor(tokens[1:] if not pos else tokens, dtype=torch.int64, device=self.device)
        return score(self.model.project, rows, targets, b.item.prompt_logprobs, self.sampler.vocab_size)

    def _keep_hidden(self, batch: list[PlannedItem], hiddens: list[torch.Tensor | None],
                     scored: list[LogprobRows | None]) -> None:
        """After the commit: an item that asked for prompt logprobs leaves its cache its last position's hidden
        state and extends the cache's trail; any other item drops them (they would be of older positions)."""
        for b, hidden, rows in zip(batch, hiddens, scored):
            if hidden is None or rows is None:
                b.state.plp_hidden = b.state.plp_trail = None
                continue
            b.state.plp_hidden = hidden[-1].clone()  # (a copy: the [n, hidden] rows are freed after the call)
            b.state.plp_trail = extend_trail(b.state.plp_trail, max(b.item.pos_offset, 1), rows, hidden,
                                             b.item.pos_offset, self.kv.block_size)

    @torch.inference_mode()
    def _forward(self, batch: list[PlannedItem], all_positions: bool,
                 adapters: dict[str, LoraWeights]) -> tuple[torch.Tensor, list[int], list[torch.Tensor | None]]:
        """Logits of the rows to sample, rows per item, and per item asking for prompt logprobs the final
        hidden states of its positions ([n, hidden_size]; None for the others)."""
        scoring = any(b.item.prompt_logprobs is not None or b.item.pooling is not None for b in batch)
        step = self.decode_step
        if step is not None and not scoring and all(
                len(b.item.token_ids) == 1 and (step.takes_drafts or not b.item.draft_token_ids)
                and b.item.is_final_chunk and not b.item.adapter and not b.item.images for b in batch):
            # One row per token: an item's drafts are rows of its sequence after its token (every row sampled).
            ids, tables, pasts, rows_per_item = [], [], [], []
            for b in batch:
                for k, token in enumerate((b.item.token_ids[0], *b.item.draft_token_ids)):
                    ids.append(token)
                    tables.append(b.state.table.blocks)
                    pasts.append(b.state.table.length + k)
                rows_per_item.append(1 + len(b.item.draft_token_ids))
            return step.run(ids, tables, pasts), rows_per_item, [None] * len(batch)  # logits: [rows, vocab]
        layouts, ids, logit_rows, rows_per_item = [], [], [], []
        hidden_rows: list[int] = []  # (scoring) every packed row whose hidden state is kept
        spans: list[tuple[int, int] | None] = []  # (scoring) per item, its rows among hidden_rows
        adapter_spans: dict[str, list[tuple[int, int]]] = {}  # adapter -> its items' token ranges in the batch
        imaged = []  # (packed start row, cache tokens, chunk tokens, images) of the items with images
        mrope = self.model.config.mrope_section  # M-RoPE: every token's three positions (vision/mrope.py)
        vision = self.model.config.vision
        positions3 = []
        both_ways = vision is not None and vision.bidirectional_images  # (Gemma 3: each image's span, one block)
        start = 0
        for b in batch:
            if mrope:
                chunk = (*b.item.token_ids, *b.item.draft_token_ids)
                positions3.append(item_positions(b.state, b.state.table.length, len(chunk), chunk, b.item.images,
                                                 vision.image_token_id))
            if b.item.images:
                imaged.append((start, b.state.tokens, b.item.token_ids, b.item.images))
            drafts = len(b.item.draft_token_ids)  # (validated: final chunks only)
            n = len(b.item.token_ids) + drafts
            if b.item.adapter:
                adapter_spans.setdefault(b.item.adapter, []).append((start, start + n))
            layouts.append(ItemLayout(b.state.table.blocks, b.state.table.length, n, tuple(
                (im.offset, im.offset + im.length) for im in b.item.images) if both_ways else ()))
            ids.extend(b.item.token_ids)
            ids.extend(b.item.draft_token_ids)
            # (validated: no drafts) prompt logprobs: every position, the last sampled; pooled: kept_rows
            keep = (0, n) if b.item.prompt_logprobs is not None else kept_rows(b.item, n)
            if keep is not None:
                spans.append((len(hidden_rows), len(hidden_rows) + keep[1] - keep[0]))
                hidden_rows.extend(range(start + keep[0], start + keep[1]))
            else:
                spans.append(None)
            if not b.item.is_final_chunk or b.item.pooling is not None:  # (a pooled item samples nothing)
                rows_per_item.append(0)
            elif all_positions:
                logit_rows.extend(range(start, start + n))
                rows_per_item.append(n)
            else:  # the last token, and each draft: drafts + 1 rows
                logit_rows.extend(range(start + n - 1 - drafts, start + n))
                rows_per_item.append(1 + drafts)
            start += n
        meta = self.attention(layouts) if self.attention is not None else AttentionMetadata(
            layouts, self.kv.block_size, self.group, self.device, self.kv.k.dtype, self.max_attention_elements)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        lora = LoraBatch.build(adapter_spans, adapters, len(ids), self.device, self.lora_stacks)
        mm = (merge_rows(imaged, self.images, self.model.config.vision.image_token_id, self.device)
              if imaged and self.images is not None else None)
        # (passed only when there are images: a tensor-parallel leader, which never has a vision tower, takes none)
        mm_kw = {"mm": mm} if mm is not None else {}
        if mrope:
            mm_kw["mrope"] = batch_positions(positions3, self.device)  # [3, T]
        if not scoring:
            rows = torch.tensor(logit_rows, dtype=torch.int64, device=self.device)
            return self.model(input_ids, meta, self.kv, rows, lora, **mm_kw), rows_per_item, spans  # [R, vocab]
        # The rows to sample are among the kept ones or added after them: one forward gives both.
        kept = set(hidden_rows)
        hidden_rows.extend(r for r in logit_rows if r not in kept)
        where = {r: i for i, r in enumerate(hidden_rows)}
        h = self.model.hidden(input_ids, meta, self.kv, torch.tensor(hidden_rows, dtype=torch.int64,
                                                                     device=self.device), lora, **mm_kw)  # [H, hidden]
        pick = torch.tensor([where[r] for r in logit_rows], dtype=torch.int64, device=self.device)
        return (self.model.project(h[pick]), rows_per_item,  # logits: [R, vocab]
                [None if s is None else h[s[0]:s[1]] for s in spans])

    @torch.inference_mode()
    def _outputs(self, batch: list[PlannedItem], logits: torch.Tensor,
                 rows_per_item: list[int]) -> list[list[SequenceOutput] | None]:
        sample_rows: list[int] = []
        sampling: list[SamplingRow] = []
        first_row: list[int] = []  # per item, its first row among the sampled ones
        row = 0
        for b, count in zip(batch, rows_per_item):
            first_row.append(len(sampling))
            if count and b.item.output.wants_tokens:
                state = b.state
                for k in range(count):
                    # Position of the token being predicted: after the k-th of this item's new tokens. With
                    # several rows, each sees only the tokens before it (penalties), as one step at a time would.
                    step = state.table.length - count + k + 1
                    cut = k < count - 1 and b.sampling.uses_penalties
                    history = state.tokens[:step] if cut else state.tokens
                    outputs = max(0, state.num_output_tokens - (len(state.tokens) - len(history)))
                    sampling.append(SamplingRow(b.sampling, history, outputs, step, b.item.output.top_logprobs,
                                                # the mask is for the token after the item's last one (an item
                                                # with drafts carries none: validated)
                                                b.item.allowed_tokens if k == count - 1 else None))
                    sample_rows.append(row + k)
            row += count
        sampled, accepted = None, [0] * len(batch)
        if sampling:
            # Skip the [R, vocab] gather in the common case where every row is sampled.
            picked = logits if len(sample_rows) == logits.shape[0] else logits[sample_rows]
            out = self.sampler.sample(picked, sampling)
            drafting = [(i, first_row[i], b.item.draft_token_ids) for i, b in enumerate(batch) if b.item.draft_token_ids]
            if drafting:
                for (i, _, drafts), a in zip(drafting, accepted_lengths(out.token_ids, drafting)):
                    accepted[i] = a
                    self._keep_accepted(batch[i], len(drafts), a)
                rows_per_item = [a + 1 if b.item.draft_token_ids else c
                                 for b, c, a in zip(batch, rows_per_item, accepted)]
            sampled = out.to_lists()
        want_logits = any(c and b.item.output.wants_logits for b, c in zip(batch, rows_per_item))
        cpu_logits = logits.cpu() if want_logits else None
        results: list[list[SequenceOutput] | None] = []
        row = s = 0
        for b, count in zip(batch, rows_per_item):
            if not count:
                results.append(None)
                continue
            if b.item.draft_token_ids:  # one output: the accepted drafts and the token after them
                got = sampled[s: s + count]
                results.append([SequenceOutput([TokenOutput(g.token_id, g.logprob, g.top) for g in got])])
                s += len(b.item.draft_token_ids) + 1
                row += len(b.item.draft_token_ids) + 1
                continue
            outs = []
            for k in range(count):
                out = SequenceOutput()
                if b.item.output.wants_tokens:
                    got = sampled[s]
                    out.tokens.append(TokenOutput(got.token_id, got.logprob, got.top))
                    s += 1
                if b.item.output.wants_logits:
                    out.logits = cpu_logits[row + k: row + k + 1]
                outs.append(out)
            results.append(outs)
            row += count
        return results

    def _keep_accepted(self, b: PlannedItem, drafts: int, accepted: int) -> None:
        """Rolls the cache back past the rejected drafts: blocks, length and tokens (whole blocks go back
        to the pool; the rejected tail of the last kept block is overwritten by the next write)."""
        keep = b.state.table.length - (drafts - accepted)
        self.kv.truncate(b.state.table, keep)
        b.state.truncate(keep)
