"""The sans-I/O cluster core: one model of the cluster that the live global scheduler and the
simulator both step (ARCHITECTURE.md §3, "one core, two drivers, all the way up").

* ``core.py``: ``ClusterCore``, built by both drivers; events in (tick, placement failed, host
  registered/removed, release failed, session/cell events), decisions out;
* ``gpu_ledger.py``: the one GPU ledger model (idle / committed to a cell / leased to a job);
* ``lifecycle.py``: the kernel lifecycle transition table, and what a lost replica means;
* ``idle.py``: the idle-host judgement behind scale-in (idle time, backoff, provider ownership);
* ``drain.py``: a host's drain, planned per replica (partial moves);
* ``moves.py``: which replica runs a cell or answers a request, which one moves where (held
  cells, replacements, drains), when a move is retried or given up, which requests are held;
* ``starts.py``: a kernel start that finds no room (scale out, wait, fail), and which kernels
  count as busy for the idle judgement;
* ``held.py``: a held cell's steps (``held_step``) and its scale-out;
* ``sessions.py``: the session-level plug-in interface and its actions;
* ``replicated.py``: the replicated-kernel plug-in (``notebookos``); the baselines are
  ``shared.policies.baselines``.
"""
