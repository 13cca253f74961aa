"""ExecutorConfig: everything the executor is started with (filled from CLI flags or by tests)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from executor_service.kv.tiers.config import KvTierConfig
from executor_service.kv.transfer.config import KvTransferConfig
from models.kv.paged_cache import DEFAULT_BLOCK_SIZE

# Default attention workspace bound per call, per token of --max-batch-tokens (models/attention/paged.py): 8192 x 64
# = 524k elements, i.e. 256 decode rows at a 2k context in one bucket; larger buckets are split.
ATTENTION_ELEMENTS_PER_BATCH_TOKEN = 64


@dataclass(frozen=True)
class ExecutorConfig:
    model_dir: Path
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    quantization: str = "none"  # none | int8 | fp16 | int4: linear weights (models/quant/linear.py)
    # A GGUF file's block-quantized weights dequantized to `dtype` at load instead of kept in their blocks
    # (models/gguf/loader.py): what --deterministic and --compile need, and tensor parallelism where a rank's
    # share of a layer's inputs would cut blocks.
    gguf_dequantize: bool = False
    # KV pool: exactly kv_blocks blocks, or kv_memory_fraction of the free memory, or (both None) the
    # device's default sizing (executor_service/kv/sizing.py).
    kv_blocks: int | None = None
    kv_memory_fraction: float | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    max_batch_tokens: int = 8192  # most tokens one forward may carry (all items together)
    # Attention workspace bound of one call (rows x padded queries x longest context per bucket, see
    # models/attention/paged.py): buckets over it are split. None: max_batch_tokens x 64; 0: no bound.
    max_attention_elements: int | None = None
    progress: bool = True  # progress bar while loading weights
    # CPU float32 with the eager decode step: the linear weights in oneDNN's packed layout instead of plain
    # (~1.1-1.3x per decode step on 2 cores; the same memory). Off: plain F.linear only.
    cpu_packed_weights: bool = True
    # The compiled decode step (models/decode/compiled.py): all-decode batches run a torch.compile'd forward,
    # compiled before READY (compile_cache_dir: inductor's on-disk caches; None = torch's default).
    compile: bool = False
    compile_cache_dir: Path | None = None
    # Which step runs decode calls (executor_service/step/decode_choice.py): auto | native | torch. native_cache_dir:
    # where the native kernel's compiled library is kept (None: ~/.cache/tandem/native).
    decode_kernel: str = "auto"
    native_cache_dir: Path | None = None
    # Paged attention of the eager forward (models/attention/backend.py): auto | flex | flashinfer | gathered;
    # the KV pool's dtype (models/kv/dtype.py): auto (the weights') | float32 | bfloat16 | float16 | fp8_e4m3.
    attention_backend: str = "auto"
    kv_dtype: str = "auto"
    # All-decode steps replay CUDA graphs captured at start (executor_service/step/decode_choice.py): None = where
    # they can run, True = required (else refused), False = never; graphs for batches up to cuda_graph_max_batch.
    cuda_graphs: bool | None = None
    cuda_graph_max_batch: int = 64
    # CPU weights in transparent huge pages (models/memory/huge_pages.py): auto (unless they fault in slowly here) | on | off
    huge_pages: str = "auto"
    # Every call through the row-invariant native step, each row sampled alone: bit-identical results whatever
    # the batch, chunking, preemption or executor (executor_service/step/deterministic.py, docs/deterministic.md)
    deterministic: bool = False
    # LoRA: runtime loads only from inside adapter_root (None: runtime loading disabled); `adapters` are the
    # operator's preloads (name, dir); at most max_adapters_on_device adapters' weights on the device.
    adapter_root: Path | None = None
    adapters: tuple[tuple[str, Path], ...] = ()
    max_adapters_on_device: int = 8
    max_lora_rank: int = 64
    # Lease of every client session (and of the anonymous one): its caches are released once no call named
    # it for this long (executor_service/sessions.py).
    session_ttl_s: float = 30.0
    # Automatic prefix caching (executor_service/kv/prefix_cache.py): full blocks are indexed by content hash
    # and reused by CreateCache. Off: nothing is hashed, CreateCache creates empty caches.
    prefix_caching: bool = True
    # Embedding pooling (models/pooling_config.py): last | mean, over the checkpoint's own configuration; None =
    # the checkpoint's (sentence-transformers modules.json), else last token.
    pooling: str | None = None
    # Vision-language models: images whose embeddings are kept by content hash (executor_service/vision/
    # embedding_cache.py), least recently used first out; 0 = none kept.
    vision_cache_images: int = 64
    max_kv_subscribers: int = 8  # concurrent SubscribeKvEvents streams
    kv_events_buffer: int = 10_000  # events a subscriber may have unread before it is dropped
    # Ranks the model is split over (executor_service/tp/stack.py); 1 = the whole model here.
    tensor_parallel_size: int = 1
    # Role and ImportKv's link to other executors (executor_service/kv/transfer/config.py)
    kv_transfer: KvTransferConfig = KvTransferConfig()
    # KV tiers under the prefix cache: host memory, disk (executor_service/kv/tiers/config.py)
    kv_tiers: KvTierConfig = KvTierConfig()
    # Speculative decoding with a draft model (executor_service/draft_model_stack.py): a checkpoint directory or
    # GGUF file of the same vocabulary, run here beside the served model; its own KV pool of draft_kv_blocks
    # blocks (None: a quarter of the served pool's, at least 16).
    draft_model: Path | None = None
    draft_kv_blocks: int | None = None

    def attention_bound(self) -> int | None:
        """The attention workspace limit to split buckets at; None = never split."""
        if self.max_attention_elements is None:
            return self.max_batch_tokens * ATTENTION_ELEMENTS_PER_BATCH_TOKEN
        if self.max_attention_elements < 0:
            raise ValueError(f"--max-attention-elements must be >= 0 (0 = no bound), got "
                             f"{self.max_attention_elements}")
        return self.max_attention_elements or None

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but torch sees no CUDA device")
        return dev
