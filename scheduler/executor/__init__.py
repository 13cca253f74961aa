"""The scheduler's view of one executor: the client, its info, the session, what a failed call means."""
