"""One capability vocabulary (tandem/capabilities.py), checked from both sides: every name an executor can list
in GetInfoResponse.capabilities is one of it, every name the scheduler checks for is one of it (and one the
executor can list), every name of it is one the executor can list, and outside it the names are spelled only
through its constants. Read from the source (what the code can produce or compare against, whatever the
configuration) and from running executors (what is really advertised). A misspelled name on either side
would otherwise read as "not supported" and silently turn a feature off. Control cases show the checks fail.
"""
from __future__ import annotations

import ast
import importlib
import types

import pytest

from tandem import capabilities as caps
from tandem.executor.v1 import executor_pb2 as pb
from tests.conftest import ROOT
from tests.grpc_harness import start_executor


Use = tuple[int, str, bool]  # (line, capability name, spelled here as a string literal rather than a name)


def _resolve(node: ast.expr, module: types.ModuleType) -> tuple[str, ...]:
    """The capability names a name or `module.NAME` stands for in `module` (a tuple constant gives each)."""
    if isinstance(node, ast.Name):
        value = vars(module).get(node.id)
    elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        base = vars(module).get(node.value.id)
        value = getattr(base, node.attr, None) if isinstance(base, types.ModuleType) else None
    else:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (tuple, list, set, frozenset)) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    return ()


def _names_in(expr: ast.AST, module: types.ModuleType) -> list[Use]:
    out: list[Use] = []
    for node in ast.walk(expr):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append((node.lineno, node.value, True))
        else:
            out.extend((getattr(node, "lineno", 0), name, False) for name in _resolve(node, module))
    return out


def _returned(fn: ast.FunctionDef) -> list[ast.expr]:
    return [node.value for node in ast.walk(fn) if isinstance(node, ast.Return) and node.value is not None]


def scheduler_checks(tree: ast.Module) -> list[ast.expr]:
    """What is compared against a capability set (`NAME in info.capabilities`), and what functions named
    for capabilities return (codec.capabilities_needed: the names a request needs)."""
    exprs: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any("capabilities" in ast.unparse(c) for c in node.comparators):
            exprs.append(node.left)
        elif isinstance(node, ast.FunctionDef) and "capabilities" in node.name:
            exprs += _returned(node)
    return exprs


def executor_produces(tree: ast.Module) -> list[ast.expr]:
    """What is put into a capability list: `capabilities=...` arguments (ExecutorInfo) and what functions
    named `capabilities` return (ModelStack.capabilities)."""
    exprs: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "capabilities":
            exprs.append(node.value)
        elif isinstance(node, ast.FunctionDef) and node.name == "capabilities":
            exprs += _returned(node)
    return exprs


def uses(tree: ast.Module, module: types.ModuleType, finder) -> list[Use]:
    return sorted(use for expr in finder(tree) for use in _names_in(expr, module))


def own_constants(tree: ast.Module) -> list[Use]:
    """Module-level `NAME = "<a capability name>"`: a second spelling of the vocabulary."""
    return [(node.lineno, node.value.value, True) for node in tree.body
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant)
            and node.value.value in caps.ALL]


def _scan(package: str, finder) -> dict[str, list[Use]]:
    """path -> the uses `finder` sees in each module of package that has any (the module is imported to
    resolve the names it uses)."""
    found: dict[str, list[Use]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if not finder(tree):
            continue
        rel = path.relative_to(ROOT)
        parts = rel.with_suffix("").parts
        module = importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        if found_here := uses(tree, module, finder):
            found[str(rel)] = found_here
    return found


def _values(found: dict[str, list[Use]]) -> set[str]:
    return {name for found_here in found.values() for _, name, _ in found_here}


def _unknown(found: dict[str, list[Use]]) -> list[str]:
    return sorted(f"{path}:{line}: {name!r}" for path, found_here in found.items() for line, name, _ in found_here
                  if name not in caps.ALL)


@pytest.fixture(scope="module")
def produced() -> dict[str, list[Use]]:
    return _scan("executor_service", executor_produces)


@pytest.fixture(scope="module")
def checked() -> dict[str, list[Use]]:
    return _scan("scheduler", scheduler_checks)


def test_the_executor_lists_only_names_of_the_vocabulary(produced):
    assert len(_values(produced)) >= 20, produced  # the scan found the executor's lists
    assert not _unknown(produced)


def test_every_name_of_the_vocabulary_is_one_the_executor_can_list(produced):
    assert not caps.ALL - _values(produced), "in tandem/capabilities.py but never listed by the executor"


def test_the_scheduler_checks_only_names_the_executor_can_list(checked, produced):
    # The names the scheduler is known to rely on (a scan that found fewer has lost its way).
    assert {caps.TOKEN_MASKS, caps.PROMPT_LOGPROBS, caps.PREFIX_CACHING, caps.MULTI_STEP_DECODE,
            caps.MULTI_STEP_DRAFTS, caps.KV_TRANSFER, caps.DETERMINISTIC} <= _values(checked), checked
    assert not _unknown(checked)
    assert not _values(checked) - _values(produced), "the scheduler waits for a name no executor lists"


def test_names_are_spelled_only_in_the_vocabulary(checked, produced):
    spelled: dict[str, set[str]] = {}
    for found in (checked, produced):
        for path, found_here in found.items():
            spelled.setdefault(path, set()).update(name for _, name, literal in found_here
                                                   if literal and name in caps.ALL)
    for package in ("scheduler", "executor_service"):
        for path in (ROOT / package).rglob("*.py"):
            if own := own_constants(ast.parse(path.read_text(encoding="utf-8"))):
                spelled.setdefault(str(path.relative_to(ROOT)), set()).update(name for _, name, _ in own)
    spelled = {path: names for path, names in spelled.items() if names}
    assert spelled == {}, "spell capability names as tandem.capabilities' constants"


CONFIGURATIONS = {"default": (), "torch-step-no-prefix-caching": ("--decode-kernel", "torch", "--no-prefix-caching")}


@pytest.mark.parametrize("config", CONFIGURATIONS)
def test_running_executors_advertise_only_names_of_the_vocabulary(model_dir, config):
    from executor_service.executor import CAPABILITIES

    with start_executor(model_dir, "--kv-blocks", "64", *CONFIGURATIONS[config]) as server:
        advertised = set(server.stub.GetInfo(pb.GetInfoRequest()).capabilities)
    assert advertised - caps.ALL == set()
    assert set(CAPABILITIES) <= advertised
    assert (caps.PREFIX_CACHING in advertised) == ("--no-prefix-caching" not in CONFIGURATIONS[config])


# ------------------------------------------------------------------ control cases: the checks can fail

SCHEDULER_LIKE = '''
from tandem.capabilities import MULTI_STEP_DECODE
SPECULATIVE = "speculative_draft"
LOCAL = "kv_transfer"
def steps(info):
    return MULTI_STEP_DECODE in info.capabilities and SPECULATIVE in info.capabilities \\
        and "kv_transfers" not in info.capabilities and LOCAL in info.capabilities
'''

EXECUTOR_LIKE = '''
from tandem import capabilities as caps
class Stack:
    def capabilities(self):
        return (caps.PAGED_KV, "cuda_graph")
def info(stack):
    return dict(capabilities=(caps.LORA,) + stack.capabilities())
'''


def _fake(source: str) -> tuple[ast.Module, types.ModuleType]:
    module = types.ModuleType("fake")
    exec(compile(source, "fake", "exec"), vars(module))
    return ast.parse(source), module


def test_the_checks_catch_misspelled_and_locally_spelled_names():
    tree, module = _fake(SCHEDULER_LIKE)
    found = {"fake": uses(tree, module, scheduler_checks)}
    assert _values(found) == {"multi_step_decode", "speculative_draft", "kv_transfers", "kv_transfer"}
    assert _unknown(found) == ["fake:6: 'speculative_draft'", "fake:7: 'kv_transfers'"]
    assert [name for _, name, _ in own_constants(tree)] == ["kv_transfer"]  # LOCAL: a second spelling
    tree, module = _fake(EXECUTOR_LIKE)
    found = {"fake": uses(tree, module, executor_produces)}
    assert _unknown(found) == ["fake:5: 'cuda_graph'"]
    assert {(name, literal) for _, name, literal in found["fake"]} == {("paged_kv", False), ("lora", False),
                                                                       ("cuda_graph", True)}
