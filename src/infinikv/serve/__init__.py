"""``infinikv serve``: an OpenAI-compatible HTTP server where each request chooses its KV policy.

``app`` holds the HTTP layer (schemas, validation, streaming), ``scheduler`` the request queue and the
worker thread that batches requests into ``Generator.generate`` calls, ``metrics`` the Prometheus metrics,
``loadgen`` the ``infinikv bench-serve`` load generator, and ``cli`` both subcommands. Import
``infinikv.serve.app.create_app`` to serve an already-loaded model.
"""
