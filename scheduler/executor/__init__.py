"""The scheduler's view of one executor: the client, the executor.v1 codec, info, session, failure rules."""
