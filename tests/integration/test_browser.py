"""Tandem in a real browser: headless Chromium (Debian's, driven by Playwright) against the test
session's cluster.

- The operator's dashboard (#20): it loads with the API token and shows the cluster's hosts and a
  running kernel, a cordon made from the page reaches the scheduler, and the same action without
  the token is refused.
- JupyterLab served with ``--gateway-url`` at Tandem (#19), with Tandem's kernel WebSocket
  connection (``services/http_gateway/front_end.py``: without it Chromium gets no kernel through
  any gateway): a notebook opened, an ipywidgets slider rendered and moved after an executor
  change, its new value read in the next cell.

Each test saves a screenshot under its temporary directory (the path is printed). Chromium is
Debian's (``make test-deps`` installs it as root); without it, and without root to install it,
the tests are skipped with a reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import nbformat
import pytest
import requests
from _cluster import ROOT, ClusterHandle
from _front_end import gateway_front_end
from _websocket_client import WebSocketKernelClient

from services.http_gateway import V1_GATEWAY_CONNECTION
from shared import messages

pytestmark = pytest.mark.integration

CHROMIUM = Path(os.environ.get("TANDEM_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_PACKAGES = ("chromium", "chromium-driver")
# what works on a closed network: no GPU, no QUIC, none of Chrome's background fetches
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",  # CI runs as root, where Chromium's sandbox refuses to start
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
LAB_TOKEN = "lab-token"
T = TypeVar("T")
STEP_MS = 30_000  # the longest one browser step may wait (a kernel's start under load)


def _chromium() -> Path:
    """Debian's Chromium, installed now when missing and this runs as root (as in CI)."""
    if CHROMIUM.exists():
        return CHROMIUM
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=300)
        subprocess.run(
            ["apt-get", "install", "-y", "--no-install-recommends", *CHROMIUM_PACKAGES],
            env=env, capture_output=True, timeout=600,
        )  # fmt: skip
    if not CHROMIUM.exists():
        pytest.skip(
            f"no Chromium at {CHROMIUM}: install Debian's (apt-get install -y {' '.join(CHROMIUM_PACKAGES)}, "
            "which `make test-deps` does as root) or point TANDEM_CHROMIUM at one"
        )
    return CHROMIUM


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One headless Chromium for the module, with a fresh profile."""
    executable = _chromium()
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),
            executable_path=str(executable),
            args=CHROMIUM_FLAGS,
            headless=True,
            viewport={"width": 1400, "height": 1000},
        )
        context.set_default_timeout(STEP_MS)
        try:
            yield context
        finally:
            context.close()


@pytest.fixture(scope="module")
def api(tandem_cluster: ClusterHandle) -> tuple[str, str]:
    """The cluster's Kernel Gateway API: its URL and token."""
    url = tandem_cluster.info.get("http")
    assert url, f"tandem up published no HTTP API: {tandem_cluster.info}"
    return str(url), (tandem_cluster.state_dir / "keys" / "http.token").read_text().strip()


def off_loop(call: Callable[[], T]) -> T:
    """``call`` in another thread: Playwright's sync API keeps an asyncio loop running in this
    one, where the cluster's synchronous RPC helpers (``asyncio.run``) cannot run."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(call).result()


@contextmanager
def only_host_open(cluster: ClusterHandle, host_id: str) -> Iterator[None]:
    """``ClusterHandle.only_host_open``, entered and left off Playwright's loop."""
    block = cluster.only_host_open(host_id)
    off_loop(block.__enter__)
    try:
        yield
    finally:
        off_loop(lambda: block.__exit__(None, None, None))


def _screenshot(page: Any, directory: Path, name: str) -> Path:
    path = directory / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


# ---- the dashboard ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def running_kernel(api: tuple[str, str]) -> Iterator[str]:
    """A kernel started through the API that has run one cell, deleted afterwards."""
    url, token = api
    headers = {"Authorization": f"token {token}"}
    started = requests.post(f"{url}/api/kernels", json={"name": "tandem"}, headers=headers, timeout=120)
    assert started.status_code == 201, started.text
    kernel_id = str(started.json()["id"])
    client = WebSocketKernelClient(url, token, kernel_id)
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        msg_id = client.execute("print(6 * 7)")
        reply = client.get_shell_msg(timeout=60)
        assert reply["parent_header"]["msg_id"] == msg_id and reply["content"]["status"] == "ok"
        yield kernel_id
    finally:
        client.stop_channels()
        requests.delete(f"{url}/api/kernels/{kernel_id}", headers=headers, timeout=60)


def test_the_dashboard_shows_hosts_and_kernels_and_cordons_a_host_only_with_the_token(
    browser: Any,
    api: tuple[str, str],
    running_kernel: str,
    tandem_cluster: ClusterHandle,
    tmp_path: Path,
) -> None:
    url, token = api
    status = off_loop(lambda: tandem_cluster.ask_scheduler(messages.CLUSTER_STATUS, {}))
    hosts = [h["id"] for h in status["hosts"]]
    target = hosts[-1]
    page = browser.new_page()
    started = time.monotonic()
    try:
        assert page.goto(f"{url}/dashboard").status == 401
        assert "needs its token" in page.content()

        assert page.goto(f"{url}/dashboard?token={token}").status == 200
        for host in hosts:
            assert page.locator(f"#host-{host} td").first.inner_text() == host
        kernel_row = page.locator(f"#kernel-{running_kernel}")
        assert kernel_row.get_attribute("data-state") == "running"
        assert kernel_row.locator("li.replica").count() == 3
        assert page.locator("#cells").inner_text().count(running_kernel[:8]) >= 1
        # live: the page refreshes itself (the "over time" samples come from those refreshes)
        first = page.locator("#updated").inner_text()
        # locator waits, not wait_for_function: the page's CSP forbids the eval that one uses
        _expect(page.locator("#updated")).not_to_have_text(first)

        page.locator(f"#host-{target} button[data-action=cordon]").click()
        _expect(page.locator("#flash")).to_have_text(f"{target}: cordoned")
        page.wait_for_selector(f"#host-{target}[data-state=cordoned]")
        assert off_loop(lambda: _cordoned(tandem_cluster, target))

        # the same action without the token, or with another one, is refused and changes nothing
        for headers in ({}, {"Authorization": "token not-the-token"}):
            refused = page.request.post(f"{url}/dashboard/hosts/{target}/uncordon", headers=headers)
            assert refused.status == 401
            assert "needs its token" in refused.json()["message"]
        assert off_loop(lambda: _cordoned(tandem_cluster, target))
        shot = _screenshot(page, tmp_path, "dashboard")

        page.locator(f"#host-{target} button[data-action=uncordon]").click()
        page.wait_for_selector(f"#host-{target}[data-state=ready]")
        assert not off_loop(lambda: _cordoned(tandem_cluster, target))
        print(f"dashboard browser steps: {time.monotonic() - started:.1f} s")
        assert shot.stat().st_size > 10_000
    finally:
        page.close()
        off_loop(lambda: tandem_cluster.cordon(target, False))


def test_a_replica_restarted_from_the_dashboard_comes_back_with_a_new_process(
    browser: Any, api: tuple[str, str], running_kernel: str, tandem_cluster: ClusterHandle
) -> None:
    url, token = api
    replicas = off_loop(lambda: _replicas(tandem_cluster, running_kernel))
    follower = next(r for r in replicas if r["role"] == "follower" and r["alive"])
    page = browser.new_page()
    page.on("dialog", lambda dialog: dialog.accept())  # "restart r2?"
    try:
        page.goto(f"{url}/dashboard?token={token}")
        row = page.locator(f"#kernel-{running_kernel} li[data-replica={follower['id']}]")
        row.locator("button[data-action=restart]").click()
        _expect(page.locator("#flash")).to_contain_text("restarted (pid", timeout=120_000)
        after = {r["id"]: r for r in off_loop(lambda: _replicas(tandem_cluster, running_kernel))}
        assert after[follower["id"]]["alive"] and after[follower["id"]]["pid"] != follower["pid"]
        assert f"{running_kernel}/{follower['id']}: restarted (pid {after[follower['id']]['pid']})" in (
            page.locator("#flash").inner_text()
        )
    finally:
        page.close()


def _expect(locator: Any) -> Any:
    """Playwright's ``expect`` (imported here: playwright is in the test extra)."""
    from playwright.sync_api import expect

    return expect(locator)


def _cordoned(cluster: ClusterHandle, host_id: str) -> bool:
    hosts = cluster.ask_scheduler(messages.CLUSTER_STATUS, {})["hosts"]
    return bool(next(h for h in hosts if h["id"] == host_id)["cordoned"])


# ---- JupyterLab ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lab(api: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    """``jupyter lab --gateway-url`` at Tandem (the app exposed to the page's scripts, kernel
    WebSockets that Chromium accepts): its URL, notebook folder and home (``server.log``)."""
    if not (ROOT / "kernel_replica" / "comm_sync.py").exists():
        pytest.skip("widgets across executor changes need the replicated comm registry (#19, comm_sync)")
    root, home = tmp_path_factory.mktemp("lab-notebooks"), tmp_path_factory.mktemp("lab-home")
    settings = {
        "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
        "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
    }
    with gateway_front_end(
        "jupyterlab", api, LAB_TOKEN, root, home,
        "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: run cells by command
        f"--ServerApp.kernel_websocket_connection_class={V1_GATEWAY_CONNECTION}",
        "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        env=settings,
    ) as url:  # fmt: skip
        yield url, root, home


def _notebook(path: Path, sources: list[str]) -> None:
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(s) for s in sources],
        metadata={
            "kernelspec": {"name": "tandem", "display_name": "Tandem (replicated)", "language": "python"}
        },
    )
    nbformat.write(nb, path)


def _run_cell(page: Any, index: int) -> None:
    """Runs the notebook's cell ``index`` as a click on Run would."""
    page.evaluate(
        """async (index) => {
            const panel = window.jupyterapp.shell.currentWidget;
            panel.content.activeCellIndex = index;
            await window.jupyterapp.commands.execute("notebook:run-cell");
        }""",
        index,
    )


def _output(page: Any, index: int) -> Any:
    return page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-OutputArea")


def test_jupyterlab_renders_a_slider_that_keeps_working_after_an_executor_change(
    browser: Any, lab: tuple[str, Path, Path], tandem_cluster: ClusterHandle, tmp_path: Path
) -> None:
    lab_url, root, home = lab
    _notebook(
        root / "widgets.ipynb",
        [
            "import ipywidgets as widgets\n"
            "slider = widgets.IntSlider(value=3, min=0, max=10, description='tandem')\n"
            "slider",
            "import os\nprint('slider at', slider.value, 'on', os.getpid())",
            "print('slider now', slider.value, 'on', os.getpid())",
        ],
    )
    page = browser.new_page()
    started = time.monotonic()
    try:
        page.goto(f"{lab_url}/lab/tree/widgets.ipynb?token={LAB_TOKEN}")
        page.wait_for_selector(".jp-Notebook .jp-Cell")
        page.wait_for_function(
            "window.jupyterapp.shell.currentWidget?.sessionContext?.session?.kernel?.status === 'idle'"
        )
        # one subprotocol on both legs: Chromium's handshake with Lab, Lab's with Tandem
        assert "(v1.kernel.websocket.jupyter.org protocol)" in (home / "server.log").read_text()
        kernel_id = page.evaluate("window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.id")

        _run_cell(page, 0)
        slider = _output(page, 0).locator(".widget-slider")
        slider.wait_for()
        assert "3" in _output(page, 0).locator(".widget-readout").inner_text()
        _run_cell(page, 1)
        _output(page, 1).get_by_text("slider at 3").wait_for()
        first_executor = off_loop(lambda: _executor_host(tandem_cluster, kernel_id))

        # every host but another one cordoned: the next cell runs on another replica
        replicas = off_loop(lambda: _replicas(tandem_cluster, kernel_id))
        other = next(r["host"] for r in replicas if r["host"] != first_executor)
        with only_host_open(tandem_cluster, other):
            _run_cell(page, 1)
            page.wait_for_function(
                "document.querySelectorAll('.jp-Notebook .jp-Cell')[1].innerText.includes('slider at 3')"
                " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle'"
            )
            assert off_loop(lambda: _executor_host(tandem_cluster, kernel_id)) == other

            # the slider moved in the page by one step (one comm message: ipywidgets holds back
            # further changes while one is unanswered, as a user's pause before the next cell
            # would let them go); it reaches the executor now, before the next cell
            handle = _output(page, 0).locator(".noUi-handle")
            handle.focus()
            handle.press("ArrowRight")
            assert _output(page, 0).locator(".widget-readout").inner_text().strip() == "4"
            _run_cell(page, 2)
            _output(page, 2).get_by_text("slider now").wait_for()
            assert "slider now 4" in _output(page, 2).inner_text()
        _screenshot(page, tmp_path, "jupyterlab-widgets")
        print(f"jupyterlab browser steps: {time.monotonic() - started:.1f} s")
    finally:
        page.close()


def _replicas(cluster: ClusterHandle, kernel_id: str) -> list[dict[str, Any]]:
    return list(cluster.ask_scheduler(messages.KERNEL_STATUS, {"kernel_id": kernel_id})["replicas"])


def _executor_host(cluster: ClusterHandle, kernel_id: str) -> str:
    status = cluster.ask_scheduler(messages.KERNEL_STATUS, {"kernel_id": kernel_id})
    executor = status.get("last_executor")
    return next(str(r["host"]) for r in status["replicas"] if r["id"] == executor)
