"""The long soak (scripts/soak): real executor and scheduler processes under a mixed load — gRPC
Generate streams, OpenAI chat completions and completions over HTTP (streaming and not), client cancels and
disconnects, LoRA adapters loaded and unloaded, any process SIGKILLed and restarted with requests in flight —
for a given time, then a report: requests by outcome, lost requests, leaked KV blocks, errors by status, the
longest stall, RSS growth and the chaos done.

    cli.py       flags and the run, step by step (main thread: processes, chaos, progress)
    cluster.py   the processes: start, SIGKILL + restart, adapters, KV at the end, RSS from /proc
    workload.py  prompts, the request mix, the clean run's references
    attempts.py  one gRPC or HTTP attempt, timed token by token
    clients.py   the client thread: workers, retries after UNAVAILABLE
    verdict.py   each request's outcome, stalls outside outages, the pass criteria
    report.py    the table and the JSON
"""
