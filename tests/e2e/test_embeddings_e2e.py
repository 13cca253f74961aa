"""Embeddings and scoring end to end (real executor and scheduler processes, the real `openai` client and
sentence-transformers as references; docs/agents.md#embeddings-and-rerank):

- /v1/embeddings on a sentence-transformers folder (modules.json + 1_Pooling mean + 2_Normalize) equals
  SentenceTransformer.encode on the same weights (cosine >= 0.9999), float and base64, texts and token ids,
  `dimensions` on a Matryoshka model (and 400 naming it on one that is not), usage; last-token pooling (no
  modules.json, as Qwen3-Embedding) equals transformers' last hidden state;
- an embedding request runs in the same forward as a running generation (the executor's "mixed" steps) and the
  generation's greedy text is the one it has alone;
- gRPC GenerateService.Embed equals the HTTP embeddings;
- /v1/rerank and /v1/score of a Qwen3-Reranker-style yes/no model equal the model card's reference computed
  with transformers, and of a Qwen2ForSequenceClassification checkpoint equal its head (sigmoid);
- bad input is 400 naming the field, unknown fields are refused, the routes take a user token (401 without),
  and a model or executor that cannot serve them says why."""
from __future__ import annotations

import concurrent.futures
import re
import urllib.request

import grpc
import httpx
import numpy as np
import openai
import pytest
import torch
import transformers

from tandem.executor.v1 import executor_pb2 as epb
from tandem.generate.v1 import generate_pb2 as pb
from tests.conftest import built_once
from tests.grpc_harness import start_for, start_scheduler_for
from tests.pooling_checkpoints import make_classifier, make_mean_embedder, make_reranker
from tests.scheduler_client import collect
from tests.security_fixtures import new_token, write_tokens

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello! How are you today?",
         "Cache memory is shared between requests."]
QUERY = "What do the fishermen bring back?"
DOCS = ["In the evening they came back with baskets full of silver fish.", "The baker sold warm bread.",
        "def add(a, b): return a + b", "The children ran along the beach."]
USER, ADMIN = new_token(), new_token()
GEN_PROMPT = "Once upon a time there was a small town by the sea."
MODEL = "tiny-embed"  # the sentence-transformers model's --served-model-name


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return {"mean": built_once(tmp_path_factory, "pooling", "qwen3-st-mean", make_mean_embedder),
            "rerank": built_once(tmp_path_factory, "pooling", "qwen3-reranker", make_reranker),
            "classify": built_once(tmp_path_factory, "pooling", "qwen2-classifier-1", lambda out: make_classifier(out))}


@pytest.fixture(scope="module")
def mean_stack(request, dirs, tmp_path_factory):
    """(executor with --metrics-port, scheduler, scheduler with bearer tokens) over the sentence-transformers model."""
    tokens = write_tokens(tmp_path_factory.mktemp("tokens") / "tokens", {USER: "user", ADMIN: "admin"})
    executor = start_for(request, dirs["mean"], "--kv-blocks", "256", "--metrics-port", "0")
    plain = start_scheduler_for(request, executor.address, "--http-port", "0", "--decode-burst-ms", "0",
                                "--served-model-name", MODEL)
    secure = start_scheduler_for(request, executor.address, "--http-port", "0", "--auth-token-file", str(tokens))
    return executor, plain, secure


@pytest.fixture(scope="module")
def rerank_executor(request, dirs):
    return start_for(request, dirs["rerank"], "--kv-blocks", "256")


@pytest.fixture(scope="module")
def rerank_url(request, rerank_executor):
    return start_scheduler_for(request, rerank_executor.address, "--http-port", "0").process.http_url


@pytest.fixture(scope="module")
def classify_url(request, dirs):
    executor = start_for(request, dirs["classify"], "--kv-blocks", "128")
    return start_scheduler_for(request, executor.address, "--http-port", "0").process.http_url


@pytest.fixture(scope="module")
def client(mean_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mean_stack[1].process.http_url}/v1", api_key="unused", max_retries=0, timeout=120)


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_openai_embeddings_equal_sentence_transformers(client, dirs):
    from sentence_transformers import SentenceTransformer

    ref = SentenceTransformer(str(dirs["mean"]), device="cpu").encode(TEXTS, normalize_embeddings=True)
    as_float = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    as_base64 = client.embeddings.create(model=MODEL, input=TEXTS)  # (the client asks for base64, decodes it)
    assert as_float.model == MODEL
    for got in (as_float, as_base64):
        vectors = [d.embedding for d in sorted(got.data, key=lambda d: d.index)]
        assert [d.index for d in got.data] == [0, 1, 2] and len(vectors[0]) == 64
        assert cosines(vectors, ref).min() >= 0.9999
        assert np.allclose(np.linalg.norm(vectors, axis=-1), 1, atol=1e-5)
    tok = transformers.AutoTokenizer.from_pretrained(dirs["mean"])
    ids = [tok(t)["input_ids"] for t in TEXTS]
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == sum(map(len, ids))
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert cosines([d.embedding for d in by_ids.data], ref).min() >= 0.9999
    one = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float", user="someone")
    assert len(one.data) == 1 and cosines(one.data[0].embedding, ref[1]) >= 0.9999


def test_langchain_openai_embeddings(mean_stack, dirs):
    """langchain-openai's OpenAIEmbeddings against Tandem: documents and a query, equal to sentence-transformers'.
    (check_embedding_ctx_length=False: otherwise it sends tiktoken's token ids, which mean nothing to this model.)"""
    pytest.importorskip("langchain_openai")
    from langchain_openai import OpenAIEmbeddings
    from sentence_transformers import SentenceTransformer

    ref = SentenceTransformer(str(dirs["mean"]), device="cpu").encode(TEXTS, normalize_embeddings=True)
    emb = OpenAIEmbeddings(model=MODEL, base_url=f"{mean_stack[1].process.http_url}/v1", api_key="unused",
                           check_embedding_ctx_length=False, max_retries=0)
    assert cosines(emb.embed_documents(TEXTS), ref).min() >= 0.9999
    assert cosines(emb.embed_query(TEXTS[2]), ref[2]) >= 0.9999


def test_dimensions_cut_and_renormalise_on_a_matryoshka_model(client, rerank_url):
    full = np.asarray(client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float").data[0].embedding)
    cut = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=16).data[0].embedding
    assert len(cut) == 16 and np.allclose(cut, full[:16] / np.linalg.norm(full[:16]), atol=1e-5)
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=20)
    assert err.value.body["param"] == "dimensions" and "[16, 32]" in err.value.body["message"]
    r = httpx.post(f"{rerank_url}/v1/embeddings", json={"input": "x", "dimensions": 8}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
    assert "Matryoshka" in r.json()["error"]["message"]


def test_last_token_embedding_equals_transformers(rerank_url, dirs):
    """No modules.json: last-token pooling (Qwen3-Embedding style), normalised."""
    got = httpx.post(f"{rerank_url}/v1/embeddings", json={"input": TEXTS}, timeout=60).json()
    tok = transformers.AutoTokenizer.from_pretrained(dirs["rerank"])
    model = transformers.AutoModel.from_pretrained(dirs["rerank"], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [model(torch.tensor([tok(t)["input_ids"]])).last_hidden_state[0, -1].numpy() for t in TEXTS]
    assert cosines([d["embedding"] for d in got["data"]], ref).min() >= 0.9999


def steps_of(executor, kind: str) -> float:
    found = re.search(r"metrics on (\S+)", executor.stderr())
    with urllib.request.urlopen(found.group(1), timeout=10) as resp:
        text = resp.read().decode()
    m = re.search(rf'tandem:executor_step_duration_seconds_count{{kind="{kind}"}} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def test_embeddings_run_in_the_same_step_as_a_generation_which_is_unchanged(mean_stack, client):
    executor, scheduler, _ = mean_stack
    request = pb.GenerateRequest(text=GEN_PROMPT, stopping=pb.StoppingCriteria(max_new_tokens=120, ignore_eos=True))
    alone = collect(scheduler.stub, request).token_ids
    before = steps_of(executor, "mixed")
    want = np.asarray([d.embedding for d in client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float").data])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stream = scheduler.stub.Generate(request, timeout=120)
        first = next(stream)  # the generation is running ...
        embedded = pool.submit(client.embeddings.create, model=MODEL, input=TEXTS, encoding_format="float")  # ... and this joins
        rest = [m for m in stream]
        got = np.asarray([d.embedding for d in embedded.result().data])
    tokens = list(first.token_ids) + [t for m in rest for t in m.token_ids]
    assert tokens == alone  # the generation's output is unchanged
    assert cosines(got, want).min() >= 0.99999
    assert steps_of(executor, "mixed") > before  # prompt chunks of the embeddings beside its decode tokens


def test_grpc_embed_equals_http(mean_stack, client):
    stub = mean_stack[1].stub
    http = [d.embedding for d in client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float").data]
    resp = stub.Embed(pb.EmbedRequest(request_id="e1", inputs=[pb.EmbedInput(text=t) for t in TEXTS]), timeout=60)
    assert resp.request_id == "e1" and len(resp.embeddings) == 3
    assert cosines([list(e.values) for e in resp.embeddings], http).min() >= 0.99999
    cut = stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(token_ids=pb.TokenIds(ids=[1, 40, 41]))], dimensions=32),
                     timeout=60)
    assert len(cut.embeddings[0].values) == 32 and cut.prompt_tokens == 3
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(text="ok"), pb.EmbedInput(token_ids=pb.TokenIds(ids=[9999]))]),
                   timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "inputs.1" in err.value.details()


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["fine", ""]}, "input.1"),
    ({"input": [[1, 2], [100000]]}, "input.1"),
    ({"input": [[]]}, "input.0"),
    ({"input": "x " * 400}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "pooling": "cls"}, "pooling"),
    ({"input": 5}, "input"),
], ids=["empty", "no-inputs", "empty-item", "token-id", "empty-ids", "too-long", "format", "dims", "unknown", "type"])
def test_bad_embedding_input_is_400_naming_the_field(mean_stack, body, param):
    r = httpx.post(f"{mean_stack[1].process.http_url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_routes_take_a_user_token(mean_stack):
    url = mean_stack[2].process.http_url
    for path, body in (("/v1/embeddings", {"input": "x"}), ("/v1/rerank", {"query": "q", "documents": ["d"]}),
                       ("/v1/score", {"text_1": "q", "text_2": "d"})):
        assert httpx.post(f"{url}{path}", json=body, timeout=60).status_code == 401
        r = httpx.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {USER}"}, timeout=60)
        # a user token passes; this model scores no pairs (no head, not a reranker): a precise 400
        assert r.status_code == (200 if path == "/v1/embeddings" else 400), r.text
        if path != "/v1/embeddings":
            assert "scores no pairs" in r.json()["error"]["message"]


def yes_no_reference(model_dir, query: str, docs: list[str]) -> list[float]:
    """Qwen3-Reranker's model card, with transformers on the same weights (one pair at a time: no padding)."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prefix = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
              "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    instruction = "Given a web search query, retrieve relevant passages that answer the query"
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    scores = []
    for doc in docs:
        body = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
        ids = tok.encode(prefix, add_special_tokens=False) + tok(body)["input_ids"] + \
            tok.encode(suffix, add_special_tokens=False)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        pair = torch.log_softmax(torch.stack([logits[no], logits[yes]]), dim=0)
        scores.append(float(pair[1].exp()))
    return scores


def test_yes_no_rerank_and_score_equal_the_reference(rerank_url, rerank_executor, dirs):
    ref = yes_no_reference(dirs["rerank"], QUERY, DOCS)
    hits = rerank_executor.stub.GetMetrics(epb.GetMetricsRequest(), timeout=10).prefix_cache.hit_tokens
    r = httpx.post(f"{rerank_url}/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 3}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    order = sorted(range(len(DOCS)), key=lambda i: -ref[i])[:3]
    assert [x["index"] for x in body["results"]] == order
    assert [x["document"]["text"] for x in body["results"]] == [DOCS[i] for i in order]
    assert np.allclose([x["relevance_score"] for x in body["results"]], [ref[i] for i in order], atol=1e-5)
    assert body["usage"]["total_tokens"] > 0 and body["id"].startswith("rerank-")
    # the prompt up to the document is the same for every document: its full blocks came from the prefix cache
    assert rerank_executor.stub.GetMetrics(epb.GetMetricsRequest(), timeout=10).prefix_cache.hit_tokens >= hits + 16
    bare = httpx.post(f"{rerank_url}/v1/rerank", json={"query": QUERY, "documents": [{"text": d} for d in DOCS],
                                                        "return_documents": False}, timeout=60).json()
    assert len(bare["results"]) == 4 and all("document" not in x for x in bare["results"])
    score = httpx.post(f"{rerank_url}/v1/score", json={"text_1": QUERY, "text_2": DOCS}, timeout=60).json()
    assert [d["index"] for d in score["data"]] == [0, 1, 2, 3] and score["object"] == "list"
    assert np.allclose([d["score"] for d in score["data"]], ref, atol=1e-5)
    pairs = httpx.post(f"{rerank_url}/v1/score", json={"text_1": [QUERY, QUERY], "text_2": DOCS[:2]}, timeout=60)
    assert np.allclose([d["score"] for d in pairs.json()["data"]], ref[:2], atol=1e-5)


def test_classifier_rerank_equals_its_head(classify_url, dirs):
    tok = transformers.AutoTokenizer.from_pretrained(dirs["classify"])
    model = transformers.AutoModelForSequenceClassification.from_pretrained(dirs["classify"], dtype=torch.float32)
    with torch.no_grad():
        ref = [float(torch.sigmoid(model(torch.tensor([tok(QUERY, d)["input_ids"]])).logits[0, 0])) for d in DOCS]
    body = httpx.post(f"{classify_url}/v1/rerank", json={"query": QUERY, "documents": DOCS}, timeout=60).json()
    assert np.allclose([ref[x["index"]] for x in body["results"]], [x["relevance_score"] for x in body["results"]],
                       atol=1e-5)
    assert [x["index"] for x in body["results"]] == sorted(range(4), key=lambda i: -ref[i])
    r = httpx.post(f"{classify_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "no LM head" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "max_chunks_per_doc": 2}, "max_chunks_per_doc"),
    ("/v1/rerank", {"query": "q", "documents": ["d " * 300]}, "documents.0"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/v1/score", {"text_1": "a"}, "text_2"),
], ids=["no-documents", "top_n", "unknown", "too-long", "lengths", "missing"])
def test_bad_score_input_is_400_naming_the_field(rerank_url, path, body, param):
    r = httpx.post(f"{rerank_url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_an_executor_without_pooling_is_a_precise_error(request, model_dir):
    """--deterministic runs every row through the native step, which keeps no hidden states: its GetInfo lists
    no "pooling", and the scheduler says so (400 over HTTP, FAILED_PRECONDITION over gRPC) without queueing."""
    executor = start_for(request, model_dir, "--kv-blocks", "64", "--deterministic")
    scheduler = start_scheduler_for(request, executor.address, "--http-port", "0")
    for path, body in (("/v1/embeddings", {"input": "x"}), ("/v1/rerank", {"query": "q", "documents": ["d"]})):
        r = httpx.post(f"{scheduler.process.http_url}{path}", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "failed_precondition"
        assert "capability 'pooling'" in r.json()["error"]["message"] and "--deterministic" in r.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as err:
        scheduler.stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(text="x")]), timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
