"""The kernel's launch environment (shared/kernel_launch.py): what a client's cwd/env becomes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.kernel_launch import KernelLaunch, LaunchError, from_client

CLIENT_ENV = {"PATH": "/usr/bin", "HOME": "/home/me", "SECRET_TOKEN": "x", "KERNEL_USERNAME": "me"}


def test_client_variables_travel_only_when_set_for_the_kernel_or_named_kernel() -> None:
    env = {**CLIENT_ENV, "KERNEL_FOO": "bar", "MY_SETTING": "1", "JPY_SESSION_NAME": "n", "PYTHONPATH": "/x"}
    launch = from_client(env, None, CLIENT_ENV, "/home/me")
    assert launch.env == {"KERNEL_FOO": "bar", "KERNEL_USERNAME": "me", "MY_SETTING": "1"}


def test_an_explicit_cwd_is_required_and_made_absolute_against_the_client() -> None:
    launch = from_client({}, "data/run", CLIENT_ENV, "/home/me")
    assert (launch.cwd, launch.cwd_required) == ("/home/me/data/run", True)


def test_kernel_working_dir_is_mirrored_where_no_cwd_is_given() -> None:
    launch = from_client({"KERNEL_WORKING_DIR": "/srv/nb"}, None, {}, "/home/me")
    assert (launch.cwd, launch.cwd_required) == ("/srv/nb", False)
    assert from_client({}, None, {}, "/home/me").cwd == "/home/me"


def test_a_missing_required_directory_fails_and_a_mirrored_one_falls_back(tmp_path: Path) -> None:
    missing = str(tmp_path / "absent")
    with pytest.raises(LaunchError, match="does not exist"):
        KernelLaunch(missing, True).directory_on_this_host()
    directory, warning = KernelLaunch(missing, False).directory_on_this_host()
    assert directory is None and warning is not None and missing in warning
    assert KernelLaunch(str(tmp_path), True).directory_on_this_host() == (str(tmp_path), None)


@pytest.mark.parametrize(
    "raw",
    [
        {"cwd": "relative/dir"},
        {"cwd_required": "yes"},
        {"env": {"TANDEM_HOST_ID": "h"}},
        {"env": {"PYTHONPATH": "/x"}},
        {"env": {"1BAD": "x"}},
        {"env": {"A": 1}},
        {"env": {"A": "x" * (65 * 1024)}},
        ["not", "a", "map"],
    ],
)
def test_unusable_launch_fields_are_refused_with_their_name(raw: object) -> None:
    with pytest.raises(LaunchError, match="launch"):
        KernelLaunch.from_wire(raw)


names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True).filter(
    lambda n: not n.startswith(("TANDEM_", "JPY_")) and n not in {"PYTHONPATH", "PYTHONHOME"}
)


@given(
    cwd=st.one_of(st.just(""), st.builds(lambda p: os.path.join("/", p), st.text("abc/_-", max_size=20))),
    required=st.booleans(),
    env=st.dictionaries(names, st.text(max_size=30).filter(lambda v: "\0" not in v), max_size=8),
)
def test_the_wire_form_round_trips(cwd: str, required: bool, env: dict[str, str]) -> None:
    launch = KernelLaunch(cwd, required and bool(cwd), env)
    assert KernelLaunch.from_wire(launch.to_wire()) == launch
