"""What a notebook holds besides plain variables keeps working across executor changes.

Widgets: the comm registry and the widget models are replicated, and the front end's comm
messages reach whichever replica executes now. Unpicklable objects: named when made and when the
executor moves, and ``%tandem pin`` keeps the cells where they live.

A real ``ipywidgets.IntSlider`` is made on one replica; the next cell is forced onto another
(every other host cordoned). The test then does what JupyterLab does when the user drags the
slider: a ``comm_msg`` ``update`` on the shell channel. The new executor must hold the comm (it
echoes the update, and lists it in ``comm_info_reply``), the value must be 7 in the next cell
there and on the first replica too (the update, handled between cells, was replicated), and a
cell that sets the value on the first replica again must send the front end its update.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _cluster import ClusterHandle, eventually
from _kernels import CellResult, run, tandem_kernel
from _signals import signal_ours
from jupyter_client import BlockingKernelClient

from shared import messages
from shared.election_round import split_election_key

pytestmark = pytest.mark.integration


def _replica_hosts(cluster: ClusterHandle, kernel_id: str) -> list[str]:
    deadline = time.monotonic() + 30
    while True:
        status = cluster.ask_scheduler(messages.CLUSTER_STATUS, {})
        kernel = next(k for k in status["kernels"] if k["id"] == kernel_id)
        hosts = sorted({r["host"] for r in kernel["replicas"] if r.get("host")})
        if len(hosts) >= 2 or time.monotonic() > deadline:
            return hosts
        time.sleep(0.2)


@pytest.fixture(scope="module")
def kernel(tandem_cluster: ClusterHandle) -> Iterator[tuple[BlockingKernelClient, list[str], str]]:
    """One kernel for the module, the hosts of its replicas (two at least), and its id."""
    with tandem_kernel() as (km, kc):
        hosts = _replica_hosts(tandem_cluster, km.kernel_id)
        assert len(hosts) >= 2, f"replicas on {hosts}: an executor change needs two hosts"
        yield kc, hosts, km.kernel_id


def _on(cluster: ClusterHandle, kc: BlockingKernelClient, host: str, code: str) -> CellResult:
    with cluster.only_host_open(host):
        result = run(kc, code, timeout=60)
    assert result.status == "ok", (code, result.errors)
    assert result.tandem.get("host_id") == host, (code, result.tandem, host)
    return result


def _read_on(
    cluster: ClusterHandle, kc: BlockingKernelClient, host: str, code: str, attempts: int = 3
) -> CellResult:
    """``_on`` for a cell that changes nothing, sent again while it lands elsewhere: a standby
    still reading a large image on a loaded machine can miss the election's silence window, and
    then a stand-in on a cordoned host runs the cell (a cell is never blocked; that is right)."""
    for _ in range(attempts - 1):
        with cluster.only_host_open(host):
            result = run(kc, code, timeout=60)
        assert result.status == "ok", (code, result.errors)
        if result.tandem.get("host_id") == host:
            return result
    return _on(cluster, kc, host, code)


def _iopub_until_idle(
    kc: BlockingKernelClient, parent_id: str, timeout: float = 20.0
) -> list[dict[str, Any]]:
    """The IOPub messages of request ``parent_id`` up to its idle."""
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=max(0.05, deadline - time.monotonic()))
        except Exception:
            break
        if msg.get("parent_header", {}).get("msg_id") != parent_id:
            continue
        seen.append(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return seen
    raise AssertionError(f"no idle for {parent_id}: {[m['msg_type'] for m in seen]}")


def test_slider_moved_after_an_executor_change_reaches_the_new_executor_and_is_replicated(
    tandem_cluster: ClusterHandle, kernel: tuple[BlockingKernelClient, list[str], str]
) -> None:
    kc, hosts, _ = kernel
    first, second = hosts[0], hosts[1]
    made = _on(
        tandem_cluster,
        kc,
        first,
        "import ipywidgets as widgets\nslider = widgets.IntSlider(value=3, max=10)\nprint(slider.model_id)",
    )
    model_id = made.stdout.strip()
    assert _on(tandem_cluster, kc, second, "print(slider.value, slider.model_id)").stdout.split() == [
        "3",
        model_id,
    ]

    # the user drags the slider to 7: JupyterLab's comm_msg, routed to the new executor
    drag = kc.session.msg(
        "comm_msg",
        {"comm_id": model_id, "data": {"method": "update", "state": {"value": 7}, "buffer_paths": []}},
    )
    kc.shell_channel.send(drag)
    echoed = [
        m["content"]["data"]
        for m in _iopub_until_idle(kc, drag["header"]["msg_id"])
        if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] == model_id
    ]
    assert echoed and echoed[0]["method"] == "echo_update" and echoed[0]["state"] == {"value": 7}

    info = kc.comm_info(target_name="jupyter.widget", reply=True, timeout=20)
    assert model_id in info["content"]["comms"], info["content"]

    assert _on(tandem_cluster, kc, second, "print(slider.value)").stdout.strip() == "7"
    # the first replica got the drag through the log, and takes the comm over as it executes
    sent: list[dict[str, Any]] = []
    with tandem_cluster.only_host_open(first):
        reply = kc.execute_interactive(
            "print(slider.value)\nslider.value = 9",
            timeout=60,
            output_hook=lambda m: sent.append(m) if m["msg_type"] in ("comm_msg", "stream") else None,
        )
    assert reply["metadata"]["tandem"]["host_id"] == first and reply["content"]["status"] == "ok"
    assert [m["content"]["text"] for m in sent if m["msg_type"] == "stream"] == ["7\n"]
    updates = [m["content"]["data"] for m in sent if m["msg_type"] == "comm_msg"]
    assert updates == [{"method": "update", "state": {"value": 9}, "buffer_paths": []}], updates
    assert _on(tandem_cluster, kc, second, "print(slider.value)").stdout.strip() == "9"

    # a reloaded JupyterLab opens the widget control comm (on the last executor), and asks for
    # every model's state after the executor moved again
    control = kc.session.msg(
        "comm_open",
        {"comm_id": "lab-control", "target_name": "jupyter.widget.control", "data": {}},
        metadata={"version": "1.0.0"},
    )
    kc.shell_channel.send(control)
    _iopub_until_idle(kc, control["header"]["msg_id"])
    _on(tandem_cluster, kc, first, "slider.description = 'moved'")
    ask = kc.session.msg("comm_msg", {"comm_id": "lab-control", "data": {"method": "request_states"}})
    kc.shell_channel.send(ask)
    replies = [
        m["content"]["data"]
        for m in _iopub_until_idle(kc, ask["header"]["msg_id"])
        if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] == "lab-control"
    ]
    assert replies and replies[0]["method"] == "update_states", replies
    assert replies[0]["states"][model_id]["state"]["value"] == 9
    assert replies[0]["states"][model_id]["state"]["description"] == "moved"


def test_tqdm_auto_bar_keeps_updating_after_an_executor_change(
    tandem_cluster: ClusterHandle, kernel: tuple[BlockingKernelClient, list[str], str]
) -> None:
    kc, hosts, _ = kernel
    _on(tandem_cluster, kc, hosts[0], "from tqdm.auto import tqdm\nbar = tqdm(total=10)\nbar.update(3)")
    sent: list[dict[str, Any]] = []
    with tandem_cluster.only_host_open(hosts[1]):
        reply = kc.execute_interactive(
            "bar.update(4)\nbar.refresh()\nprint(bar.n)",
            timeout=60,
            output_hook=lambda m: sent.append(m),
        )
    assert reply["content"]["status"] == "ok", [m["content"] for m in sent if m["msg_type"] == "error"]
    assert reply["metadata"]["tandem"]["host_id"] == hosts[1]
    assert "".join(m["content"]["text"] for m in sent if m["msg_type"] == "stream").strip().endswith("7")
    values = [
        m["content"]["data"]["state"].get("value")
        for m in sent
        if m["msg_type"] == "comm_msg" and m["content"]["data"].get("method") == "update"
    ]
    assert 7 in values, [m["content"] for m in sent]


def test_a_widget_of_a_class_the_notebook_defines_follows_the_executor(
    tandem_cluster: ClusterHandle, kernel: tuple[BlockingKernelClient, list[str], str]
) -> None:
    kc, hosts, _ = kernel
    _on(
        tandem_cluster,
        kc,
        hosts[0],
        "import ipywidgets\n\n\nclass Gauge(ipywidgets.IntText):\n    pass\n\n\ngauge = Gauge(value=5)",
    )
    moved = _on(tandem_cluster, kc, hosts[1], "print(type(gauge).__name__, gauge.value)")
    assert moved.stdout == "Gauge 5\n", moved.stdout


def test_a_button_clicked_after_an_executor_change_runs_the_notebooks_handler(
    tandem_cluster: ClusterHandle, kernel: tuple[BlockingKernelClient, list[str], str]
) -> None:
    kc, hosts, _ = kernel
    made = _on(
        tandem_cluster,
        kc,
        hosts[0],
        "import ipywidgets\nclicks = []\nbutton = ipywidgets.Button(description='go')\n"
        "button.on_click(lambda b: clicks.append(b.description))\nprint(button.model_id)",
    )
    model_id = made.stdout.strip()
    assert _on(tandem_cluster, kc, hosts[1], "print(len(clicks))").stdout == "0\n"
    click = kc.session.msg(
        "comm_msg", {"comm_id": model_id, "data": {"method": "custom", "content": {"event": "click"}}}
    )
    kc.shell_channel.send(click)
    _iopub_until_idle(kc, click["header"]["msg_id"])
    assert _on(tandem_cluster, kc, hosts[1], "print(clicks)").stdout == "['go']\n"


def test_the_working_directory_environment_and_sys_path_follow_the_executor(
    tandem_cluster: ClusterHandle, kernel: tuple[BlockingKernelClient, list[str], str], tmp_path: Any
) -> None:
    """``%cd``, ``%env`` / ``os.environ`` and ``sys.path.insert(0, "../src")`` before importing the
    notebook's own module: none of it is in the namespace, and before, the next executor ran the
    notebook's cells in another directory, without the variables, and could not replay the import."""
    kc, (first, second, *_), _ = kernel
    src = tmp_path / "src"
    src.mkdir()
    (src / "notebook_helpers.py").write_text("ANSWER = 42\n")
    data = tmp_path / "data"
    data.mkdir()
    _on(tandem_cluster, kc, first, (
        f"%cd {data}\n"
        "%env API_TOKEN=secret\n"
        "import os, sys\n"
        "from os import environ\n"
        "os.environ['NOTEBOOK_SETTING'] = 'on'\n"
        f"sys.path.insert(0, {str(src)!r})\n"
        "import notebook_helpers"
    ))  # fmt: skip
    # ``environ`` is the process's own there too, not a copy that the process ignores
    moved = _on(tandem_cluster, kc, second, (
        "import os, sys\n"
        "environ['VIA_FROM_IMPORT'] = 'yes'\n"
        "print(os.getcwd(), os.environ.get('API_TOKEN'), os.environ.get('NOTEBOOK_SETTING'),"
        f" sys.path[0] == {str(src)!r}, notebook_helpers.ANSWER, environ is os.environ,"
        " os.environ.get('VIA_FROM_IMPORT'))"
    ))  # fmt: skip
    assert moved.stdout.split() == [str(data), "secret", "on", "True", "42", "True", "yes"], moved.stdout
    _on(tandem_cluster, kc, second, "del os.environ['NOTEBOOK_SETTING']\n%cd ..")
    back = _on(
        tandem_cluster,
        kc,
        first,
        "print(os.getcwd(), os.environ.get('NOTEBOOK_SETTING'), environ['VIA_FROM_IMPORT'])",
    )
    assert back.stdout.split() == [str(tmp_path), "None", "yes"], back.stdout


def test_configuration_magics_are_replayed_on_the_next_executor(
    tandem_cluster: ClusterHandle, kernel: tuple[BlockingKernelClient, list[str], str]
) -> None:
    """``%load_ext autoreload`` / ``%autoreload 2`` at a notebook's top: before, the next executor
    had no autoreload, and silently ran the notebook's old module code after an edit."""
    kc, (first, second, *_), _ = kernel
    _on(
        tandem_cluster,
        kc,
        first,
        "%load_ext autoreload\n%autoreload 2\n%precision 3\n%alias hello echo hi-from-alias",
    )
    probe = (  # no variable left behind: the shell itself cannot be replicated (and says so)
        "def _probe(ip=get_ipython()):\n"
        "    reloader = ip.magics_manager.registry['AutoreloadMagics']._reloader\n"
        "    print('IPython.extensions.autoreload' in ip.extension_manager.loaded, reloader.enabled,"
        " reloader.check_all, ip.display_formatter.formatters['text/plain'].float_precision)\n"
        "_probe()\n"
        "del _probe"
    )
    moved = _on(tandem_cluster, kc, second, probe)
    assert moved.stdout.split() == ["True", "True", "True", "3"], moved.stdout
    assert not moved.errors
    assert _on(tandem_cluster, kc, second, "%hello").stdout.strip() == "hi-from-alias"


def test_seeded_generators_and_library_settings_follow_the_executor(
    tandem_cluster: ClusterHandle, kernel: tuple[BlockingKernelClient, list[str], str]
) -> None:
    """A notebook seeds ``random``, numpy and torch at its top and sets torch's default dtype,
    numpy's error and print options, the decimal precision, a warnings filter, the recursion limit
    and a plot style. Before, the next executor drew other numbers (its own generators), computed
    in float32, printed 8 digits, let 1/0 warn, and so on: silently, since none of it is in the
    namespace. The expected draws are those of fresh generators with the same seeds."""
    kc, (first, second, *_), _ = kernel
    _on(tandem_cluster, kc, first, (
        "import random, decimal, sys, warnings, numpy as np, torch, matplotlib\n"
        "saved_settings = (sys.getrecursionlimit(), np.geterr(), np.get_printoptions(), decimal.getcontext().prec)\n"
        "random.seed(0); np.random.seed(0); torch.manual_seed(0)\n"
        "torch.set_default_dtype(torch.float64)\n"
        "np.seterr(divide='raise'); np.set_printoptions(precision=2)\n"
        "decimal.getcontext().prec = 6; sys.setrecursionlimit(4321)\n"
        "warnings.filterwarnings('error', message='notebook says stop')\n"
        "matplotlib.rcParams['lines.linewidth'] = 7.0\n"
        "import logging, pandas as pd\n"
        "pd.set_option('display.max_columns', 3); logging.getLogger('notebook.noisy').setLevel(logging.ERROR)\n"
        "first_draws = (random.random(), float(np.random.rand()), torch.rand(1).item())\n"
        "_r, _n, _t = random.Random(0), np.random.RandomState(0), torch.Generator().manual_seed(0)\n"
        "_ = (_r.random(), _n.rand(), torch.rand(1, generator=_t))\n"
        "expected = [_r.random(), float(_n.rand()), torch.rand(1, generator=_t).item()]\n"
        "del _r, _n, _t, _"
    ))  # fmt: skip
    moved = _on(tandem_cluster, kc, second, (
        "import json\n"
        "drawn = [random.random(), float(np.random.rand()), torch.rand(1).item()]\n"
        "try:\n"
        "    np.array([1.0]) / 0\n"
        "    divide = 'warned'\n"
        "except FloatingPointError:\n"
        "    divide = 'raised'\n"
        "try:\n"
        "    warnings.warn('notebook says stop', stacklevel=1)\n"
        "    filtered = 'warned'\n"
        "except UserWarning:\n"
        "    filtered = 'raised'\n"
        "print(json.dumps([drawn == expected, str(torch.ones(1).dtype), np.array2string(np.array([1/3])),\n"
        "    divide, str(decimal.Decimal(1) / decimal.Decimal(7)), sys.getrecursionlimit(), filtered,\n"
        "    matplotlib.rcParams['lines.linewidth'], pd.get_option('display.max_columns'),\n"
        "    logging.getLogger('notebook.noisy').level,\n"
        # the GPUs' seed too, waiting for this replica's next GPU cell (no CUDA on this machine)
        "    __import__('kernel_replica.cuda_rng', fromlist=['CARRIER']).CARRIER.read(torch)]))"
    ))  # fmt: skip
    assert json.loads(moved.stdout.splitlines()[0]) == [
        True, "torch.float64", "[0.33]", "raised", "0.142857", 4321, "raised", 7.0, 3, logging.ERROR,
        ["seeds", [["all", 0]]],
    ], moved.stdout  # fmt: skip
    _on(tandem_cluster, kc, second, (  # the module's other tests share the kernel
        "torch.set_default_dtype(torch.float32); sys.setrecursionlimit(saved_settings[0])\n"
        "np.seterr(**saved_settings[1]); np.set_printoptions(**saved_settings[2]); decimal.getcontext().prec = saved_settings[3]\n"
        "warnings.filters.pop(0); matplotlib.rcdefaults(); pd.reset_option('display.max_columns'); del saved_settings"
    ))  # fmt: skip


def test_a_memmap_written_on_the_next_executor_writes_its_file(
    tandem_cluster: ClusterHandle, kernel: tuple[BlockingKernelClient, list[str], str], tmp_path: Any
) -> None:
    """``np.memmap(path, mode="w+")`` and ``np.load(..., mmap_mode="r")``: before, the next
    executor's were copies detached from their files, and ``mm[0] = 5; mm.flush()`` changed
    nothing on disk, silently."""
    kc, (first, second, *_), _ = kernel
    data, saved = tmp_path / "data.bin", tmp_path / "saved.npy"
    _on(tandem_cluster, kc, first, (
        "import numpy as np\n"
        f"np.save({str(saved)!r}, np.arange(4.0))\n"
        f"mm = np.memmap({str(data)!r}, dtype='float32', mode='w+', shape=(4,))\n"
        "mm[:] = 1\n"
        f"loaded = np.load({str(saved)!r}, mmap_mode='r')"
    ))  # fmt: skip
    moved = _on(tandem_cluster, kc, second, (
        "mm[0] = 5\nmm.flush()\n"
        f"print(np.fromfile({str(data)!r}, dtype='float32').tolist(), loaded.filename == {str(saved)!r},"
        " loaded.flags.writeable, loaded.tolist())\n"
        "del mm, loaded"
    ))  # fmt: skip
    assert moved.stdout.split("] ", 1)[0] == "[5.0, 1.0, 1.0, 1.0", moved.stdout
    assert moved.stdout.split("] ", 1)[1].strip() == "True False [0.0, 1.0, 2.0, 3.0]", moved.stdout


def test_a_tensor_on_an_arrays_memory_still_shares_it_after_two_executor_changes(
    tandem_cluster: ClusterHandle, kernel: tuple[BlockingKernelClient, list[str], str]
) -> None:
    """``torch.from_numpy(a)`` and ``t.numpy()`` share memory with no shared Python object:
    before, the next executor got two copies, and a write through one no longer showed in the
    other, silently."""
    kc, (first, second, *_), _ = kernel
    _on(tandem_cluster, kc, first, (
        "import numpy as np, torch\n"
        "arr = np.arange(6.0)\nfrom_arr = torch.from_numpy(arr[2:])\n"
        "ten = torch.arange(4.0)\nof_ten = ten.numpy()"
    ))  # fmt: skip
    moved = _on(tandem_cluster, kc, second, (
        "arr[2] = 42\nof_ten[1] = 7\nprint(from_arr[0].item(), ten[1].item())"
    ))  # fmt: skip
    assert moved.stdout == "42.0 7.0\n", moved.stdout
    back = _on(
        tandem_cluster, kc, first, "from_arr.mul_(2)\nten.add_(1)\nprint(arr.tolist(), of_ten.tolist())"
    )
    assert back.stdout == "[0.0, 1.0, 84.0, 6.0, 8.0, 10.0] [1.0, 8.0, 3.0, 4.0]\n", back.stdout


def test_globals_the_notebook_changes_in_its_own_module_follow_the_executor(
    tandem_cluster: ClusterHandle, kernel: tuple[BlockingKernelClient, list[str], str], tmp_path: Any
) -> None:
    """``import nbhelpers; nbhelpers.BATCH = 64``: before, the next executor's replayed import
    had the file's ``BATCH = 32``, and cells computed with it, silently."""
    kc, (first, second, *_), _ = kernel
    (tmp_path / "nbhelpers.py").write_text("BATCH = 32\nseen = []\n\ndef bump():\n    seen.append(BATCH)\n")
    made = _on(tandem_cluster, kc, first, (
        f"import sys, threading\nsys.path.insert(0, {str(tmp_path)!r})\nimport nbhelpers\n"
        "from nbhelpers import seen\n"
        "nbhelpers.BATCH = 64\nnbhelpers.bump()\nnbhelpers.guard = threading.Lock()\n"
        "items = [1]\nnbhelpers.items = items"
    ))  # fmt: skip
    assert "module global 'nbhelpers.guard' is not replicated" in made.stdout, made.stdout
    copied = "module global 'nbhelpers.items' holds the object the variable 'items' holds"
    assert copied in made.stdout, made.stdout
    moved = _on(
        tandem_cluster, kc, second, "nbhelpers.bump()\nprint(nbhelpers.BATCH, seen, seen is nbhelpers.seen)"
    )
    assert moved.stdout == "64 [64, 64] True\n", moved.stdout


def test_a_notebook_showing_every_expression_shows_them_on_the_next_executor(
    tandem_cluster: ClusterHandle, kernel: tuple[BlockingKernelClient, list[str], str]
) -> None:
    """``InteractiveShell.ast_node_interactivity = "all"``, a common first cell (a class attribute,
    not ``%config``): before, the next executor showed only each cell's last expression."""
    kc, (first, second, *_), _ = kernel
    _on(tandem_cluster, kc, first, (
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "InteractiveShell.ast_node_interactivity = 'all'"
    ))  # fmt: skip
    moved = _on(tandem_cluster, kc, second, "'one'\n'two'")
    _on(tandem_cluster, kc, second, "get_ipython().ast_node_interactivity = 'last_expr'")  # shared kernel
    assert moved.results == ["'one'", "'two'"], moved.results


def test_the_output_history_follows_the_executor(
    tandem_cluster: ClusterHandle, kernel: tuple[BlockingKernelClient, list[str], str]
) -> None:
    """``_``, ``__``, ``Out[n]`` and ``_<n>`` after an executor change. Before, they were the new
    executor's own older outputs (``_ * 2`` doubled a number shown cells ago, silently)."""
    kc, (first, second, *_), _ = kernel
    n = _on(tandem_cluster, kc, first, "21 * 2").reply["content"]["execution_count"]
    _on(tandem_cluster, kc, first, "items = [1, 2, 3]\nitems")
    large = _on(tandem_cluster, kc, first, "bytes(3_000_000)")  # over datastore.large_object_bytes
    _on(tandem_cluster, kc, first, "items = 'rebound'")  # the output shown before is still the list
    moved = _on(
        tandem_cluster,
        kc,
        second,
        f"print(repr(_)[:120]); print(__ == [1, 2, 3], ___ * 2, Out[{n}] * 2, _{n})",
    )
    lines = moved.stdout.splitlines()
    shown = large.reply["content"]["execution_count"]
    assert lines[0].startswith(
        f"<Out[{shown}] is not on this replica: its bytes is over 1,048,576 bytes pickled"
    ), lines
    assert lines[1] == "True 84 84 42", lines
    here = _on(tandem_cluster, kc, second, "'here'").reply["content"]["execution_count"]
    back = _on(tandem_cluster, kc, first, f"print(_, Out[{here}])")
    assert back.stdout.split() == ["here", "here"], back.stdout


def test_an_unpicklable_variable_is_named_when_made_and_when_the_executor_moves(
    tandem_cluster: ClusterHandle, kernel: tuple[BlockingKernelClient, list[str], str]
) -> None:
    kc, hosts, _ = kernel
    errors: list[str] = []

    def stderr_of(host: str, code: str) -> str:
        with tandem_cluster.only_host_open(host):
            reply = kc.execute_interactive(
                code,
                timeout=60,
                output_hook=lambda m: (
                    errors.append(m["content"]["text"])
                    if m["msg_type"] == "stream" and m["content"]["name"] == "stderr"
                    else None
                ),
            )
        assert reply["metadata"]["tandem"]["host_id"] == host
        told, errors[:] = "".join(errors), []
        return told

    made = stderr_of(hosts[0], "import threading\nheld = threading.Lock()")
    assert "'held' is not replicated" in made and "lock" in made, made
    moved = stderr_of(hosts[1], "print('held' in globals())")
    assert "'held' is missing" in moved, moved


def _kernel_status(cluster: ClusterHandle, kernel_id: str) -> dict[str, Any]:
    status = cluster.ask_scheduler(messages.CLUSTER_STATUS, {})
    return dict(next(k for k in status["kernels"] if k["id"] == kernel_id))


def test_a_pinned_kernel_runs_where_its_unpicklable_objects_live_until_that_host_cannot(
    tandem_cluster: ClusterHandle, kernel: tuple[BlockingKernelClient, list[str], str]
) -> None:
    kc, hosts, kernel_id = kernel
    replicas = _kernel_status(tandem_cluster, kernel_id)["replicas"]
    follower = next(r for r in replicas if r["role"] != "leader" and r["host"] in hosts)
    pinned = _on(
        tandem_cluster, kc, follower["host"], "%tandem pin\nimport threading\ngate = threading.Lock()"
    )
    assert "now run on replica" in pinned.stdout
    assert eventually(lambda: _kernel_status(tandem_cluster, kernel_id)["pinned"] == follower["id"])
    # no host cordoned: the scheduler sends the cells to the pinned replica, not to the leader
    for _ in range(2):
        here = run(kc, "print(gate.acquire(blocking=False)); gate.release()", timeout=60)
        assert (here.status, here.stdout, here.tandem.get("host_id")) == ("ok", "True\n", follower["host"])
    # the global scheduler dies: the one tandem up starts again learns the pin from the hosts
    cluster_file = tandem_cluster.state_dir / "cluster.json"
    crashed = json.loads(cluster_file.read_text())["processes"]["global-scheduler"]
    assert signal_ours(crashed, signal.SIGKILL)

    def pin_back() -> bool:
        with contextlib.suppress(Exception):
            if json.loads(cluster_file.read_text())["processes"]["global-scheduler"] != crashed:
                return bool(_kernel_status(tandem_cluster, kernel_id)["pinned"] == follower["id"])
        return False

    assert eventually(pin_back, timeout=60), tandem_cluster.log_text("global-scheduler")[-2000:]
    again = run(kc, "print(gate.locked())", timeout=60)
    assert (again.status, again.stdout, again.tandem.get("host_id")) == ("ok", "False\n", follower["host"])
    # its host cordoned: the cell runs elsewhere, and is told what it lacks
    elsewhere = next(h for h in hosts if h != follower["host"])
    moved = _on(tandem_cluster, kc, elsewhere, "print('gate' in globals())")
    assert "'gate' is missing" in moved.stdout and moved.stdout.endswith("False\n"), moved.stdout
    # uncordoned: back on the pinned replica, though the last executor (and maybe the leader) is
    # elsewhere; the notebook's state is the group's (the lock went with the cell that lacked it)
    back = run(kc, "print('gate' in globals())", timeout=60)
    assert (back.stdout, back.tandem.get("host_id")) == ("False\n", follower["host"])
    unpinned = run(kc, "%tandem unpin", timeout=60)
    assert "not pinned any more" in unpinned.stdout
    assert eventually(lambda: _kernel_status(tandem_cluster, kernel_id)["pinned"] is None)


_DIGESTS = (
    "import hashlib\n"
    "print(hashlib.sha256(big.numpy().tobytes()).hexdigest(), hashlib.sha256(arr.tobytes()).hexdigest())"
)


def test_large_objects_imaged_after_the_reply_reach_the_next_executor_as_the_cell_left_them(
    tandem_cluster: ClusterHandle, kernel: tuple[BlockingKernelClient, list[str], str]
) -> None:
    """A cell makes a 200 MB tensor and a 40 MB array; its reply does not wait for their copy
    (kernel_replica/state_image.py). The next cell, at once, writes both in place while the copy
    runs (and puts them back bitwise, so it sends nothing itself; the array through a notebook
    function): the next executor must get exactly the bytes the first cell left."""
    kc, hosts, _ = kernel
    first, second = hosts[0], hosts[1]
    made = _on(
        tandem_cluster,
        kc,
        first,
        "import numpy as np, torch\n"
        "big = torch.randn(50_000_000, generator=torch.Generator().manual_seed(7))\n"
        "arr = np.random.default_rng(7).random(5_000_000)\n"
        "def scale(k):\n    arr[:] *= k\n\n" + _DIGESTS,
    )
    written = _on(
        tandem_cluster,
        kc,
        first,
        "in_flight = get_ipython().kernel._imager.in_flight()\n"
        "big.mul_(2); big[:1000] = 0.5; scale(4)\n"
        "big.div_(2); big[:1000] = torch.randn(50_000_000, generator=torch.Generator().manual_seed(7))[:1000]\n"
        "scale(0.25)\n"
        "print(in_flight)\n" + _DIGESTS,
    )
    assert written.stdout.split()[1:] == made.stdout.split(), "the in-place writes are not undone exactly"
    moved = _read_on(
        tandem_cluster,
        kc,
        second,
        _DIGESTS + "\n"
        "groups = get_ipython().kernel._bridge.core.namespace.contents()[1]\n"
        "print(sorted(n for g, names in groups if g.get('image') for n in names))",
    )
    lines = moved.stdout.splitlines()
    assert lines[0].split() == made.stdout.split()
    assert lines[1] == "['arr', 'big']"
    print("images in flight when the next cell started:", written.stdout.split()[0])


def _log_events(cluster: ClusterHandle, host: str, kernel_id: str, event: str) -> list[dict[str, Any]]:
    """``event``'s lines (JSON) in the replica logs of ``kernel_id`` on ``host``."""
    found = []
    for log in cluster.state_dir.glob(f"hosts/{host}/{kernel_id}/*/replica.log"):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("{") and f'"{event}"' in line:
                with contextlib.suppress(ValueError):
                    parsed = json.loads(line)
                    if parsed.get("event") == event:
                        found.append(parsed)
    return found


def test_a_new_executor_runs_a_cell_while_a_large_object_loads_and_then_reads_it_bitwise(
    tandem_cluster: ClusterHandle, kernel: tuple[BlockingKernelClient, list[str], str]
) -> None:
    """A cell makes a 100 MB tensor on one host; the next cells run on another host's replica,
    which reads the tensor in the background (kernel_replica/lazy_load.py): a cell that reads only
    a small name never waits for it, a cell that reads it gets it bitwise, and while it loaded
    the replica's main loop (cells, the scheduler) and Raft loop were never silent for long."""
    kc, hosts, kernel_id = kernel
    first, second = hosts[0], hosts[1]
    made = _on(
        tandem_cluster,
        kc,
        first,
        "import hashlib, torch\n"
        "ondemand = torch.randn(25_000_000, generator=torch.Generator().manual_seed(3))\n"
        "tiny = 41\n"
        "print(hashlib.sha256(ondemand.numpy().tobytes()).hexdigest())",
    )
    quick = _read_on(tandem_cluster, kc, second, "print(tiny + 1)")
    assert quick.stdout.strip() == "42"
    read = _read_on(
        tandem_cluster, kc, second, "print(hashlib.sha256(ondemand.numpy().tobytes()).hexdigest())"
    )
    assert read.stdout == made.stdout
    records = _read_on(
        tandem_cluster, kc, second, "import json\nprint(json.dumps(list(get_ipython().kernel.cell_loads)))"
    )
    by_cell = {split_election_key(r["msg_id"])[0]: r for r in json.loads(records.stdout)}
    quick_record = by_cell.get(quick.reply["parent_header"]["msg_id"])
    if quick_record is not None:  # the tensor was still loading when the small cell came
        assert quick_record["waited_for"] == [], quick_record
    read_record = by_cell.get(read.reply["parent_header"]["msg_id"])
    if read_record is not None:
        assert read_record["waited_for"] == ["ondemand"], read_record
    loads = _log_events(tandem_cluster, second, kernel_id, "state_loaded")
    assert loads and all(event["lazy"] for event in loads), loads
    for event in loads:  # well inside the election's wait for a silent voter (5 s)
        assert event["main_lag_ms"] < 2500 and event["raft_lag_ms"] < 2500, event
    print("small cell:", quick_record, "loads:", loads[-1])
