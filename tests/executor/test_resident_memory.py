"""Resident memory ~ the weights: a real executor on a mid-size random checkpoint (~260 MB of float32 weights,
made here from transformers' LlamaConfig, tied head like SmolLM2), after READY and a generation that read every
weight, holds at most 1.15x its weight bytes + the runtime's own memory. The runtime allowance is measured, not
guessed: the RSS of the executor on the tiny test checkpoint (~0.4 MB of weights: torch, gRPC, the native
library, the KV pool of 64 blocks; measured 331-342 MB in every mode here, so once), + ALLOWANCE_SLACK for that
spread, allocator noise and the larger model's scratch buffers. Each decode-step layout is checked: the native
step (the plain weights, mapped), the eager step with the oneDNN-packed layout (in place of the plain weights),
and the eager step with every weight copied into the huge-page arena. Before each copy's source was released,
this checkpoint's executor held 906 MB in each of these modes (2.3x its 245 MB of weights past the runtime)."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.shapes import make_checkpoint, weight_bytes
from models.decode.native import machine_refusal
from tests.grpc_harness import start_executor, start_scheduler
from tandem.generate.v1 import generate_pb2 as pb
from tests.scheduler_client import collect, ids_request

pytestmark = pytest.mark.fresh_process  # measures an executor's resident memory: a fresh interpreter's

MB = 1 << 20
ALLOWANCE_SLACK = 48 * MB
MODES = {"native": ("--decode-kernel", "native"), "eager-packed": ("--decode-kernel", "torch"),
         "eager-huge-pages": ("--decode-kernel", "torch", "--no-cpu-packed-weights", "--huge-pages", "on")}


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("mid-llama"), "LlamaConfig", dict(
        vocab_size=16000, hidden_size=768, intermediate_size=3072, num_hidden_layers=6, num_attention_heads=12,
        num_key_value_heads=4, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2))


@pytest.fixture(scope="module")
def runtime(model_dir) -> int:
    return resident_after_generation(model_dir, ())


def resident_after_generation(model: Path, flags: tuple[str, ...]) -> int:
    """RSS (bytes, /proc/PID/smaps_rollup) of a real executor after READY and 8 greedy tokens of a 32-token
    prompt through a real scheduler (the weights all read at least once)."""
    with start_executor(model, "--kv-blocks", "64", "--threads", "2", *flags) as ex:
        with start_scheduler(ex.address) as sched:
            out = collect(sched.stub, ids_request(list(range(5, 37)), 8, stopping=pb.StoppingCriteria(
                max_new_tokens=8, ignore_eos=True)))
            assert len(out.token_ids) == 8
            rollup = Path(f"/proc/{ex.proc.pid}/smaps_rollup").read_text().split("\n")
            return next(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Rss:"))


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("mode", list(MODES))
def test_resident_memory_is_about_the_weights(mid_model, runtime, mode):
    if mode == "native" and machine_refusal():
        pytest.skip(f"native step: {machine_refusal()}")
    weights = weight_bytes(mid_model)
    assert 200 * MB < weights < 320 * MB
    rss = resident_after_generation(mid_model, MODES[mode])
    limit = 1.15 * weights + runtime + ALLOWANCE_SLACK
    assert rss <= limit, (f"{mode}: RSS {rss / MB:.0f} MB for {weights / MB:.0f} MB of weights; allowed "
                          f"{limit / MB:.0f} MB (runtime {runtime / MB:.0f} MB)")
