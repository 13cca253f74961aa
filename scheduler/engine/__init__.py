"""The continuous-batching engine: loop, policy, planner, executor calls and codec, bursts, speculation, recovery."""
