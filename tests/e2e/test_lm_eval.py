"""The real lm-evaluation-harness (lm-eval 0.4.13) against a real scheduler + executor on the tiny llama: a local
multiple-choice task (loglikelihood requests: /v1/completions with echo, logprobs 1, max_tokens 1 and token-id
prompts) and a local generation task (generate_until), run with `--model local-completions` and with
`--model hf` on the same weights. The scores are equal, and so is every sample: the same loglikelihoods within
1e-4 and the same generated text. Task YAML and jsonl data live in the test's tmp dir; nothing is fetched."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.grpc_harness import start_for, start_scheduler_for

pytest.importorskip("lm_eval")

LM_EVAL_CLI = Path(__file__).with_name("lm_eval_cli.py")  # `python -m lm_eval` without its built-in task index

MC_ITEMS = [
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
    {"question": "A fish lives in", "choices": [" water", " trees", " the sky", " fire"], "answer": 0},
    {"question": "Cats say", "choices": [" meow", " moo"], "answer": 0},
]
GEN_ITEMS = [{"question": "Once upon a time", "answer": "x"}, {"question": "The weather today", "answer": "y"},
             {"question": "hello there", "answer": "z"}]
MC_TASK = """task: tandem_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """task: tandem_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, items, yaml in (("mc", MC_ITEMS, MC_TASK), ("gen", GEN_ITEMS, GEN_TASK)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(i) + "\n" for i in items))
        (root / f"{name}.yaml").write_text(yaml.format(data=data))
    return root


def run_lm_eval(runs: list[tuple[str, str, Path]], tasks: Path) -> list[dict[str, list[dict]]]:
    """Runs the lm_eval CLI once per (model, model_args, output dir), all in one interpreter
    (tests/e2e/lm_eval_cli.py); returns each run's logged samples per task."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, str(LM_EVAL_CLI)]
    for n, (model, model_args, out) in enumerate(runs):
        cmd += ["--and"] * (n > 0) + [
            "--model", model, "--model_args", model_args, "--tasks", "tandem_mc,tandem_gen", "--include_path",
            str(tasks), "--batch_size", "1", "--device", "cpu", "--log_samples", "--output_path", str(out),
            "--seed", "0"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return [_samples(out) for _, _, out in runs]


def _samples(out: Path) -> dict[str, list[dict]]:
    samples: dict[str, list[dict]] = {}
    for f in out.rglob("samples_*.jsonl"):
        task = f.name.removeprefix("samples_").rsplit("_", 1)[0]
        samples[task] = sorted((json.loads(line) for line in f.read_text().splitlines()), key=lambda s: s["doc_id"])
    assert set(samples) == {"tandem_mc", "tandem_gen"}, list(out.rglob("*"))
    return samples


def test_local_completions_scores_equal_hf(request, model_dir, tasks, tmp_path):
    executor = start_for(request, model_dir, "--kv-blocks", "256")
    scheduler = start_scheduler_for(request, executor.address, "--http-port", "0")
    url = f"{scheduler.process.http_url}/v1/completions"
    # one interpreter, the two runs one after the other: the CPU of a second interpreter's imports saved
    ours, ref = run_lm_eval([("local-completions", f"model={Path(model_dir).name},base_url={url},"
                              f"tokenizer={model_dir},tokenized_requests=True,num_concurrent=1,max_retries=1",
                              tmp_path / "ours"),
                             ("hf", f"pretrained={model_dir},dtype=float32", tmp_path / "hf")], tasks)
    for a, b in zip(ours["tandem_mc"], ref["tandem_mc"], strict=True):
        got = [float(r[0][0]) for r in a["resps"]]  # per choice: (loglikelihood, is_greedy)
        want = [float(r[0][0]) for r in b["resps"]]
        assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < 1e-4, (got, want)
        assert a["acc"] == b["acc"] and [r[0][1] for r in a["resps"]] == [r[0][1] for r in b["resps"]]
    assert [s["resps"] for s in ours["tandem_gen"]] == [s["resps"] for s in ref["tandem_gen"]]
    assert [s["exact_match"] for s in ours["tandem_gen"]] == [s["exact_match"] for s in ref["tandem_gen"]]
