"""Gimbal's mechanisms in the job process: the squeeze/swell governor (LGRR) and LISS sampling.

The policies that drive them are pure and live in ``shared.policies.packing``."""
