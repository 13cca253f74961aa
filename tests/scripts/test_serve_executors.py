"""scripts/serve.py --executors N: the command lines of N executors and of the one scheduler over them
(scripts/serve_processes.py's pure functions), checked against the servers' real CLIs. No process starts.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli_parsers import cli_parser, known_flags
from tests.conftest import load_script

procs = load_script("serve_processes")
serve = load_script("serve")
MODEL = Path("/models/tiny")


def _flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_executor_ports_are_consecutive_and_skip_the_schedulers():
    assert procs.executor_ports(50051, 1, avoid=50052) == [50051]
    assert procs.executor_ports(50051, 3, avoid=50052) == [50051, 50053, 50054]  # the defaults
    assert procs.executor_ports(6000, 2, avoid=50052) == [6000, 6001]
    assert procs.executor_ports(0, 3, avoid=50052) == [0, 0, 0]  # each picks a free port
    with pytest.raises(ValueError):
        procs.executor_ports(50051, 0, avoid=50052)
    with pytest.raises(ValueError):
        procs.executor_ports(65535, 2, avoid=50052)


def test_one_executor_keeps_todays_command_line():
    (argv,) = procs.executor_argvs(MODEL, "127.0.0.1", [50051], ["--kv-blocks", "512"], cores=8)
    assert argv == ["--model", str(MODEL), "--host", "127.0.0.1", "--port", "50051", "--kv-blocks", "512"]


@pytest.mark.parametrize("cores, count, threads", [(8, 2, 4), (8, 3, 2), (2, 2, 1), (3, 4, 1), (16, 4, 4)])
def test_several_executors_share_the_cores(cores, count, threads):
    ports = procs.executor_ports(50051, count, avoid=50052)
    argvs = procs.executor_argvs(MODEL, "127.0.0.1", ports, [], cores=cores)
    assert len(argvs) == count
    assert [_flag_values(a, "--port") for a in argvs] == [[str(p)] for p in ports]
    for argv in argvs:
        assert _flag_values(argv, "--threads") == [str(threads)]
        assert _flag_values(argv, "--model") == [str(MODEL)]


@pytest.mark.parametrize("extra", [["--threads", "3"], ["--threads=3"]])
def test_threads_given_by_the_user_win(extra):
    for argv in procs.executor_argvs(MODEL, "127.0.0.1", [50051, 50053], extra, cores=8):
        assert argv.count("--threads") + sum(a.startswith("--threads=") for a in argv) == 1
        assert argv[-len(extra):] == extra


def test_executor_index_fills_in_the_extra_flags():
    argvs = procs.executor_argvs(MODEL, "127.0.0.1", [50051, 50053], ["--device", "cuda:{i}"], cores=8)
    assert [_flag_values(a, "--device") for a in argvs] == [["cuda:0"], ["cuda:1"]]


def test_scheduler_gets_every_executor_in_order():
    argv = procs.scheduler_argv(["127.0.0.1:50051", "127.0.0.1:50053"], "127.0.0.1", 50052, ["--max-running", "8"])
    assert _flag_values(argv, "--executor") == ["127.0.0.1:50051", "127.0.0.1:50053"]
    assert _flag_values(argv, "--port") == ["50052"] and _flag_values(argv, "--host") == ["127.0.0.1"]
    assert argv[-2:] == ["--max-running", "8"]
    with pytest.raises(ValueError):
        procs.scheduler_argv([], "127.0.0.1", 50052, [])


def test_the_command_lines_parse_in_the_servers_own_clis():
    executor_cli, scheduler_cli = cli_parser("executor_service"), cli_parser("scheduler")
    for argv in procs.executor_argvs(MODEL, "127.0.0.1", [50051, 50053], ["--kv-blocks", "64"], cores=4):
        args = executor_cli.parse_args(argv)
        assert (args.threads, args.kv_blocks, args.model) == (2, 64, MODEL)
    argv = procs.scheduler_argv(["127.0.0.1:50051", "127.0.0.1:50053"], "127.0.0.1", 50052, ["--grace", "5"])
    # --executor is becoming repeatable in the scheduler; until then only its name can be checked.
    assert "--executor" in known_flags(scheduler_cli)
    assert {a.split("=")[0] for a in argv if a.startswith("--")} <= known_flags(scheduler_cli)


def test_names_of_executors_and_their_logs():
    assert procs.executor_names(1) == ["executor"]  # executor.log, as before
    assert procs.executor_names(3) == ["executor-0", "executor-1", "executor-2"]


def test_the_flag_is_in_serves_cli(capsys):
    assert serve.parse_args(["--model", str(MODEL)]).executors == 1
    assert serve.parse_args(["--model", str(MODEL), "--executors", "3"]).executors == 3
    with pytest.raises(SystemExit):
        serve.parse_args(["--model", str(MODEL), "--executors", "0"])
    with pytest.raises(SystemExit):
        serve.parse_args(["--help"])
    assert "--executors N" in capsys.readouterr().out


def test_the_http_port_reaches_the_scheduler():
    assert serve.parse_args(["--model", str(MODEL)]).http_port == 8000  # the OpenAI-compatible API, on by default
    argv = procs.scheduler_argv(["127.0.0.1:50051"], "127.0.0.1", 50052, ["--grace", "5"], http_port=8000)
    assert cli_parser("scheduler").parse_args(argv).http_port == 8000
    assert "--http-port" not in procs.scheduler_argv(["127.0.0.1:50051"], "127.0.0.1", 50052, [])  # -1: off
    assert cli_parser("scheduler").parse_args(["--executor", "x:1"]).http_port is None
    assert serve.curl_hint("http://127.0.0.1:8000").startswith("curl http://127.0.0.1:8000/v1/chat/completions ")
