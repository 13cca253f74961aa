"""The continuous-batching engine: loop, policy, planner, bursts, speculation, recovery, step answers."""
