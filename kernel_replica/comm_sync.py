"""Comms and widgets across executor changes: the comm registry is replicated state.

A notebook's comms (ipywidgets models, ``tqdm.auto`` bars, custom comm targets) live in the
executor's ``CommManager``; a front end that moves a slider sends its ``comm_msg`` to whichever
replica the scheduler routes the kernel's non-cell requests to, the last executor. So that the
comm exists there after an executor change, with the same id and state, every STATE carries the
comm records that changed since the last one (and the ids closed), and a ``comm_msg`` handled
between cells is replicated at once in a repair STATE (``ReplicatedNamespace.apply`` takes it
only from the replica that owns the comms: the last executor).

Chosen over re-creating widgets from the namespace: a widget's comm is a live kernel object,
unpicklable, and the front end already holds the model under its id; what must travel is the
registry (id, target, class) and the model state, which is JSON by the widget protocol.

A record: ``{"target": name}`` for any comm, plus ``"class": [module, qualname]``, ``"state"``,
``"bp"`` (buffer paths) and ``"bf"`` (buffers) for a widget, and ``"cb"``: its Python callbacks
(``on_click`` handlers, the notebook's observers), pickled with references to the namespace.
What a callback changes in the namespace between cells is not replicated until a cell names it. A standby re-creates a comm as
ipykernel does for a front end's ``comm_open`` (not primary: no ``comm_open`` goes out), with
``kernel`` unset so that nothing it does is published; the replica that executes (or is sent a
comm message) becomes the owner, ``set_owner``, and only then do its widgets talk to the front end.
Names bound to widgets are pickled as references to the model id (``reduce_comm_object``).
"""

from __future__ import annotations

import importlib
import sys
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import msgpack
import xxhash

WIDGET_MODULE = "ipywidgets.widgets.widget"
CommRecord = dict[str, Any]


def _widget_instances() -> dict[str, Any]:
    module = sys.modules.get(WIDGET_MODULE)
    return module._instances if module is not None else {}  # type: ignore[no-any-return]


# a widget's Python callbacks the notebook registered: CallbackDispatcher attributes (on_click,
# on_submit, on_msg) and observers; pickled with the namespace's functions by reference to it
DISPATCHERS = ("_click_handlers", "_submission_callbacks", "_msg_callbacks")


def _user_observers(widget: Any) -> list[tuple[str, str, Any]]:
    """(trait name, change type, handler) of the observers the notebook added: not the class's
    own (``@observe`` handlers, methods of the widget itself), nor Tandem's (``CommWatch``)."""
    from traitlets import EventHandler

    found = []
    for name, by_type in getattr(widget, "_trait_notifiers", {}).items():
        for kind, handlers in by_type.items():
            for handler in handlers:
                if isinstance(handler, EventHandler) or _own(widget, handler):
                    continue
                if getattr(handler, "_tandem_internal", False):
                    continue
                found.append((name, kind, handler))
    return found


def _own(widget: Any, callback: Any) -> bool:
    """A method of the widget itself (``Button`` handles its own messages): its class makes it."""
    return getattr(callback, "__self__", None) is widget


def _dispatcher(widget: Any, attr: str) -> Any:
    return widget.__dict__.get(attr) or getattr(widget, "_trait_values", {}).get(attr)


def _callbacks(widget: Any) -> dict[str, Any]:
    dispatchers = {}
    for attr in DISPATCHERS:
        dispatcher = _dispatcher(widget, attr)
        added = [cb for cb in dispatcher.callbacks if not _own(widget, cb)] if dispatcher is not None else []
        if added:
            dispatchers[attr] = added
    observers = _user_observers(widget)
    return {"dispatchers": dispatchers, "observers": observers} if dispatchers or observers else {}


def callback_signature(widget: Any) -> tuple[int, ...]:
    """Cheap: changes when a callback is added or removed (no trait change tells of that)."""
    callbacks = _callbacks(widget)
    ids = [id(cb) for cbs in callbacks.get("dispatchers", {}).values() for cb in cbs]
    return (*ids, *(id(h) for _, _, h in callbacks.get("observers", ())))


def _attach_callbacks(widget: Any, pickled: bytes | None, namespace: Any) -> None:
    """A standby's widget gets the executor's callbacks (replacing what it had): a button
    clicked after an executor change still runs the notebook's handler."""
    from kernel_replica.object_codec import loads

    callbacks = loads(pickled, namespace=namespace) if pickled else {}
    for name, kind, handler in _user_observers(widget):
        widget.unobserve(handler, names=name, type=kind)
    for attr in DISPATCHERS:
        dispatcher = _dispatcher(widget, attr)
        wanted = callbacks.get("dispatchers", {}).get(attr)
        if dispatcher is None and wanted:
            dispatcher = getattr(widget, attr)
        if dispatcher is not None:
            own = [cb for cb in dispatcher.callbacks if _own(widget, cb)]
            dispatcher.callbacks = [*own, *(wanted or ())]
    for name, kind, handler in callbacks.get("observers", ()):
        widget.observe(handler, names=name, type=kind)


def comm_records(
    comms: Mapping[str, Any],
    opened: Mapping[str, dict[str, Any]] | None = None,
    namespace: Mapping[str, Any] | None = None,
) -> tuple[dict[str, CommRecord], dict[str, str]]:
    """The executor's open comms as records, and the comm ids whose widget state could not be
    taken (id -> why: the notebook is told, the front end keeps working with this replica).
    ``opened``: the ``comm_open`` data and metadata of comms the front end opened, which their
    target's handler is given again where the comm is re-created (ipywidgets' control comm
    checks its protocol version there). ``namespace``: the notebook's, which its callbacks'
    functions refer to (without it, callbacks are not taken)."""
    instances = _widget_instances()
    records: dict[str, CommRecord] = {}
    failed: dict[str, str] = {}
    for comm_id, comm in list(comms.items()):
        if getattr(comm, "_closed", False):
            continue
        record: CommRecord = {"target": str(comm.target_name)}
        if opened and comm_id in opened:
            record["open"] = opened[comm_id]
        widget = instances.get(comm_id)
        if widget is not None and getattr(widget, "comm", None) is comm:
            try:
                from ipywidgets.widgets.widget import _remove_buffers

                state, paths, buffers = _remove_buffers(widget.get_state())
                record |= {
                    "class": [type(widget).__module__, type(widget).__qualname__],
                    "state": state,
                    "bp": paths,
                    "bf": [bytes(memoryview(b)) for b in buffers],
                }
                msgpack.packb(record, use_bin_type=True)  # it must travel in the log
            except Exception as exc:
                failed[comm_id] = f"{type(widget).__qualname__}: {exc.__class__.__name__}: {exc}"
                continue
            callbacks = _callbacks(widget) if namespace is not None else {}
            if callbacks:
                from kernel_replica.object_codec import dumps

                try:
                    pickled, buffers = dumps(callbacks, namespace=namespace)
                    if buffers:
                        raise TypeError("a callback holds out-of-band buffers")
                    record["cb"] = pickled
                except Exception as exc:  # the model still follows, its callbacks stay here
                    failed[comm_id] = f"its callbacks: {exc.__class__.__name__}: {exc}"
        records[comm_id] = record
    return records, failed


def record_digest(record: CommRecord) -> bytes:
    return xxhash.xxh3_128_digest(msgpack.packb(record, use_bin_type=True))


def comm_changes(
    records: Mapping[str, CommRecord], replicated: Mapping[str, bytes]
) -> tuple[dict[str, CommRecord], tuple[str, ...]]:
    """What a STATE carries: the records new or changed against the replicated digests, and
    the replicated comm ids no longer open."""
    changed = {cid: rec for cid, rec in records.items() if replicated.get(cid) != record_digest(rec)}
    closed = tuple(sorted(cid for cid in replicated if cid not in records))
    return changed, closed


class CommWatch:
    """Which comms to take records of: taking every widget's state at every cell cost 0.25 ms a
    comm (150 ms a cell with 200 sliders, their layouts and styles, measured under load), so a
    widget is observed from the first time it is seen here, and only the comms that changed
    since, that are new, or that the log lacks are taken again."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}  # comm id -> id() of the widget observed for it (0: none)
        self._dirty: set[str] = set()
        self._signatures: dict[str, tuple[int, ...]] = {}  # comm id -> callback_signature

    def _on_change(self, comm_id: str) -> Any:
        def changed(_change: Any) -> None:
            self._dirty.add(comm_id)

        changed._tandem_internal = True  # type: ignore[attr-defined]
        return changed

    def changes(
        self,
        comms: Mapping[str, Any],
        opened: Mapping[str, dict[str, Any]] | None,
        replicated: Mapping[str, bytes],
        namespace: Mapping[str, Any] | None = None,
    ) -> tuple[dict[str, CommRecord], tuple[str, ...], dict[str, str]]:
        """(records new or changed against ``replicated``, ids closed, widgets that failed)."""
        instances = _widget_instances()
        open_ids = {cid for cid, comm in comms.items() if not getattr(comm, "_closed", False)}
        wanted = {cid for cid in open_ids if cid not in replicated or cid in self._dirty}
        for comm_id in open_ids:
            widget = instances.get(comm_id)
            if self._seen.get(comm_id) != id(widget):
                self._seen[comm_id] = id(widget)
                wanted.add(comm_id)
                if widget is not None:
                    widget.observe(self._on_change(comm_id))
            if widget is not None and namespace is not None:
                signature = callback_signature(widget)
                if self._signatures.get(comm_id) != signature:
                    self._signatures[comm_id] = signature
                    wanted.add(comm_id)
        self._dirty.clear()
        self._seen = {cid: seen for cid, seen in self._seen.items() if cid in open_ids}
        self._signatures = {cid: sig for cid, sig in self._signatures.items() if cid in open_ids}
        records, failed = comm_records({cid: comms[cid] for cid in wanted}, opened, namespace)
        changed, _ = comm_changes(records, replicated)
        closed = tuple(sorted(cid for cid in replicated if cid not in open_ids))
        return changed, closed, failed


def _resolve_class(module: str, qualname: str, namespace: Mapping[str, Any]) -> Any:
    """A widget class by its import path; one defined in the notebook (``__main__``) is looked
    up in the namespace, which holds it once the cell that defined it was replicated."""
    if module == "__main__":
        owner: Any = namespace[qualname.split(".")[0]]
        parts = qualname.split(".")[1:]
    else:
        owner, parts = importlib.import_module(module), qualname.split(".")
    for part in parts:
        owner = getattr(owner, part)
    return owner


def apply_comms(
    manager: Any,
    records: Mapping[str, CommRecord],
    closed: Iterable[str],
    namespace: Mapping[str, Any],
    opened: dict[str, dict[str, Any]] | None = None,
) -> dict[str, str]:
    """A standby's side: close ``closed`` quietly, re-create missing comms (widgets first without
    state, then every widget's state, so references between models resolve in any order), and
    bring existing widgets to their recorded state. Nothing is published: these comms have no
    kernel until this replica owns them. ``opened`` learns the ``comm_open`` of front-end comms
    (``comm_records``). Returns the failures: comm id -> what and why."""
    failures: dict[str, str] = {}
    instances = _widget_instances()
    for comm_id in closed:
        if opened is not None:
            opened.pop(comm_id, None)
        comm = manager.comms.pop(comm_id, None)
        if comm is not None:
            comm._closed = True
        widget = instances.pop(comm_id, None)
        if widget is not None:
            widget.comm = None
    if not records:
        return failures

    pending: list[tuple[Any, CommRecord]] = []
    for comm_id, record in records.items():
        try:
            comm = manager.comms.get(comm_id)
            if comm is None:
                if str(record["target"]).startswith("jupyter.widget"):
                    importlib.import_module("ipywidgets")  # registers the widget comm targets
                    instances = _widget_instances()
                comm = _quiet_comm(manager, comm_id, record["target"])
                if "class" not in record:
                    target = manager.targets.get(record["target"])
                    if target is not None:  # a front end's comm: its target's handler attaches
                        target(comm, _open_message(comm_id, record))
            if opened is not None and "open" in record:
                opened[comm_id] = record["open"]
            if "class" not in record:
                continue
            widget = instances.get(comm_id)
            if widget is None or widget.comm is not comm:
                widget = _resolve_class(*record["class"], namespace)(comm=comm)
            pending.append((widget, record))
        except Exception as exc:
            what = ".".join(record["class"]) if "class" in record else f"a {record.get('target')!r} comm"
            failures[comm_id] = f"{what} could not be re-created here: {exc.__class__.__name__}: {exc}"
    if pending:
        from ipywidgets.widgets.widget import _put_buffers

        for widget, record in pending:
            state = record["state"]
            try:
                _put_buffers(state, record["bp"], record["bf"])
                widget.set_state(state)
                _attach_callbacks(widget, record.get("cb"), namespace)
            except Exception as exc:
                what = ".".join(record["class"])
                failures[widget.comm.comm_id] = (
                    f"{what}'s state could not be set here: {exc.__class__.__name__}: {exc}"
                )
    return failures


def _open_message(comm_id: str, record: CommRecord) -> dict[str, Any]:
    """The front end's ``comm_open`` as the target's handler first got it (as far as recorded)."""
    opening = record.get("open") or {}
    content = {"comm_id": comm_id, "target_name": record["target"], "data": opening.get("data", {})}
    return {"content": content, "metadata": opening.get("metadata", {}), "buffers": []}


def set_owner(comms: Mapping[str, Any], kernel: Any) -> None:
    """``kernel``: this replica now talks to the front end on every comm; None: it stopped
    (another replica executes), so its comms publish nothing (a widget skips sending while its
    comm has no kernel)."""
    for comm in list(comms.values()):
        comm.kernel = kernel


def _quiet_comm(manager: Any, comm_id: str, target: str) -> Any:
    """A comm re-created here, as ipykernel does for a front end's ``comm_open``: registered,
    not primary (no ``comm_open`` goes out) and without a kernel (it publishes nothing)."""
    from comm import create_comm

    comm = create_comm(comm_id=comm_id, primary=False, target_name=target)
    comm.kernel = None
    manager.register_comm(comm)
    return comm


def _widget_by_id(model_id: str, cls: type | None = None) -> Any:
    """The widget model ``model_id`` open here; one not open yet (its class is defined by the
    notebook, in the cell this STATE comes from) is made without state, which its comm record,
    applied again once the namespace has the class, then sets."""
    widget = _widget_instances().get(model_id)
    if widget is not None:
        return widget
    if cls is None:
        raise LookupError(f"widget model {model_id} is not open on this replica")
    import comm

    manager = comm.get_comm_manager()
    found = manager.comms.get(model_id)
    return cls(comm=found if found is not None else _quiet_comm(manager, model_id, "jupyter.widget"))


def _comm_by_id(comm_id: str) -> Any:
    import comm

    found = comm.get_comm_manager().comms.get(comm_id)
    if found is None:
        raise LookupError(f"comm {comm_id} is not open on this replica")
    return found


def _rebuild_tqdm(cls: type, state: dict[str, Any], display: bool) -> Any:
    """A progress bar on this replica: its counters as the executor left them, writing to this
    process's stderr, its widget (a reference, ``comm_sync``) pointing back at it."""
    from tqdm.utils import DisableOnWriteError

    bar = cls.__new__(cls)
    bar.__dict__.update(state)
    bar.fp = DisableOnWriteError(sys.stderr, tqdm_instance=bar)
    container = state.get("container")
    if container is not None:
        container.pbar = weakref.proxy(bar)
        bar.disp = bar.display if display else (lambda *_, **__: None)
    else:
        bar.sp = bar.status_printer(bar.fp)
    with cls.get_lock():  # type: ignore[attr-defined]
        cls._instances.add(bar)  # type: ignore[attr-defined]
    return bar


_TQDM_LIVE = ("fp", "sp", "disp")  # bound to the process: made again where the bar is loaded


# Types known to be none of the above: the picklers ask about every object they meet, and the
# three module lookups and isinstance tests cost ~0.4 us each time. A type seen before tqdm or
# ipywidgets was imported cannot subclass their classes, so a cached answer stays right.
_PLAIN_TYPES: set[type] = set()
_PLAIN_TYPES_MAX = 100_000


def reduce_front_end_object(obj: Any) -> tuple[Any, tuple[Any, ...]] | None:
    """For the picklers: a widget or comm in the namespace travels as a reference to its model
    (the comm records carry the state), not as a copy with a dead comm; a ``tqdm`` bar (console
    or ``tqdm.auto``'s widget) as its counters, without the stream and display callables bound
    to this process. None for anything else."""
    cls = type(obj)
    if cls in _PLAIN_TYPES:
        return None
    reduced = _reduce_front_end(obj)
    if reduced is None and not _is_front_end(obj):
        if len(_PLAIN_TYPES) >= _PLAIN_TYPES_MAX:
            _PLAIN_TYPES.clear()
        _PLAIN_TYPES.add(cls)
    return reduced


def _is_front_end(obj: Any) -> bool:
    bases = tuple(
        getattr(sys.modules.get(module), name)
        for module, name in (("tqdm.std", "tqdm"), (WIDGET_MODULE, "Widget"), ("comm.base_comm", "BaseComm"))
        if module in sys.modules
    )
    return isinstance(obj, bases)


def _reduce_front_end(obj: Any) -> tuple[Any, tuple[Any, ...]] | None:
    bars = sys.modules.get("tqdm.std")
    if bars is not None and isinstance(obj, bars.tqdm):
        state = {key: value for key, value in vars(obj).items() if key not in _TQDM_LIVE}
        display = getattr(obj, "disp", None) == getattr(obj, "display", object())
        return _rebuild_tqdm, (type(obj), state, display)
    module = sys.modules.get(WIDGET_MODULE)
    if module is not None and isinstance(obj, module.Widget):
        comm = obj.comm
        if comm is not None:
            # a class of the notebook travels with the reference: the comm record cannot re-create
            # the model before the namespace has the class (the same STATE may bring both)
            cls = type(obj) if type(obj).__module__ == "__main__" else None
            return _widget_by_id, (str(comm.comm_id), cls)
        return None
    base = sys.modules.get("comm.base_comm")
    if base is not None and isinstance(obj, base.BaseComm) and not obj._closed:
        return _comm_by_id, (str(obj.comm_id),)
    return None
