"""Every check a batch of items must pass before the executor touches any state: request rules (tokens,
vocabulary, sampling, output options, length, per-call limits) and the cache table (ids, positions,
adapters). It mutates nothing; a batch that passes may still meet a full KV pool (checked when reserving).

Checks of the call as a whole (no items, too many tokens) raise. Every other check is the item's own: an item
that fails one gets its domain error (its message naming the item, and the field at fault as the request's path:
`items[3].draft_token_ids`) and the others go on without it, as the contract's per-item statuses promise."""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from executor_service.adapters import AdapterRegistry
from executor_service.step.batch import PlannedItem
from executor_service.kv.cache_table import CacheState, CacheTable
from executor_service.step.ngram_drafts import MAX_DRAFT_TOKENS  # noqa: F401  (re-exported)
from executor_service.step.pooling import PoolingRules
from executor_service.types import CreateCacheItem, UnifiedItem
from executor_service.vision.image_checks import check_images
from models.config import ModelConfig
from tandem.errors import CacheStateConflict, InvalidRequest, PositionMismatch, SequenceTooLong, TandemError
from tandem.image_hash import image_hash
from tandem.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from tandem.token_mask import allows_any, mask_bytes

MAX_CREATE_ITEMS = 256  # caches one CreateCache may create
MAX_CACHE_SALT_CHARS = 256
MAX_RELEASE_WITH_STEP = 4096  # cache ids one step call (UnifiedDecode, Decode) may release before its items


def check_release_with_step(cache_ids: Sequence[str]) -> None:
    """The release ids of a step call: at most MAX_RELEASE_WITH_STEP (checked before any is released)."""
    if len(cache_ids) > MAX_RELEASE_WITH_STEP:
        raise InvalidRequest(f"{{field}} names {len(cache_ids)} caches; a step call releases at most "
                             f"{MAX_RELEASE_WITH_STEP}: release the rest with ReleaseCache (any number of ids) "
                             "or in the next step calls", "release_cache_ids")


class RequestValidator:
    def __init__(self, model_config: ModelConfig, max_batch_tokens: int, adapters: AdapterRegistry,
                 pooling: PoolingRules | None = None, draft_model: bool = False) -> None:
        """pooling: the rules of pooled items (None: none is served, and every model has an LM head);
        draft_model: the executor runs one (UnifiedItem.model_draft_tokens is served)."""
        self.draft_model = draft_model
        self.vocab_size = model_config.vocab_size
        self.pooling = pooling
        self.max_len = model_config.max_position_embeddings
        self.max_batch_tokens = max_batch_tokens
        self.adapters = adapters
        self.vision = model_config.vision  # None: items with images fail (executor_service/vision/image_checks.py)

    def batch(self, items: Sequence[UnifiedItem], caches: CacheTable) -> list[PlannedItem | TandemError]:
        """Raises the call's errors; else returns, in order, each item planned (with its cache's state) or the
        error it fails with alone. Items of adapters beyond the first max_on_device distinct ones (among the
        items that pass their own checks) fail with InvalidRequest."""
        self.check_call(items)
        seen: set[str] = set()
        adapters: list[str] = []  # distinct adapters of the planned items, in order
        planned: list[PlannedItem | TandemError] = []
        for n, it in enumerate(items):
            try:
                p = self._item(it, caches, seen)
                if it.adapter and it.adapter not in adapters:
                    if len(adapters) >= self.adapters.max_on_device:
                        raise InvalidRequest(
                            f"{{field}} {it.adapter!r} is one more than the {self.adapters.max_on_device} distinct "
                            f"adapters ({', '.join(adapters)}) one call may use (--max-adapters-on-device): send "
                            "it in another call", "adapter")
                    adapters.append(it.adapter)
                planned.append(p)
            except TandemError as exc:
                planned.append(name_item(exc, n, it.cache_id))
        return planned

    def check_call(self, items: Sequence[UnifiedItem]) -> None:
        if not items:
            raise InvalidRequest("the batch has no {field}", "items")
        total = sum(len(it.token_ids) + len(it.draft_token_ids) for it in items)
        if total > self.max_batch_tokens:
            raise InvalidRequest(f"the batch carries {total} tokens (draft tokens included); this executor takes at "
                                 f"most {self.max_batch_tokens} per call (--max-batch-tokens): split it into chunks",
                                 "items")

    def check_create_call(self, items: Sequence[CreateCacheItem]) -> None:
        if not 1 <= len(items) <= MAX_CREATE_ITEMS:
            raise InvalidRequest(f"CreateCache takes 1 to {MAX_CREATE_ITEMS} {{field}}, got {len(items)}", "items")

    def create_item(self, it: CreateCacheItem) -> None:
        """The checks of one CreateCache item (raises its error)."""
        self._check_ids(it.token_ids, "token_ids")
        if len(it.token_ids) > self.max_len:
            raise SequenceTooLong(f"the prompt ({{field}}) has {len(it.token_ids)} tokens; the model's maximum length "
                                  f"is {self.max_len}", "token_ids")
        if len(it.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidRequest(f"{{field}} has {len(it.cache_salt)} characters; at most {MAX_CACHE_SALT_CHARS}",
                                 "cache_salt")
        if it.adapter:
            self._adapter(it.adapter)
        _check_prompt_logprobs(it.prompt_logprobs)
        check_images(it.images, self.vision, 0, len(it.token_ids), (), it.token_ids, with_pixels=False)

    def _check_ids(self, token_ids: Sequence[int], field: str) -> None:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"{{field}} holds token id {bad}, outside the vocabulary [0, {self.vocab_size})",
                                 field)

    def _adapter(self, name: str) -> None:
        self.adapters.get(name, "adapter")  # AdapterNotFound naming the item's field

    def _item(self, it: UnifiedItem, caches: CacheTable, seen: set[str]) -> PlannedItem:
        if it.cache_id:  # first: the first occurrence of a cache claims it, whatever else is wrong with it
            if it.cache_id in seen:
                raise InvalidRequest(f"{{field}} {it.cache_id!r} appears twice in one batch: send one item per cache",
                                     "cache_id")
            seen.add(it.cache_id)
        if not it.token_ids:
            raise InvalidRequest("{field} is empty", "token_ids")
        self._check_ids(it.token_ids, "token_ids")
        if it.adapter:
            self._adapter(it.adapter)
        if it.sampling is not None:  # registered parameters were checked when they were sent
            it.sampling.validate(self.vocab_size)
        if not 0 <= it.output.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"{{field}} must be in [0, {MAX_TOP_LOGPROBS}], got {it.output.top_logprobs}",
                                 "output.top_logprobs")
        state = None
        if it.cache_id:
            state = caches.get(it.cache_id)
            if state.adapter != it.adapter:
                raise CacheStateConflict(f"the cache was created with adapter {state.adapter or '(base)'!r}; it "
                                         f"cannot continue with {{field}} {it.adapter or '(base)'!r} (its KV depends "
                                         "on the adapter)", "adapter")
            if it.pos_offset != state.table.length:
                raise PositionMismatch(f"position {it.pos_offset} ({{field}}) but the cache holds "
                                       f"{state.table.length} tokens; send the tokens for position "
                                       f"{state.table.length} next", "pos_offset")
        elif it.pos_offset != 0:
            raise InvalidRequest(f"a new cache (empty cache_id) starts at pos_offset 0, got {it.pos_offset}",
                                 "pos_offset")
        end = it.pos_offset + len(it.token_ids)
        if it.is_final_chunk and it.prompt_len is not None and it.prompt_len > end:
            raise InvalidRequest(f"{{field}} {it.prompt_len} exceeds the {end} tokens the cache will hold after "
                                 "this item", "prompt_len")
        if it.allowed_tokens is not None:
            self._check_mask(it)
        if it.prompt_logprobs is not None:
            _check_prompt_logprobs(it.prompt_logprobs)
            if it.draft_token_ids:
                raise InvalidRequest("{field} cannot go with draft_token_ids: drafts are verified, not "
                                     "scored; ask for prompt logprobs on the prompt's chunks", "prompt_logprobs")
            if it.pos_offset and (state is None or state.plp_hidden is None):
                raise CacheStateConflict(
                    f"prompt logprobs at position {it.pos_offset} need the previous position's hidden state, which "
                    "the cache keeps only when its previous item asked for prompt logprobs too (or CreateCache "
                    "made it with prompt_logprobs set): ask on every chunk of the prompt", "prompt_logprobs")
        if it.draft_token_ids:
            self._check_drafts(it)
        if it.model_draft_tokens:
            self._check_model_drafts(it)
        drafts = len(it.draft_token_ids)
        if end + drafts > self.max_len:
            raise SequenceTooLong(f"{it.pos_offset} + {len(it.token_ids)} tokens"
                                  + (f" + {drafts} draft tokens" if drafts else "")
                                  + f" exceed the model's maximum length of {self.max_len} ({{field}})",
                                  "draft_token_ids" if drafts and end <= self.max_len else "token_ids")
        if it.images:
            check_images(it.images, self.vision, it.pos_offset, end, state.tokens if state else (), it.token_ids)
            it = replace(it, images=tuple(im if im.content_hash else replace(
                im, content_hash=image_hash(im.dtype, im.shape, im.pixel_values)) for im in it.images))
        if self.pooling is not None:
            it = self.pooling.check(it, state)
        elif it.pooling is not None:
            raise InvalidRequest("{field} is set but this executor serves no pooled items", "pooling")
        sampling = it.sampling if it.sampling is not None else state.sampling if state else SamplingParams()
        return PlannedItem(it, state, sampling)

    def _check_model_drafts(self, it: UnifiedItem) -> None:
        """UnifiedItem.model_draft_tokens (the room for them is decided later: step/model_drafts.py)."""
        n = it.model_draft_tokens
        if not self.draft_model:
            raise InvalidRequest("model_draft_tokens needs an executor started with --draft-model (capability "
                                 "\"draft_model\"); this one runs no draft model")
        if not 0 < n <= MAX_DRAFT_TOKENS:
            raise InvalidRequest(f"model_draft_tokens {n}; at most {MAX_DRAFT_TOKENS} per item")
        if not it.is_final_chunk:
            raise InvalidRequest("model_draft_tokens need a final chunk: a prompt chunk with more to come samples "
                                 "nothing to verify them against")
        if it.draft_token_ids:
            raise InvalidRequest("model_draft_tokens and draft_token_ids exclude each other: send one of them")
        if not it.output.wants_tokens or it.output.wants_logits:
            raise InvalidRequest("model drafts are verified by sampling them: the output mode must be tokens "
                                 "(no logits per drafted position)")
        if it.allowed_tokens is not None or it.prompt_logprobs is not None or it.pooling is not None:
            raise InvalidRequest("model_draft_tokens cannot go with allowed_tokens, prompt_logprobs or pooling")

    def _check_drafts(self, it: UnifiedItem) -> None:
        if not it.is_final_chunk:
            raise InvalidRequest("{field} need a final chunk: a prompt chunk with more to come samples "
                                 "nothing to verify them against", "draft_token_ids")
        if len(it.draft_token_ids) > MAX_DRAFT_TOKENS:
            raise InvalidRequest(f"{{field}} holds {len(it.draft_token_ids)} tokens; at most {MAX_DRAFT_TOKENS} per "
                                 "item", "draft_token_ids")
        if not it.output.wants_tokens or it.output.wants_logits:
            raise InvalidRequest("draft tokens are verified by sampling them: the output mode must be tokens "
                                 "(no logits per drafted position)", "output.mode")
        if it.allowed_tokens is not None:
            raise InvalidRequest("an item with a token mask (allowed_tokens) cannot carry {field}: the mask "
                                 "holds for one position only; send constrained items without drafts",
                                 "draft_token_ids")
        self._check_ids(it.draft_token_ids, "draft_token_ids")

    def _check_mask(self, it: UnifiedItem) -> None:
        """allowed_tokens: for a chunk that samples, of the vocabulary's width, allowing some token."""
        if not it.is_final_chunk:
            raise InvalidRequest("{field} is set on a chunk that samples nothing (is_final_chunk is false): "
                                 "send the mask with the prompt's final chunk", "allowed_tokens")
        want = mask_bytes(self.vocab_size)
        if len(it.allowed_tokens) != want:
            raise InvalidRequest(f"{{field}} has {len(it.allowed_tokens)} bytes; a mask over this model's "
                                 f"{self.vocab_size} tokens has {want} (ceil(vocab_size / 32) 32-bit words)",
                                 "allowed_tokens")
        if not allows_any(it.allowed_tokens, self.vocab_size):
            raise InvalidRequest("{field} allows no token of the vocabulary: nothing could be sampled "
                                 "(end the sequence instead)", "allowed_tokens")


def _check_prompt_logprobs(top: int | None) -> None:
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"{{field}} must be in [0, {MAX_TOP_LOGPROBS}], got {top}", "prompt_logprobs")


def name_item(exc: TandemError, n: int, cache_id: str | None = None) -> TandemError:
    """The same error (type, hence status, kept), its message prefixed with the item it belongs to and its field,
    if it names one, made the request's path (`token_ids` of item 3 -> `items[3].token_ids`). A caller that
    numbers items differently (the gRPC codec, which leaves out items that failed to convert) renames it with
    renumber_item."""
    named = getattr(exc, "item_detail", None)  # named before (by another layer): its own field kept
    if named is None:
        exc.item_detail = (cache_id, exc.field)  # type: ignore[attr-defined]  (the field within the item)
    elif cache_id:
        exc.item_detail = (cache_id, named[1])  # type: ignore[attr-defined]
    return _named(exc, n)


def unnamed(exc: TandemError) -> TandemError:
    """The error of a single-item call's item (Prefill, whose request carries the item's fields at its top): the
    item's field and message, without the item."""
    detail = getattr(exc, "item_detail", None)
    if detail is not None:
        exc.item_detail, exc.field = None, detail[1]  # type: ignore[attr-defined]
        exc.args = (exc.in_terms(exc.field) if exc.field is not None else exc.template,) + exc.args[1:]
    return exc


def renumber_item(exc: TandemError, n: int) -> TandemError:
    """An error named by name_item, named item n instead (others unchanged)."""
    return _named(exc, n) if getattr(exc, "item_detail", None) is not None else exc


def _named(exc: TandemError, n: int) -> TandemError:
    cache_id, field = exc.item_detail  # type: ignore[attr-defined]
    message = exc.template
    if field is not None:
        exc.field = f"items[{n}].{field}"
        message = exc.in_terms(exc.field)
    exc.args = (f"item {n}" + (f" (cache {cache_id!r})" if cache_id else "") + f": {message}",) + exc.args[1:]
    return exc
