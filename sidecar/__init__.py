"""The sidecar: an OpenAI-compatible proxy beside a worker's engines that picks, per request, the engine to serve it."""
