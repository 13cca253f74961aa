"""tandem.security.tokens and auth: the token file's format, its reload on change (a broken file keeps the
tokens before), the scopes, and the messages (never the token)."""
from __future__ import annotations

import os

import pytest

from tandem.errors import PermissionDenied, Unauthenticated
from tandem.security.auth import Authenticator, bearer
from tandem.security.tokens import ClientToken, Scope, TokenFile, TokenFileError, fingerprint, parse_tokens

A, B, C = "a" * 16 + "-admin", "b" * 16 + "-user", "c" * 24


def test_format_scopes_comments_and_blank_lines():
    parsed = parse_tokens(f"# tokens\n\n{A} admin\n  {B}   # alice\n{C} USER\n")
    assert [(t.decode(), p.scope) for t, p in parsed] == [(A, Scope.ADMIN), (B, Scope.USER), (C, Scope.USER)]
    assert parsed[0][1].fingerprint == fingerprint(A) and len(fingerprint(A)) == 12 and A not in str(parsed[0][1])


@pytest.mark.parametrize("text, says", [
    (f"{A} root\n", "line 1: unknown scope 'root'"),
    (f"# x\n{A} admin extra\n", "line 2: want `TOKEN [user|admin]`"),
    ("short admin\n", "line 1: a token must be at least 16"),
    (f"{A}\n{A} admin\n", "line 2: this token is already on an earlier line"),
])
def test_bad_lines_are_refused_naming_the_line_not_the_token(text, says):
    with pytest.raises(TokenFileError) as err:
        parse_tokens(text)
    assert says in str(err.value) and A not in str(err.value)


def _write(path, text: str, bump: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(bump, bump))  # a distinct mtime, whatever the file system's clock granularity


def test_file_is_reread_on_change_and_a_broken_one_keeps_the_tokens_before(tmp_path):
    path = tmp_path / "tokens"
    _write(path, f"{A} admin\n{B}\n", 1_000_000_000)
    tokens = TokenFile(path, interval_s=0)
    assert tokens.lookup(A).scope is Scope.ADMIN and tokens.lookup(B).scope is Scope.USER
    assert tokens.lookup(C) is None and tokens.lookup("") is None and tokens.summary() == "2 tokens, 1 admin"
    _write(path, f"{C}\n", 2_000_000_000)  # B and A revoked, C added
    assert tokens.lookup(C).scope is Scope.USER and tokens.lookup(A) is None
    _write(path, f"{A} superuser\n", 3_000_000_000)  # broken: C stays in force
    assert tokens.lookup(C) is not None and tokens.lookup(A) is None


def test_a_file_without_tokens_is_refused_at_startup(tmp_path):
    (tmp_path / "empty").write_text("# nobody\n\n")
    with pytest.raises(TokenFileError, match="holds no token"):
        TokenFile(tmp_path / "empty")
    with pytest.raises(TokenFileError, match="--auth-token-file: cannot read"):
        TokenFile(tmp_path / "missing")


def test_client_token_sends_the_first_token_and_follows_the_file(tmp_path):
    path = tmp_path / "token"
    _write(path, f"# the scheduler's\n{A} admin\n{B}\n", 1_000_000_000)
    client = ClientToken(path, interval_s=0)
    assert client.metadata() == (("authorization", f"Bearer {A}"),)
    _write(path, f"{C}\n", 2_000_000_000)
    assert client.metadata() == (("authorization", f"Bearer {C}"),)


def test_bearer_header_parsing():
    assert bearer(f"Bearer {A}") == A and bearer(f"bearer  {A} ") == A and bearer(f"Bearer {A}".encode()) == A
    assert bearer(A) is None and bearer("Basic xyz") is None and bearer("Bearer ") is None and bearer(None) is None


def test_authenticator_scopes(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"{A} admin\n{B}\n")
    auth = Authenticator(TokenFile(path))
    assert auth.check(f"Bearer {B}", Scope.USER, "Generate").scope is Scope.USER
    assert auth.check(f"Bearer {A}", Scope.ADMIN, "LoadAdapter").scope is Scope.ADMIN
    with pytest.raises(PermissionDenied, match="LoadAdapter needs a token with scope admin; this token has scope "
                                               "user"):
        auth.check(f"Bearer {B}", Scope.ADMIN, "LoadAdapter")
    for header in (None, f"Bearer {C}", B):
        with pytest.raises(Unauthenticated) as err:
            auth.check(header, Scope.USER, "Generate")
        assert B not in str(err.value) and C not in str(err.value)
    assert Authenticator(None).check(None, Scope.ADMIN, "LoadAdapter") is None  # tokens off: everyone
