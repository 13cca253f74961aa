"""The JSON bodies of /v1/embeddings (OpenAI's), /v1/score (vLLM's) and /v1/rerank (Cohere's and Jina's shape, as
vLLM serves it): requests validated strictly like every other route's (scheduler/http/request_schemas.py: unknown
fields refused, 400 naming the field), and the responses."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from scheduler.http.request_schemas import UINT32_MAX, TokenId, _Body  # (the strict base every request body shares)
from scheduler.http.response_schemas import Out


class EmbeddingRequest(_Body):
    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] | None = None  # unset = float
    dimensions: int | None = Field(None, ge=1, le=UINT32_MAX)  # Matryoshka models only
    user: str | None = None  # accepted, unused


class ScoreRequest(_Body):
    model: str | None = None
    text_1: str | list[str]  # the query (one, for every text_2) or one per text_2
    text_2: str | list[str]  # the documents


class RerankDocument(_Body):
    text: str


class RerankRequest(_Body):
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(None, ge=0, le=UINT32_MAX)  # unset or 0 = every document
    return_documents: bool | None = None  # unset = true (vLLM, Jina); false leaves `document` out


class EmbeddingUsage(Out):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(Out):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # base64: little-endian float32 bytes
    index: int


class EmbeddingResponse(Out):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class ScoreUsage(Out):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreData(Out):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(Out):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankDocumentOut(Out):
    text: str


class RerankResult(Out):
    index: int
    relevance_score: float
    document: RerankDocumentOut | None = None


class RerankResponse(Out):
    id: str
    model: str
    usage: ScoreUsage
    results: list[RerankResult]
