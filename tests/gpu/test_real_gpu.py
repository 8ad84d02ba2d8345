"""GPU residency and GPU discovery on a real NVIDIA GPU (kernel_replica/device_residency.py,
services/local_scheduler/gpus.py).

The unit tests drive the residency code with the ``meta`` device and a faked ``torch.cuda``; these
run it for real: an embedded cluster whose local schedulers find the machine's GPUs through NVML
(``embedded.virtual_gpus = false``), a notebook that trains a model with an optimizer on ``cuda``
over several cells, on one executor and then on another (the first one's host cordoned). Every
"host" is a process on this machine, so they all declare the same physical GPU(s); that is enough
to move a notebook between replicas. GPU memory is read through NVML (whole device) from this
process between cells and from inside the cells (``torch.cuda.memory_allocated``: this process's
tensors). Skipped where torch sees no CUDA device (CI).

The tests share one cluster and one notebook and run in file order.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU visible to torch (none here)", allow_module_level=True)

import pynvml  # noqa: E402 - only where there is a GPU
from _cluster import ClusterHandle, running_cluster  # noqa: E402
from _kernels import CellResult, run, tandem_kernel  # noqa: E402
from _signals import signal_ours  # noqa: E402
from jupyter_client import BlockingKernelClient, KernelManager  # noqa: E402

pytestmark = pytest.mark.integration

HIDDEN = 2048
PARAM_BYTES = 2 * (HIDDEN * HIDDEN + HIDDEN) * 4  # two fp32 Linear layers
# what the notebook keeps on the GPU for its model: parameters, gradients, Adam's two moments
TRAINING_STATE_BYTES = 4 * PARAM_BYTES
ALLOCATOR_SLACK = 2**20  # block rounding of torch's caching allocator
REAL_GPU_CLUSTER = ("--hosts", "3", "--set", "embedded.virtual_gpus=false")
Notebook = tuple[KernelManager, BlockingKernelClient]

SETUP = f"""
import json
import pynvml
import torch
from kernel_replica.helper import gpu_ids

HIDDEN = {HIDDEN}

def make_model():
    return torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN))

def batch(step, rows=64):
    generator = torch.Generator().manual_seed(step)
    inputs = torch.randn(rows, HIDDEN, generator=generator)
    return inputs.cuda(), torch.randn(rows, HIDDEN, generator=generator).cuda()

def train(net, optimizer, steps):
    for step in steps:
        inputs, targets = batch(step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(inputs), targets).backward()
        optimizer.step()

def device_used_bytes():
    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(gpu_ids()[0])).used)
    finally:
        pynvml.nvmlShutdown()

def probe_start():
    # before this cell's own code: where the model is and what this process holds on the GPU
    return {{
        "param_devices": sorted({{p.device.type for p in model.parameters()}}),
        "optimizer_state_devices": sorted(
            {{v.device.type for s in opt.state.values() for k, v in s.items() if k != "step"}}
        ),
        "allocated_at_start": torch.cuda.memory_allocated() if torch.cuda.is_initialized() else 0,
        "residency_timings": dict(get_ipython().kernel._residency.timings),
    }}

def probe_end(found):
    return json.dumps(found | {{
        "allocated_in_cell": torch.cuda.memory_allocated(),
        "device_used_in_cell": device_used_bytes(),
        "steps_done": steps_done,
        "gpu_ids": gpu_ids(),
    }})

torch.manual_seed(0)
model = make_model().cuda()
initial = {{k: v.detach().cpu().clone() for k, v in model.state_dict().items()}}
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
train(model, opt, range(0, 5))
steps_done = 5
print(probe_end({{}}))
"""

TRAIN = """
found = probe_start()
print(json.dumps(found))
train(model, opt, range(steps_done, steps_done + 5))
steps_done += 5
print(probe_end(found))
"""

REFERENCE = """
reference = make_model().cuda()
reference.load_state_dict(initial)
reference_opt = torch.optim.Adam(reference.parameters(), lr=1e-3)
train(reference, reference_opt, range(0, steps_done))
difference = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
print(json.dumps({"steps_done": steps_done, "max_abs_difference": difference}))
del reference, reference_opt
"""


# ---- helpers ----------------------------------------------------------------------------------


def device_used_bytes(index: int = 0) -> int:
    """GPU memory in use on the whole device, as NVML reports it (every process)."""
    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used)
    finally:
        pynvml.nvmlShutdown()


def nvml_gpus() -> list[str]:
    pynvml.nvmlInit()
    try:
        names = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(index))
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        return names
    finally:
        pynvml.nvmlShutdown()


def run_ok(kc: BlockingKernelClient, code: str, timeout: float = 120.0) -> CellResult:
    cell = run(kc, code, timeout=timeout)
    assert cell.status == "ok", (cell.reply["content"], cell.stdout, cell.errors)
    return cell


def printed(cell: CellResult) -> list[dict[str, Any]]:
    """The JSON lines a cell printed."""
    return [json.loads(line) for line in cell.stdout.splitlines() if line.startswith("{")]


def log_events(log_dir: Path, pattern: str, event: str) -> list[dict[str, Any]]:
    """JSON log lines named ``event`` in the files under ``log_dir`` matching ``pattern``."""
    found = []
    for path in sorted(log_dir.rglob(pattern)):
        for line in path.read_text(errors="replace").splitlines():
            if f'"{event}"' not in line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("event") == event:
                found.append(record | {"file": str(path.relative_to(log_dir))})
    return found


def cell_report(cluster: ClusterHandle, cell: CellResult) -> dict[str, Any]:
    """The scheduler's record of ``cell`` (``tandem status --json`` ``cells``), once the
    executor's step timings have arrived."""
    msg_id = cell.reply["parent_header"]["msg_id"]

    def with_timings(status: dict[str, Any]) -> dict[str, Any] | None:
        return next(
            (c for c in status.get("cells", []) if c["msg_id"] == msg_id and c.get("replica_steps_ms")), None
        )

    status = cluster.wait_for_status(with_timings, f"step timings of cell {msg_id}", timeout=30)
    report = with_timings(status)
    assert report is not None
    return report


def assert_training_state_on_gpu(found: dict[str, Any]) -> None:
    assert found["param_devices"] == ["cuda"], found
    assert found["optimizer_state_devices"] == ["cuda"], found
    moved_in = found["residency_timings"].get("to_gpu_bytes", 0.0)
    assert moved_in >= TRAINING_STATE_BYTES, found
    # all this process holds on the GPU at the start of a cell is what residency moved back in:
    # nothing stayed behind from the previous cell
    assert found["allocated_at_start"] - moved_in < ALLOCATOR_SLACK, found


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory: pytest.TempPathFactory, tandem_kernelspec: Path) -> Iterator[ClusterHandle]:
    with running_cluster(tmp_path_factory.mktemp("tandem-gpu"), *REAL_GPU_CLUSTER) as handle:
        yield handle


@pytest.fixture(scope="module")
def notebook(gpu_cluster: ClusterHandle) -> Iterator[Notebook]:
    """One 1-GPU kernel that has created its model and optimizer on the GPU and trained 5 steps."""
    with tandem_kernel() as (km, kc):
        setup = run_ok(kc, SETUP, timeout=180)
        used_between = device_used_bytes()
        (probe,) = printed(setup)
        print(f"setup cell: {probe}; device memory used after it: {used_between}")
        assert probe["allocated_in_cell"] >= TRAINING_STATE_BYTES, probe
        assert probe["device_used_in_cell"] - used_between >= TRAINING_STATE_BYTES, (probe, used_between)
        yield km, kc


# ---- tests ------------------------------------------------------------------------------------


def test_local_schedulers_declare_the_machines_gpus_found_through_nvml(gpu_cluster: ClusterHandle) -> None:
    names = nvml_gpus()
    status = gpu_cluster.status()
    assert len(status["hosts"]) == 3
    for host in status["hosts"]:
        assert host["gpu_kind"] == "nvidia", host
        assert host["gpus"] == len(names), host
    detected = log_events(gpu_cluster.log_dir, "host-*.log", "gpus_detected")
    assert len(detected) == 3, detected
    for record in detected:
        assert record["kind"] == "nvidia", record
        assert record["count"] == len(names) and record["names"] == names, record
    print(f"NVML: {names}; hosts: {[(h['id'], h['gpus'], h['gpu_kind']) for h in status['hosts']]}")


def test_model_and_optimizer_come_back_to_the_gpu_for_each_cell_and_leave_it_between_cells(
    gpu_cluster: ClusterHandle, notebook: Notebook
) -> None:
    _km, kc = notebook
    for _ in range(2):
        cell = run_ok(kc, TRAIN)
        used_between = device_used_bytes()
        found, probe = printed(cell)
        assert_training_state_on_gpu(found)
        assert probe["allocated_in_cell"] >= TRAINING_STATE_BYTES, probe
        # after the reply the executor has given back to the device everything the cell used
        assert probe["device_used_in_cell"] - used_between >= TRAINING_STATE_BYTES, (probe, used_between)
        report = cell_report(gpu_cluster, cell)
        assert report["replica_bytes"]["to_host_bytes"] >= TRAINING_STATE_BYTES, report
        assert report["replica_bytes"]["to_gpu_bytes"] >= TRAINING_STATE_BYTES, report
        print(
            f"cell on {cell.tandem.get('replica_id')}@{cell.tandem.get('host_id')}: "
            f"allocated at start {found['allocated_at_start']}, in cell {probe['allocated_in_cell']}, "
            f"device used in cell {probe['device_used_in_cell']}, between cells {used_between}; "
            f"moves {report['replica_steps_ms'].get('to_gpu_ms')} ms to GPU, "
            f"{report['replica_steps_ms'].get('to_host_ms')} ms to host, bytes {report['replica_bytes']}"
        )


def test_model_and_optimizer_follow_the_notebook_to_another_replica_on_the_gpu(
    gpu_cluster: ClusterHandle, notebook: Notebook
) -> None:
    _km, kc = notebook
    before = run_ok(kc, TRAIN)
    host, replica = before.tandem["host_id"], before.tandem["replica_id"]
    assert gpu_cluster.cli("host", "cordon", host).returncode == 0
    try:
        after = run_ok(kc, TRAIN)
        used_between = device_used_bytes()
    finally:
        assert gpu_cluster.cli("host", "uncordon", host).returncode == 0
    assert after.tandem["replica_id"] != replica and after.tandem["host_id"] != host, after.tandem
    found, probe = printed(after)
    assert_training_state_on_gpu(found)
    assert probe["device_used_in_cell"] - used_between >= TRAINING_STATE_BYTES, (probe, used_between)
    report = cell_report(gpu_cluster, after)
    print(
        f"executor {replica}@{host} -> {after.tandem['replica_id']}@{after.tandem['host_id']}: "
        f"{found}; moves {report['replica_steps_ms'].get('to_gpu_ms')} ms to GPU, "
        f"{report['replica_steps_ms'].get('to_host_ms')} ms to host"
    )


def test_weights_after_training_across_cells_and_replicas_equal_an_uninterrupted_run(
    notebook: Notebook,
) -> None:
    _km, kc = notebook
    (result,) = printed(run_ok(kc, REFERENCE))
    print(f"reference run: {result}")
    assert result["steps_done"] >= 15, result
    assert result["max_abs_difference"] <= 1e-6, result


def test_cell_outputs_with_autograd_history_leave_no_activations_on_the_gpu(notebook: Notebook) -> None:
    """``preds = model(x)`` with autograd on: its graph holds the forward pass's activations on
    the GPU; the copy kept between cells must not."""
    _km, kc = notebook
    run_ok(
        kc, "x_eval, _ = batch(10_000, rows=8192)\npreds = model(x_eval)\nprint(preds.grad_fn is not None)"
    )
    cell = run_ok(
        kc,
        "found = probe_start()\n"
        "print(json.dumps(found | {'preds_device': preds.device.type, 'preds_requires_grad': preds.requires_grad,"
        " 'preds_has_history': preds.grad_fn is not None}))\n"
        "del preds, x_eval",
    )
    (found,) = printed(cell)
    print(f"after an output with history: {found}")
    assert found["preds_device"] == "cuda" and not found["preds_has_history"], found
    assert found["preds_requires_grad"], found  # as the standbys get it from the STATE: a leaf
    moved_in = found["residency_timings"].get("to_gpu_bytes", 0.0)
    assert found["allocated_at_start"] - moved_in < ALLOCATOR_SLACK, found


def test_a_seeded_notebook_draws_the_same_cuda_random_numbers_whichever_replica_runs_it(
    gpu_cluster: ClusterHandle,
) -> None:
    """``torch.manual_seed(0)`` in a first cell (no CUDA yet) seeds the GPUs' generators too; the
    next cells each run on another replica and must draw what one process would have drawn
    (kernel_replica/cuda_rng.py)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    expected = [torch.rand(3, generator=generator, device="cuda").tolist() for _ in range(2)]
    with tandem_kernel() as (_km, kc):
        first = run_ok(kc, "import json, torch\ntorch.manual_seed(0)", timeout=180)
        cordoned, drawn, executors = [first.tandem["host_id"]], [], [first.tandem["replica_id"]]
        try:
            for _ in expected:
                assert gpu_cluster.cli("host", "cordon", cordoned[-1]).returncode == 0
                cell = run_ok(kc, "print(json.dumps(torch.rand(3, device='cuda').tolist()))", timeout=180)
                drawn.append(json.loads(cell.stdout))
                cordoned.append(cell.tandem["host_id"])
                executors.append(cell.tandem["replica_id"])
        finally:
            for host in cordoned:
                assert gpu_cluster.cli("host", "uncordon", host).returncode == 0
    print(f"executors {executors}: drew {drawn}, one process draws {expected}")
    assert len(set(executors)) == 3, executors
    assert drawn == expected


def test_residency_off_leaves_tensors_on_the_gpu_between_cells(
    tmp_path_factory: pytest.TempPathFactory, tandem_kernelspec: Path
) -> None:
    tensor_bytes = 256 * 2**20
    state_dir = tmp_path_factory.mktemp("tandem-gpu-off")
    with (
        running_cluster(state_dir, *REAL_GPU_CLUSTER, "--set", "kernel.gpu_residency=off"),
        tandem_kernel() as (_km, kc),
    ):
        first = run_ok(
            kc,
            "import json, torch, pynvml\n"
            "from kernel_replica.helper import gpu_ids\n"
            f"kept = torch.ones({tensor_bytes // 4}, device='cuda')\n"
            "pynvml.nvmlInit()\n"
            "used = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(gpu_ids()[0])).used\n"
            "print(json.dumps({'device_used_in_cell': used}))",
            timeout=180,
        )
        used_between = device_used_bytes()
        (probe,) = printed(first)
        # nothing was given back: the tensor is still on the device
        assert used_between >= probe["device_used_in_cell"] - ALLOCATOR_SLACK, (probe, used_between)
        second = run_ok(
            kc,
            "print(json.dumps({'device': kept.device.type, 'allocated_at_start': torch.cuda.memory_allocated(),"
            " 'residency_timings': dict(get_ipython().kernel._residency.timings)}))",
        )
        (found,) = printed(second)
        print(f"residency off: in cell {probe}, between cells {used_between}, next cell {found}")
        assert found["device"] == "cuda" and found["allocated_at_start"] >= tensor_bytes, found
        assert found["residency_timings"] == {}, found


def test_a_replica_restarted_from_its_snapshot_brings_the_model_back_to_the_gpu(
    tmp_path_factory: pytest.TempPathFactory, tandem_kernelspec: Path
) -> None:
    """A standby killed and restarted in place rebuilds the notebook from its Raft snapshot and
    log tail, in host memory; the snapshot says which objects live on the GPU, so when it then
    executes, the model and optimizer go to the device and training goes on where it stopped."""
    state_dir = tmp_path_factory.mktemp("tandem-gpu-snapshot")
    snapshotting = ("--set", "raft.snapshot_every=4", "--set", "scheduler.replace_dead_replicas=false")
    with (
        running_cluster(state_dir, *REAL_GPU_CLUSTER, *snapshotting) as cluster,
        tandem_kernel() as (km, kc),
    ):
        run_ok(kc, SETUP, timeout=180)
        last = run_ok(kc, TRAIN)
        for _ in range(3):  # past several snapshots
            last = run_ok(kc, TRAIN)
        kernel = next(k for k in cluster.status()["kernels"] if k["id"] == km.kernel_id)
        victim = next(r for r in kernel["replicas"] if r["id"] != last.tandem["replica_id"])
        assert signal_ours(int(victim["pid"]), signal.SIGKILL)

        def victim_alive(status: dict[str, Any]) -> bool | None:
            kernels = [k for k in status.get("kernels", []) if k["id"] == km.kernel_id]
            return next((r["alive"] for k in kernels for r in k["replicas"] if r["id"] == victim["id"]), None)

        cluster.wait_for_status(lambda s: victim_alive(s) is False, f"the scheduler saw {victim['id']} exit")
        run_ok(kc, TRAIN)  # a cell the victim misses
        restart = cluster.cli("replica", "restart", km.kernel_id, victim["id"], timeout=120)
        assert restart.returncode == 0, restart.stderr
        others = [h["id"] for h in cluster.status()["hosts"] if h["id"] != victim["host"]]
        for host in others:
            assert cluster.cli("host", "cordon", host).returncode == 0
        try:
            cell = run_ok(kc, TRAIN)
            used_between = device_used_bytes()
        finally:
            for host in others:
                assert cluster.cli("host", "uncordon", host).returncode == 0
        assert cell.tandem.get("replica_id") == victim["id"], cell.tandem
        log = state_dir / "hosts" / victim["host"] / km.kernel_id / victim["id"] / "replica.log"
        assert "snapshot_restored" in log.read_text(errors="replace"), "not restored from its snapshot"
        found, probe = printed(cell)
        print(f"restarted {victim['id']}@{victim['host']}: {found}; in cell {probe}; between {used_between}")
        assert_training_state_on_gpu(found)
        assert probe["steps_done"] == 35, probe
        (result,) = printed(run_ok(kc, REFERENCE))
        print(f"reference run after the restart: {result}")
        assert result["max_abs_difference"] <= 1e-6, result
