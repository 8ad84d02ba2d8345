"""The sans-I/O cluster core: one model of the cluster that the live global scheduler and the
simulator both step (ARCHITECTURE.md §3, "one core, two drivers, all the way up")."""
