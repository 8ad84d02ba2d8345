"""The Jupyter Kernel Gateway HTTP/WebSocket API in front of Tandem (see ``app.py``)."""
