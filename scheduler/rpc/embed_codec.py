"""GenerateService.Embed's messages <-> the pooled requests of scheduler/pooling/ (the servicer's four moves:
proto -> prompts -> the fleet -> proto)."""
from __future__ import annotations

from tandem.errors import InvalidRequest
from tandem.generate.v1 import generate_pb2 as pb

MAX_REQUEST_ID_CHARS = 256


def embed_inputs_from_pb(m: pb.EmbedRequest) -> list[str | list[int]]:
    """Each input's text or token ids (checked by scheduler/pooling/inputs.py, naming `inputs.N`)."""
    if len(m.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id has {len(m.request_id)} characters; at most {MAX_REQUEST_ID_CHARS}")
    inputs: list[str | list[int]] = []
    for i, item in enumerate(m.inputs):
        kind = item.WhichOneof("input")
        if kind is None:
            raise InvalidRequest(f"inputs.{i}: set one of text or token_ids")
        inputs.append(item.text if kind == "text" else list(item.token_ids.ids))
    return inputs


def embed_response_to_pb(request_id: str, vectors, prompt_tokens: list[int]) -> pb.EmbedResponse:
    return pb.EmbedResponse(request_id=request_id, prompt_tokens=sum(prompt_tokens),
                            embeddings=[pb.Embedding(values=v.tolist(), prompt_tokens=n)
                                        for v, n in zip(vectors, prompt_tokens)])
