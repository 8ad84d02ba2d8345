"""The local scheduler: one per host; replica processes, the GPU ledger, Jupyter forwarding."""
