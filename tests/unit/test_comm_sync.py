"""The comm registry as replicated state (``kernel_replica/comm_sync.py``): records of real
ipywidgets models, what a STATE carries, how the replicated namespace takes them (only from the
replica that owns the comms), and a standby re-creating a model with its id and state."""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import ipykernel.ipkernel  # noqa: F401 - installs ipykernel's comm factory, as in a replica
import ipywidgets
import msgpack
import pytest
from comm.base_comm import CommManager
from ipywidgets.widgets import widget as widget_module

from kernel_replica.comm_sync import (
    CommWatch,
    apply_comms,
    comm_changes,
    comm_records,
    record_digest,
    set_owner,
)
from kernel_replica.log_entries import State
from kernel_replica.object_codec import dumps
from kernel_replica.state_sync import ReplicatedNamespace


@pytest.fixture
def manager() -> Iterator[CommManager]:
    """The comm manager of this process (the widgets register there), emptied afterwards."""
    import comm

    found = comm.get_comm_manager()
    yield found
    for widget in list(widget_module._instances.values()):
        widget.close()
    found.comms.clear()
    found.targets.pop("jupyter.widget.control", None)
    widget_module.Widget._control_comm = None


def _forget(manager: CommManager, comm_id: str) -> None:
    """As if this process were another replica: the model is not open here, nothing published."""
    manager.comms.pop(comm_id)._closed = True
    widget_module._instances.pop(comm_id).comm = None


def test_a_widget_record_carries_its_class_and_state_and_changes_only_when_the_state_does(
    manager: CommManager,
) -> None:
    slider = ipywidgets.IntSlider(value=3, max=10)
    records, failed = comm_records(manager.comms)
    assert not failed
    record = records[slider.model_id]
    assert record["target"] == "jupyter.widget"
    assert record["class"] == ["ipywidgets.widgets.widget_int", "IntSlider"]
    assert record["state"]["value"] == 3
    replicated = {cid: record_digest(rec) for cid, rec in records.items()}
    assert comm_changes(records, replicated) == ({}, ())
    slider.value = 7
    changed, closed = comm_changes(comm_records(manager.comms)[0], replicated)
    assert list(changed) == [slider.model_id] and changed[slider.model_id]["state"]["value"] == 7
    assert closed == ()
    model_id, layout_id = slider.model_id, slider.layout.model_id
    slider.close()
    changed, closed = comm_changes(comm_records(manager.comms)[0], replicated)
    assert model_id in closed and layout_id not in closed


def test_a_standby_recreates_models_with_their_ids_state_and_references(manager: CommManager) -> None:
    box = ipywidgets.VBox([ipywidgets.IntSlider(value=5, description="speed")])
    records, _ = comm_records(manager.comms)
    ids = {"box": box.model_id, "slider": box.children[0].model_id}
    for comm_id in list(records):
        _forget(manager, comm_id)
    assert apply_comms(manager, records, (), {}) == {}
    rebuilt = widget_module._instances[ids["box"]]
    assert rebuilt is not box and isinstance(rebuilt, ipywidgets.VBox)
    assert rebuilt.children[0] is widget_module._instances[ids["slider"]]
    assert (rebuilt.children[0].value, rebuilt.children[0].description) == (5, "speed")
    assert set(manager.comms) == set(records)
    assert all(comm.kernel is None and not comm.primary for comm in manager.comms.values())
    set_owner(manager.comms, "the kernel")
    assert all(comm.kernel == "the kernel" for comm in manager.comms.values())


def test_names_bound_to_widgets_travel_as_references_to_their_model(manager: CommManager) -> None:
    slider = ipywidgets.IntSlider(value=2)
    namespace = {"pair": [slider, slider]}
    pickled, buffers = dumps(namespace, namespace=namespace)
    loaded = pickle.loads(pickled, buffers=buffers)
    assert loaded["pair"][0] is slider and loaded["pair"][1] is slider


def _state(replica: str, msg_id: str, **fields: object) -> State:
    return State(msg_id, replica, **fields)  # type: ignore[arg-type]


def test_the_namespace_takes_comm_messages_only_from_the_replica_that_owns_the_comms() -> None:
    ns = ReplicatedNamespace()
    record = {"target": "jupyter.widget", "class": ["m", "W"], "state": {"value": 1}}
    ns.apply(_state("r1", "cell-1", comms={"c1": record}))
    moved = {**record, "state": {"value": 7}}
    taken = ns.apply(_state("r1", "comm-a", repair=True, comms={"c1": moved}))
    assert taken.comms == {"c1": moved} and ns.comms() == {"c1": moved}
    ns.apply(_state("r2", "cell-2"))  # r2 executes: it owns the comms now
    stale = ns.apply(_state("r1", "comm-b", repair=True, comms={"c1": record}, comms_closed=("c1",)))
    assert stale.comms == {} and stale.comms_closed == () and ns.comms() == {"c1": moved}
    ns.apply(_state("r2", "comm-c", repair=True, comms_closed=("c1",)))
    assert ns.comms() == {} and ns.comm_digests() == {}


def test_a_snapshot_keeps_the_comms_and_their_owner() -> None:
    source = ReplicatedNamespace()
    record = {"target": "jupyter.widget.control"}
    source.apply(_state("r2", "cell-1", comms={"c9": record}))
    restored = ReplicatedNamespace()
    restored.restore(source.to_snapshot())
    assert restored.comms() == {"c9": record}
    assert restored.comm_digests() == {"c9": record_digest(record)}
    assert restored.apply(_state("r1", "comm-x", repair=True, comms_closed=("c9",))).comms_closed == ()
    with pytest.raises(ValueError, match="'cm'"):
        ReplicatedNamespace.parse_snapshot(
            msgpack.packb({"fps": {}, "records": {}, "groups": [], "cm": {"c9": {"state": {}}}})
        )


def test_a_front_end_comm_is_handed_to_its_target_again_with_its_open_message(manager: CommManager) -> None:
    from comm import create_comm

    # as ipywidgets registers it when imported in a kernel
    manager.register_target("jupyter.widget.control", widget_module.Widget.handle_control_comm_opened)
    control = create_comm(comm_id="ctl", primary=False, target_name="jupyter.widget.control")
    manager.register_comm(control)
    opened = {"ctl": {"data": {}, "metadata": {"version": widget_module.__control_protocol_version__}}}
    records, _ = comm_records(manager.comms, opened)
    assert records["ctl"] == {"target": "jupyter.widget.control", "open": opened["ctl"]}
    manager.comms.pop("ctl")
    learned: dict[str, dict[str, object]] = {}
    assert apply_comms(manager, records, (), {}, learned) == {}
    assert widget_module.Widget._control_comm is manager.comms["ctl"] and learned == opened
    apply_comms(manager, {}, ("ctl",), {}, learned)
    assert "ctl" not in manager.comms and learned == {}


def test_the_watch_takes_again_only_the_comms_that_changed_are_new_or_closed(manager: CommManager) -> None:
    sliders = [ipywidgets.IntSlider(value=i) for i in range(3)]
    watch = CommWatch()
    first, closed, failed = watch.changes(manager.comms, None, {})
    assert set(first) == set(manager.comms) and closed == () and failed == {}
    replicated = {cid: record_digest(rec) for cid, rec in first.items()}
    assert watch.changes(manager.comms, None, replicated) == ({}, (), {})
    sliders[1].value = 7
    changed, _, _ = watch.changes(manager.comms, None, replicated)
    assert list(changed) == [sliders[1].model_id] and changed[sliders[1].model_id]["state"]["value"] == 7
    replicated.update({cid: record_digest(rec) for cid, rec in changed.items()})
    gone = sliders[0].model_id
    sliders[0].close()
    extra = ipywidgets.Button(description="new")
    changed, closed, _ = watch.changes(manager.comms, None, replicated)
    assert extra.model_id in changed and gone in closed


def test_a_widget_whose_class_is_not_here_is_reported_with_its_class(manager: CommManager) -> None:
    record = {"target": "jupyter.widget", "class": ["__main__", "Gauge"], "state": {}, "bp": [], "bf": []}
    lost = apply_comms(manager, {"g1": record}, (), {})
    assert list(lost) == ["g1"] and "__main__.Gauge could not be re-created here: KeyError" in lost["g1"]
    # once the cell that defined it is in the namespace, it is re-created
    assert apply_comms(manager, {"g1": record}, (), {"Gauge": ipywidgets.IntText}) == {}
    assert isinstance(widget_module._instances["g1"], ipywidgets.IntText)


def test_the_notebooks_callbacks_travel_with_the_widget(manager: CommManager) -> None:
    namespace: dict[str, object] = {"log": []}
    exec(  # notebook code, as a cell defines it
        "def clicked(button):\n    log.append('click')\n\n\ndef moved(change):\n    log.append(change['new'])\n",
        namespace,
    )
    button, slider = ipywidgets.Button(description="go"), ipywidgets.IntSlider()
    button.on_click(namespace["clicked"])
    slider.observe(namespace["moved"], names="value")
    watch = CommWatch()
    records, _, failed = watch.changes(manager.comms, None, {}, namespace)
    assert failed == {} and "cb" in records[button.model_id] and "cb" in records[slider.model_id]
    replicated = {cid: record_digest(rec) for cid, rec in records.items()}
    assert watch.changes(manager.comms, None, replicated, namespace)[0] == {}
    button_id, slider_id = button.model_id, slider.model_id
    for comm_id in list(records):
        _forget(manager, comm_id)
    standby: dict[str, object] = {"log": []}  # another replica's namespace: the handlers use its log
    assert apply_comms(manager, records, (), standby) == {}
    rebuilt_button = widget_module._instances[button_id]
    rebuilt_button.click()
    widget_module._instances[slider_id].value = 4
    assert standby["log"] == ["click", 4]
    assert len(rebuilt_button._click_handlers.callbacks) == 1  # the notebook's; the own one is kept apart
    assert any(
        getattr(cb, "__self__", None) is rebuilt_button for cb in rebuilt_button._msg_callbacks.callbacks
    )
