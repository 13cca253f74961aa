"""What the soak asks: a fixed prompt set, and a random request mix over it — which protocol (gRPC Generate,
HTTP chat completions, HTTP completions), streaming or not, greedy or seeded, an adapter or the base model,
and whether the client cancels (gRPC) or hangs up (HTTP) and when. Every request without a planned cancel
must come back with exactly the clean run's answer for its (protocol, prompt, adapter, seeded) key: the
references are taken once at the start, one request at a time, before any chaos.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("grpc", "chat", "completion")
# scripts/soak --all: the same HTTP requests through a router in front of the schedulers (no adapters there)
ROUTED_KINDS = ("smg-chat", "smg-completion", "vr-chat", "vr-completion")
DIRECT_ROUTES = ("s0", "s1")  # --all: a direct request goes to either scheduler
SEED = 1234  # the sampling seed of seeded requests (the same for every one: the reference is per key)
_WORDS = ("the quick brown fox jumps over lazy dog serving stack reads prompt splits tokens model step "
          "town sea morning fishermen boats evening baskets silver fish children beach weather baker bread "
          "cache memory shared between requests scheduler queue blocks chunks numbers hello today answer").split()


@dataclass(frozen=True)
class Mix:
    """Shares of the request mix (each in [0, 1]; kinds by weight)."""
    kinds: tuple[tuple[str, float], ...] = (("grpc", 4.0), ("chat", 3.0), ("completion", 3.0))
    stream_share: float = 0.6  # of HTTP requests (gRPC Generate always streams)
    cancel_share: float = 0.15  # client cancels (gRPC) / disconnects (HTTP)
    adapter_share: float = 0.2
    seeded_share: float = 0.1
    slow_share: float = 0.0  # slow readers (--all): a stream read once, then left unread past the stall timeout
    routes: tuple[str, ...] = ()  # the schedulers a direct request may go to (--all: DIRECT_ROUTES)


@dataclass(frozen=True)
class Spec:
    """One request as the client plans it. cancel_after: cancel (gRPC) or hang up (HTTP) once this many
    token-bearing messages arrived; 0 = after cancel_delay_s seconds, whatever came; None = never."""
    n: int
    kind: str
    stream: bool
    prompt: int
    adapter: str
    seeded: bool
    cancel_after: int | None = None
    cancel_delay_s: float = 0.0
    route: str = ""  # --all: "s0"/"s1" (a scheduler, directly), "smg" or "vr" (vllm-router); "" = the one
    slow: bool = False  # a slow reader: reads one message, then nothing for a while (--all)

    @property
    def protocol(self) -> str:
        """grpc, chat or completion (a routed kind's protocol is its last word)."""
        return self.kind.rsplit("-", 1)[-1]

    @property
    def key(self) -> tuple[str, int, str, bool]:
        """The reference this request is checked against (streaming or not, the answer is the same)."""
        return (self.kind, self.prompt, self.adapter, self.seeded)

    @property
    def label(self) -> str:
        if self.slow:
            return f"{self.kind}-slow-reader"
        stream = "" if self.kind == "grpc" else ("-stream" if self.stream else "-whole")
        return f"{self.kind}{stream}"


def make_prompts(count: int, seed: int, long_share: float = 0.2, max_words: int = 60) -> list[str]:
    """`count` deterministic text prompts: mostly 3-20 words, some 45-60 (several KV blocks, ~200 tokens with
    the tiny model's tokenizer, whose model takes 256 in all); every fourth starts with the previous one's
    first 10 words (prefix cache hits)."""
    rng = random.Random(seed)
    prompts: list[str] = []
    for i in range(count):
        words = rng.randrange(45, max_words + 1) if rng.random() < long_share else rng.randrange(3, 21)
        picked = [rng.choice(_WORDS) for _ in range(words)]
        if i % 4 == 3 and prompts:  # a shared prefix with the previous prompt
            picked = (prompts[-1].split()[:10] + picked)[:max_words]
        prompts.append(" ".join(picked))
    return prompts


def parse_kinds(text: str) -> tuple[tuple[str, float], ...]:
    """'grpc:4,chat:3,completion:3' -> ((kind, weight), ...); a kind left out gets 0."""
    out = []
    for part in text.split(","):
        name, _, weight = part.partition(":")
        name = name.strip()
        if name not in KINDS + ROUTED_KINDS:
            raise ValueError(f"unknown request kind {name!r} (known: {', '.join(KINDS + ROUTED_KINDS)})")
        out.append((name, float(weight or 1)))
    if sum(w for _, w in out) <= 0:
        raise ValueError("the request mix has no positive weight")
    return tuple(out)


def choose(n: int, rng: random.Random, mix: Mix, prompts: int, adapters: tuple[str, ...],
           max_tokens: int) -> Spec:
    """Request n of the mix, drawn from rng."""
    if mix.slow_share and rng.random() < mix.slow_share:  # greedy, the base model, never cancelled
        return Spec(n=n, kind=rng.choice(("grpc", "chat")), stream=True, prompt=rng.randrange(prompts), adapter="",
                    seeded=False, route=rng.choice(mix.routes) if mix.routes else "", slow=True)
    kind = rng.choices([k for k, _ in mix.kinds], [w for _, w in mix.kinds])[0]
    stream = kind == "grpc" or rng.random() < mix.stream_share
    routed = kind in ROUTED_KINDS
    adapter = rng.choice(adapters) if adapters and not routed and rng.random() < mix.adapter_share else ""
    seeded = rng.random() < mix.seeded_share
    cancel_after, delay = None, 0.0
    if rng.random() < mix.cancel_share:
        # A non-streaming HTTP request can only be hung up on after a delay; a stream also after k messages.
        cancel_after = rng.randrange(0, max_tokens) if stream else 0
        delay = rng.uniform(0.0, 0.5) if cancel_after == 0 else 0.0
    route = kind.split("-")[0] if routed else (rng.choice(mix.routes) if mix.routes else "")
    return Spec(n=n, kind=kind, stream=stream, prompt=rng.randrange(prompts), adapter=adapter, seeded=seeded,
                cancel_after=cancel_after, cancel_delay_s=delay, route=route)


def reference_specs(prompts: int, adapters: tuple[str, ...], mix: Mix) -> list[Spec]:
    """One plain request per reference key the mix can draw (kinds with weight, seeded only if drawn)."""
    kinds = [k for k, w in mix.kinds if w > 0]
    seeded = (False, True) if mix.seeded_share > 0 else (False,)
    return [Spec(n=-1, kind=k, stream=False, prompt=p, adapter=a, seeded=s,
                 route=k.split("-")[0] if k in ROUTED_KINDS else (mix.routes[0] if mix.routes else ""))
            for k in kinds for p in range(prompts) for a in (("",) if k in ROUTED_KINDS else ("", *adapters))
            for s in seeded]
