"""Whether all-decode steps replay CUDA graphs (`--cuda-graphs/--no-cuda-graphs`, models/decode/cuda_graphs.py), decided
once at start, after executor_service/step/decode_kernel.py chose the step they would otherwise run.

- unset (default): graphs wherever they can run: a CUDA device, decode steps that would run the eager PyTorch
  forward (not --compile, not the native CPU kernel), a dense model. Elsewhere the chosen step stays, and the
  log says why (`cuda_graph_refusal`'s reason; GetInfo lacks the capability "cuda_graphs").
- --cuda-graphs: the same, but a configuration where they cannot run exits 2 with the reason.
- --no-cuda-graphs: never.

The graphs are captured here, before the server reports READY, within models/decode/cuda_graphs.py's start-up budget
(DEFAULT_CAPTURE_BUDGET_S; buckets it leaves uncaptured run the decode forward eagerly, and the log names them).
"""
from __future__ import annotations

import logging

from executor_service.config import ExecutorConfig
from executor_service.step.decode_kernel import DecodeStep
from models.decode.cuda_graphs import CudaGraphDecode
from models.kv_cache import PagedKvCache
from models.transformer import DecoderModel

log = logging.getLogger("tandem.executor")

CAPABILITY = "cuda_graphs"  # GetInfoResponse.capabilities when all-decode steps replay graphs


def cuda_graph_refusal(config: ExecutorConfig, model: DecoderModel, kv: PagedKvCache,
                       chosen: DecodeStep | None) -> str | None:
    """Why CUDA graphs cannot run decode steps here (None: they can). chosen: the step executor_service/step/decode_kernel.py chose
    (None: the eager forward)."""
    if kv.k.device.type != "cuda":
        return f"the device is {kv.k.device.type}, not CUDA"
    if config.compile:
        return "--compile runs decode steps through torch.compile'd code"
    if chosen is not None:
        return f"decode steps run {type(chosen).__name__}"
    if model.config.num_experts:
        return "a mixture-of-experts model routes tokens data-dependently, which a graph cannot capture"
    return None


def graph_decode_step(config: ExecutorConfig, model: DecoderModel, kv: PagedKvCache,
                      chosen: DecodeStep | None) -> tuple[DecodeStep | None, str | None]:
    """The decode step to run and, when it is not the graphed one, why (None when --no-cuda-graphs). Captures
    the graphs when they apply. Raises ValueError for --cuda-graphs where they cannot run."""
    if config.cuda_graphs is False:
        return chosen, None
    reason = cuda_graph_refusal(config, model, kv, chosen)
    if reason is not None:
        if config.cuda_graphs:
            raise ValueError(f"--cuda-graphs cannot run here: {reason}")
        log.info("decode steps do not replay CUDA graphs: %s", reason)
        return chosen, reason
    if config.cuda_graph_max_batch < 1:
        raise ValueError(f"--cuda-graph-max-batch must be >= 1, got {config.cuda_graph_max_batch}")
    graphs = CudaGraphDecode(model, kv, config.cuda_graph_max_batch)
    seconds = graphs.capture()
    log.info("decode steps replay CUDA graphs: %d of %d batch-size buckets (up to %d rows) captured in %.1f s",
             len(graphs.captured), len(graphs.buckets), config.cuda_graph_max_batch, seconds)
    return graphs, None
