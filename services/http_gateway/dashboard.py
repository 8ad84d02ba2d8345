"""The operator's dashboard, served beside the Kernel Gateway API at ``/dashboard``.

What operators of NotebookOS get as a web page (#20): hosts and their GPUs by use, kernels with
their replicas, executors and last cells, migrations and scale events, best-effort apps and their
rho, refreshed every few seconds, with the operator's actions (cordon, uncordon, drain, restart a
replica). It holds no state of its own: each view is ``tandem status --json``, asked afresh of the
global scheduler and the arbiter (``cluster_file.cluster_status``), and each action is the RPC
``tandem host ...`` / ``tandem replica restart`` send, as the cluster's operator (the key the
provisioner already uses). The page is rendered here, in Python; its small script only swaps in
the fresh HTML, keeps the per-host GPU samples it has seen to draw them over time, and posts the
actions. Every route wants the API's token (``?token=`` for the page, the ``Authorization``
header for the rest): the same check as the kernels API.
"""

from __future__ import annotations

import json
import secrets
import time
from html import escape
from typing import Any

import structlog
from kernel_gateway import mixins
from tornado import web

from services.cluster_file import ClusterNotRunning, ask, cluster_status, read_cluster
from shared import messages
from shared.rpc import RpcError, RpcTimeout
from shared.security import curve

log = structlog.get_logger("http_gateway.dashboard")

LAST_CELLS = 15
LAST_EVENTS = 10
POLL_MS = 2000
ACTION_TIMEOUT_S = {"cordon": 10.0, "uncordon": 10.0, "drain": 180.0, "restart": 120.0}
HOST_ACTIONS = {
    "cordon": messages.HOST_CORDON,
    "uncordon": messages.HOST_UNCORDON,
    "drain": messages.HOST_DRAIN,
}


# ---- rendering (pure: a status in, HTML out) -----------------------------------------------------


def _clock(at: Any) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(float(at))) if isinstance(at, int | float) else "-"


def _e(value: Any) -> str:
    """Any value of the status as page text. Every value goes through here, numbers too: the
    status is what hosts and services reported, and a host's answer is not the page's code."""
    return escape(str(value))


def _n(value: Any) -> float:
    """A number of the status, 0 when it is not one (a page that renders beats a 500)."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _i(value: Any) -> int:
    return int(_n(value))


def _short(kernel_id: str) -> str:
    return escape(kernel_id[:8])


def _table(headers: list[str], rows: list[str], empty: str, table_id: str) -> str:
    if not rows:
        return f'<p class="empty" id="{table_id}">{escape(empty)}</p>'
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _button(action: str, label: str, **data: str) -> str:
    attrs = " ".join(f'data-{k}="{escape(v)}"' for k, v in data.items())
    return f'<button type="button" class="action" data-action="{action}" {attrs}>{escape(label)}</button>'


def host_usage(status: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Each host's GPUs now: cells, be (leased to best-effort jobs), free (leasable) and reserved
    (idle, kept for cells). The arbiter's per-host report when it has one (it alone knows the
    leases), else the scheduler's: committed GPUs are the cells', the rest free."""
    reported = ((status.get("batch") or {}).get("usage") or {}).get("hosts") or {}
    out = {}
    for host in status.get("hosts", []):
        gpus, cells = _i(host.get("gpus", 0)), _i(host.get("committed", 0))
        seen = reported.get(host["id"])
        if isinstance(seen, dict):
            out[host["id"]] = {k: _i(seen.get(k)) for k in ("cells", "be", "free", "reserved")}
        else:
            out[host["id"]] = {"cells": cells, "be": 0, "free": max(gpus - cells, 0), "reserved": 0}
    return out


def _gpu_bar(use: dict[str, int]) -> str:
    total = sum(use.values()) or 1
    parts = "".join(
        f'<span class="seg {kind}" style="width:{100 * n / total:.1f}%" title="{kind} {n}"></span>'
        for kind, n in use.items()
        if n
    )
    label = f"cells {use['cells']} · BE {use['be']} · free {use['free']} · reserved {use['reserved']}"
    return f'<div class="bar">{parts}</div><div class="small">{label}</div>'


def _hosts(status: dict[str, Any]) -> str:
    usage = host_usage(status)
    rows = []
    for host in status.get("hosts", []):
        hid = str(host["id"])
        state = "down" if not host.get("alive", True) else "cordoned" if host.get("cordoned") else "ready"
        warm = sum(_i(n) for n in (host.get("warm_pool") or {}).values())
        toggle = (
            _button("uncordon", "uncordon", host=hid)
            if host.get("cordoned")
            else _button("cordon", "cordon", host=hid)
        )
        rows.append(
            f'<tr id="host-{escape(hid)}" data-state="{state}"><td>{escape(hid)}</td>'
            f'<td class="state {state}">{state}</td>'
            f"<td>{_e(host.get('gpu_kind', ''))} &times; {_i(host.get('gpus', 0))}</td>"
            f"<td>{_gpu_bar(usage[hid])}</td>"
            f'<td><canvas class="history" data-host="{escape(hid)}" width="220" height="40"></canvas></td>'
            f"<td>{_e(host.get('subscribed', 0))} ({_e(host.get('subscription_ratio', 0))})</td><td>{warm}</td>"
            f"<td>{toggle} {_button('drain', 'drain', host=hid)}</td></tr>"
        )
    headers = ["host", "state", "GPUs", "GPUs now", "over time", "subscribed (SR)", "warm", "actions"]
    return _table(headers, rows, "no hosts registered", "hosts")


def _kernels(status: dict[str, Any]) -> str:
    rows = []
    for kernel in status.get("kernels", []):
        kid = str(kernel["id"])
        replicas = []
        for r in kernel.get("replicas", []):
            role = r.get("role") or ("dead" if not r.get("alive") else "-")
            executor = " executor" if r.get("id") == kernel.get("last_executor") else ""
            replicas.append(
                f'<li class="replica{executor}" data-replica="{escape(str(r["id"]))}">'
                f"{escape(str(r['id']))}@{escape(str(r.get('host')))} {escape(str(role))}"
                f"{'' if r.get('alive') else ' (down)'} pid {_e(r.get('pid'))} "
                f"{_button('restart', 'restart', kernel=kid, replica=str(r['id']))}</li>"
            )
        last = kernel.get("last_migration")
        moved = (
            f"{_e(kernel.get('migrations', 0))} (last {escape(str(last.get('replica')))} "
            f"{escape(str(last.get('from')))} → {escape(str(last.get('to')))})"
            if isinstance(last, dict)
            else _e(kernel.get("migrations", 0))
        )
        res = kernel.get("resources") or {}
        rows.append(
            f'<tr id="kernel-{escape(kid)}" data-state="{escape(str(kernel.get("state")))}">'
            f'<td title="{escape(kid)}">{_short(kid)}</td><td>{escape(str(kernel.get("state")))}</td>'
            f"<td><ul>{''.join(replicas)}</ul></td><td>{escape(str(kernel.get('last_executor') or '-'))}</td>"
            f"<td>{_e(kernel.get('held_requests', 0))}</td><td>{moved}</td>"
            f"<td>{_e(res.get('gpus', 0))} GPU, {_e(res.get('memory_mb', 0))} MB</td></tr>"
        )
    headers = ["kernel", "state", "replicas (id@host role)", "executor", "held", "migrations", "asks"]
    return _table(headers, rows, "no kernels running", "kernels")


def _cells(status: dict[str, Any]) -> str:
    rows = []
    for cell in list(status.get("cells") or [])[-LAST_CELLS:][::-1]:
        delay = cell.get("interactivity_delay_ms")
        rows.append(
            f"<tr><td>{_clock(cell.get('submitted_at'))}</td><td>{_short(str(cell.get('kernel_id', '')))}</td>"
            f"<td>{escape(str(cell.get('executor')))}@{escape(str(cell.get('host')))}</td>"
            f"<td>{'yes' if cell.get('immediate') else 'no'}</td>"
            f"<td>{'-' if delay is None else _e(delay)}</td><td>{_e(cell.get('task_completion_ms', '-'))}</td></tr>"
        )
    headers = ["submitted (UTC)", "kernel", "executor", "committed at once", "delay ms", "completion ms"]
    return _table(headers, rows, "no cells yet", "cells")


def _migrations(status: dict[str, Any]) -> str:
    moves = [
        (k, k["last_migration"])
        for k in status.get("kernels", [])
        if isinstance(k.get("last_migration"), dict)
    ]
    moves.sort(key=lambda m: -_n(m[1].get("at")))
    rows = [
        f"<tr><td>{_clock(m.get('at'))}</td><td>{_short(str(k['id']))}</td>"
        f"<td>{escape(str(m.get('replica')))} → {escape(str(m.get('new_replica')))}</td>"
        f"<td>{escape(str(m.get('from')))} → {escape(str(m.get('to')))}</td>"
        f"<td>{escape(str(m.get('reason')))}</td><td>{_e(m.get('seconds'))}</td></tr>"
        for k, m in moves[:LAST_EVENTS]
    ]
    headers = ["at (UTC)", "kernel", "replica", "hosts", "reason", "seconds"]
    return _table(headers, rows, "no migrations (each kernel's last one is kept)", "migrations")


def _scale_events(status: dict[str, Any]) -> str:
    rows = [
        f"<tr><td>{_clock(e.get('at'))}</td><td>{escape(str(e.get('kind')))}</td>"
        f"<td>{escape(', '.join(map(str, e.get('hosts') or [])))}</td><td>{escape(str(e.get('reason')))}</td></tr>"
        for e in list(status.get("scale_events") or [])[-LAST_EVENTS:][::-1]
    ]
    return _table(["at (UTC)", "kind", "hosts", "reason"], rows, "no scale events", "scale-events")


def _batch(status: dict[str, Any]) -> str:
    batch = status.get("batch")
    if not batch:
        return '<p class="empty">this cluster runs no arbiter: no best-effort jobs</p>'
    usage = batch.get("usage") or {}
    share = usage.get("utilization") or {}
    now = usage.get("gpus_now") or {}
    summary = (
        f'<p id="gpu-time">GPUs now: cells {_e(now.get("cells", 0))}, best-effort {_e(now.get("be", 0))}, '
        f"idle {_e(now.get('idle', 0))} of {_e(now.get('provisioned', 0))}; share of provisioned GPU time so far: "
        f"cells {_n(share.get('cells')):.0%}, best-effort {_n(share.get('be')):.0%}, idle {_n(share.get('idle')):.0%}; "
        f"BE capacity {_e(usage.get('be_capacity_gpus', 0))} GPUs, {_e(batch.get('rounds', 0))} arbiter rounds</p>"
    )
    rows = []
    for app_id, app in sorted((batch.get("apps") or {}).items()):
        rho = app.get("rho")
        jobs = ", ".join(f"{n} {state}" for state, n in sorted((app.get("jobs") or {}).items()))
        rows.append(
            f"<tr><td>{escape(str(app_id))}</td><td>{'-' if rho is None else f'{_n(rho):.2f}'}</td>"
            f"<td>{_n(app.get('gpu_seconds')):.0f}</td><td>{_e(app.get('gpus_now', 0))}</td>"
            f"<td>{escape(jobs)}</td></tr>"
        )
    apps = _table(["app", "rho", "GPU s", "GPUs now", "jobs"], rows, "no best-effort apps", "apps")
    leases = [
        f"<tr><td>{_clock(e.get('at'))}</td><td>{escape(str(e.get('event')))}</td>"
        f"<td>{escape(str(e.get('app_id', '-')))}</td><td>{escape(str(e.get('job_id')))}</td>"
        f"<td>{escape(str(e.get('host')))}</td></tr>"
        for e in list(batch.get("lease_events") or [])[-LAST_EVENTS:][::-1]
    ]
    lease_table = _table(["at (UTC)", "lease", "app", "job", "host"], leases, "no lease events", "leases")
    return summary + apps + "<h3>Lease events</h3>" + lease_table


def _summary(status: dict[str, Any]) -> str:
    c, m = status.get("cluster") or {}, status.get("metrics") or {}
    delay = (m.get("interactivity_delay_ms") or {}).get("p50")
    links = " ".join(
        f'<a href="{escape(str(url))}">{name} /metrics</a>'
        for name, url in (
            ("scheduler", m.get("prometheus_url")),
            ("arbiter", (status.get("batch") or {}).get("prometheus_url")),
        )
        if isinstance(url, str) and url.startswith(("http://", "https://"))  # no javascript: links
    )
    return (
        f'<p id="summary">policy {_e(status.get("policy", "-"))} · {_e(c.get("hosts", 0))} hosts · '
        f"{_e(c.get('kernels', 0))} kernels · GPUs committed {_e(c.get('committed_gpus', 0))}/"
        f"{_e(c.get('provisioned_gpus', 0))} · SR {_e(c.get('subscription_ratio', 0))} · "
        f"migrations {_e(c.get('migrations', 0))} · cells {_e(m.get('cells_total', 0))} "
        f"(committed at once: {_e(m.get('immediate_commit_ratio'))}, delay p50 {_e(delay)} ms) · "
        f"warm runtimes {_e(c.get('warm_runtimes', 0))} · {links}</p>"
    )


def render_body(status: dict[str, Any]) -> str:
    """The page's live part for one ``tandem status --json``."""
    sections = [
        ("Hosts and GPUs", _hosts(status)),
        ("Kernels", _kernels(status)),
        ("Last cells", _cells(status)),
        ("Migrations", _migrations(status)),
        ("Scale events", _scale_events(status)),
        ("Best-effort apps", _batch(status)),
    ]
    return _summary(status) + "".join(f"<section><h2>{t}</h2>{body}</section>" for t, body in sections)


def render_error(message: str) -> str:
    return f'<p class="error" id="summary">cluster unreachable: {escape(message)}</p>'


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Tandem dashboard</title>
<style>
body {{ font: 14px system-ui, sans-serif; margin: 1em 2em; color: #222; }}
h1 {{ font-size: 1.4em; margin: 0 0 .2em; }} h2 {{ font-size: 1.1em; margin: 1.2em 0 .3em; }}
h3 {{ font-size: 1em; margin: .8em 0 .2em; }}
table {{ border-collapse: collapse; width: 100%; }} td, th {{ border-bottom: 1px solid #ddd; padding: 3px 6px;
text-align: left; vertical-align: top; }} th {{ background: #f4f4f4; }} ul {{ margin: 0; padding-left: 1em; }}
.bar {{ display: flex; width: 180px; height: 12px; background: #eee; }} .seg {{ display: block; height: 100%; }}
.cells {{ background: #2f6fdf; }} .be {{ background: #f08c00; }} .free {{ background: #40c057; }}
.reserved {{ background: #adb5bd; }} .small {{ font-size: 11px; color: #555; }} .empty {{ color: #777; }}
.state.cordoned {{ color: #b8860b; }} .state.down, .error {{ color: #c00; }} .replica.executor {{ font-weight: 600; }}
#flash {{ min-height: 1.3em; color: #0b6; }} #flash.failed {{ color: #c00; }} .legend span {{ padding: 0 .4em; }}
</style></head>
<body><h1>Tandem</h1>
<div class="small">refreshed every {poll_s:g} s · <span id="updated">{updated}</span> UTC ·
<span class="legend"><span class="cells">&nbsp;</span> cells <span class="be">&nbsp;</span> best-effort
<span class="free">&nbsp;</span> free <span class="reserved">&nbsp;</span> reserved idle</span></div>
<div id="flash"></div>
<div id="live">{body}</div>
<script nonce="{nonce}">
const token = new URLSearchParams(location.search).get("token") || "";
const auth = {{"Authorization": "token " + token}};
const history = {{}};  // host -> [{{cells, be, free, reserved}}], newest last
const SAMPLES = 60;  // two minutes at one sample per refresh
const colors = {{cells: "#2f6fdf", be: "#f08c00", free: "#40c057", reserved: "#adb5bd"}};
function remember(usage) {{
  for (const [host, use] of Object.entries(usage)) {{
    (history[host] = history[host] || []).push(use);
    if (history[host].length > SAMPLES) history[host].shift();
  }}
}}
function draw() {{
  for (const canvas of document.querySelectorAll("canvas.history")) {{
    const samples = history[canvas.dataset.host] || [], ctx = canvas.getContext("2d");
    const w = canvas.width / SAMPLES, x0 = canvas.width - samples.length * w;
    ctx.fillStyle = "#f4f4f4"; ctx.fillRect(0, 0, canvas.width, canvas.height);
    samples.forEach((use, i) => {{
      const total = Object.values(use).reduce((a, b) => a + b, 0) || 1;
      let y = canvas.height;
      for (const kind of ["cells", "be", "reserved", "free"]) {{
        const h = canvas.height * use[kind] / total;
        ctx.fillStyle = colors[kind]; ctx.fillRect(x0 + i * w, y - h, w, h); y -= h;
      }}
    }});
  }}
}}
async function refresh() {{
  try {{
    const answer = await fetch("{base}/dashboard/state", {{headers: auth}});
    const state = await answer.json();
    if (!answer.ok) throw new Error(state.message || answer.statusText);
    document.getElementById("live").innerHTML = state.html;
    document.getElementById("updated").textContent = state.updated;
    remember(state.usage); draw();
  }} catch (err) {{ flash("refresh failed: " + err.message, true); }}
}}
function flash(text, failed) {{
  const el = document.getElementById("flash"); el.textContent = text; el.className = failed ? "failed" : "";
}}
document.addEventListener("click", async (event) => {{
  const button = event.target.closest("button.action");
  if (!button) return;
  const d = button.dataset, path = d.host ? "hosts/" + d.host + "/" + d.action
    : "kernels/" + d.kernel + "/replicas/" + d.replica + "/restart";
  if (d.action !== "cordon" && d.action !== "uncordon" && !confirm(d.action + " " + (d.host || d.replica) + "?")) return;
  button.disabled = true; flash(d.action + " " + (d.host || d.kernel + "/" + d.replica) + "…");
  try {{
    const answer = await fetch("{base}/dashboard/" + path, {{method: "POST", headers: auth}});
    const result = await answer.json();
    flash(result.message, !answer.ok);
  }} catch (err) {{ flash(d.action + " failed: " + err.message, true); }}
  refresh();
}});
remember({usage}); draw();
setInterval(refresh, {poll_ms});
</script></body></html>
"""


def script_json(value: Any) -> str:
    """JSON to put inside a ``<script>``: no ``</script>`` or ``<!--`` can end it early."""
    return json.dumps(value).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def content_security_policy(nonce: str) -> str:
    """The page's one script (by its nonce) and fetches to this server: markup that got into the
    page some other way runs nothing (no inline handlers, no other scripts), and no other site
    frames the page or receives a form from it."""
    script = f"'nonce-{nonce}'" if nonce else "'none'"
    return (
        f"default-src 'none'; script-src {script}; style-src 'unsafe-inline'; connect-src 'self'; "
        "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )


def render_page(status: dict[str, Any] | None, error: str = "", base: str = "", nonce: str = "") -> str:
    """The whole page: the live part rendered now, and the script (``nonce``: the one its
    Content-Security-Policy names) that refreshes it."""
    body = render_body(status) if status is not None else render_error(error)
    usage = host_usage(status) if status is not None else {}
    return PAGE.format(
        body=body,
        nonce=escape(nonce),
        usage=script_json(usage),
        updated=_clock(time.time()),
        poll_ms=POLL_MS,
        poll_s=POLL_MS / 1000,
        base=escape(base.rstrip("/")),
    )


def action_message(action: str, target: str, outcome: dict[str, Any]) -> tuple[bool, str]:
    """What an action's answer means for the operator: (succeeded, one line)."""
    if action == "drain":
        failed = outcome.get("failed") or []
        moved = len(outcome.get("moved") or [])
        text = f"{target}: drained, {moved} replicas moved, {outcome.get('replicas_left', 0)} left"
        if failed:
            reasons = "; ".join(f"{f.get('kernel')}/{f.get('replica')}: {f.get('reason')}" for f in failed)
            return False, f"{text}; not moved: {reasons}"
        return True, text
    if action == "restart":
        replica = target.rsplit("/", 1)[-1]
        pid = next((r.get("pid") for r in outcome.get("replicas", []) if r.get("id") == replica), None)
        return True, f"{target}: restarted (pid {pid})"
    return True, f"{target}: {action}ed"


# ---- handlers ----------------------------------------------------------------------------------------


class _Authenticated(mixins.TokenAuthorizationMixin, mixins.JSONErrorsMixin, web.RequestHandler):  # type: ignore[misc]
    """The API's token check (``prepare``) and JSON errors."""

    def set_default_headers(self) -> None:
        self.set_header("Cache-Control", "no-store")
        self.set_header("X-Frame-Options", "DENY")
        self.set_header("X-Content-Type-Options", "nosniff")
        # the page's address holds the token (?token=): no link or fetch from it may carry it
        # to another site in a Referer
        self.set_header("Referrer-Policy", "no-referrer")
        self.set_header("Content-Security-Policy", content_security_policy(""))

    async def status(self) -> dict[str, Any]:
        return await cluster_status(read_cluster())


class PageHandler(_Authenticated):
    async def get(self) -> None:
        try:
            status, error = await self.status(), ""
        except (ClusterNotRunning, RpcError, RpcTimeout) as exc:
            status, error = None, str(exc) or type(exc).__name__
        nonce = secrets.token_urlsafe(16)
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.set_header("Content-Security-Policy", content_security_policy(nonce))
        self.finish(render_page(status, error, self.settings.get("base_url", ""), nonce))


class StateHandler(_Authenticated):
    async def get(self) -> None:
        try:
            status = await self.status()
        except (ClusterNotRunning, RpcError, RpcTimeout) as exc:
            message = str(exc) or type(exc).__name__
            self.finish({"html": render_error(message), "usage": {}, "updated": _clock(time.time())})
            return
        self.finish(
            {"html": render_body(status), "usage": host_usage(status), "updated": _clock(time.time())}
        )


class _ActionHandler(_Authenticated):
    async def act(self, action: str, target: str, msg_type: str, body: dict[str, Any]) -> None:
        """One operator RPC to the scheduler; the answer as ``{ok, message}``."""
        try:
            cluster = read_cluster()
            outcome = await ask(
                cluster.scheduler,
                msg_type,
                body,
                credentials=cluster.operator_curve(curve.SCHEDULER),
                timeout=ACTION_TIMEOUT_S[action],
            )
        except (ClusterNotRunning, RpcError, RpcTimeout) as exc:
            self.set_status(400 if isinstance(exc, RpcError) else 503)
            self.finish({"ok": False, "message": f"{action} {target}: {exc or type(exc).__name__}"})
            return
        ok, message = action_message(action, target, outcome)
        log.info("dashboard_action", action=action, target=target, ok=ok)
        self.set_status(200 if ok else 409)
        self.finish({"ok": ok, "message": message})


class HostActionHandler(_ActionHandler):
    """POST ``hosts/<host>/<cordon|uncordon|drain>``."""

    async def post(self, host: str, action: str) -> None:
        await self.act(action, host, HOST_ACTIONS[action], {"host_id": host})


class ReplicaRestartHandler(_ActionHandler):
    """POST ``kernels/<kernel>/replicas/<replica>/restart``."""

    async def post(self, kernel: str, replica: str) -> None:
        body = {"kernel_id": kernel, "replica_id": replica}
        await self.act("restart", f"{kernel}/{replica}", messages.REPLICA_RESTART, body)


_NAME = r"([A-Za-z0-9_.:-]+)"


def handlers(base_url: str = "/") -> list[tuple[str, type[web.RequestHandler]]]:
    base = base_url.rstrip("/")
    return [
        (rf"{base}/dashboard/?", PageHandler),
        (rf"{base}/dashboard/state", StateHandler),
        (rf"{base}/dashboard/hosts/{_NAME}/(cordon|uncordon|drain)", HostActionHandler),
        (rf"{base}/dashboard/kernels/{_NAME}/replicas/{_NAME}/restart", ReplicaRestartHandler),
    ]


def add_dashboard(web_app: web.Application) -> None:
    """The dashboard's routes; ``add_handlers`` puts them ahead of the API's (whose last route
    answers every other path)."""
    web_app.add_handlers(r".*$", handlers(str(web_app.settings.get("base_url") or "/")))
