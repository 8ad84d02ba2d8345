"""The Jupyter-facing edge of Tandem: see ``service.Gateway``."""
