"""The Jupyter Kernel Gateway HTTP/WebSocket API in front of Tandem (see ``app.py``)."""

from services.jsonschema_formats import skip_iri_grammar

skip_iri_grammar()  # before Jupyter Server loads jsonschema: a CPU-second of its start-up

# what a remote JupyterLab's server names as its kernel WebSocket connection (front_end.py says why)
V1_GATEWAY_CONNECTION = "services.http_gateway.front_end.V1GatewayWebSocketConnection"
