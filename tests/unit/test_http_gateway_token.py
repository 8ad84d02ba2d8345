"""The Kernel Gateway API's token file (services/http_gateway/app.py)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from services.http_gateway.app import load_or_create_token
from services.http_gateway.token_file import token_path
from shared.config import load_config


def test_a_missing_token_file_is_made_random_and_private_then_reused(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "http.token"
    first = load_or_create_token(path)
    assert len(first) >= 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_token(path) == first  # a remote Lab configured with it keeps working
    assert load_or_create_token(tmp_path / "other.token") != first


def test_an_empty_token_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "http.token"
    path.write_text("\n")
    path.chmod(0o600)
    with pytest.raises(ValueError, match="is empty"):
        load_or_create_token(path)


def test_the_token_lives_in_the_keys_dir_unless_a_file_is_named(tmp_path: Path) -> None:
    assert token_path(load_config(), tmp_path) == tmp_path / "http.token"
    named = load_config(overrides={"http.token_file": str(tmp_path / "t")})
    assert token_path(named, tmp_path / "keys") == tmp_path / "t"
